import contextlib

import pytest
import torch
from torch import nn

from course_utils.ddp.amp import ScalerStep, autocast, grad_scaler, output_dtypes, scaler_steps
from course_utils.ddp.train import TrainConfig, train_ddp, train_reference
from course_utils.distributed import launch


def test_autocast_modes():
    assert isinstance(autocast("off"), contextlib.nullcontext)
    with autocast("bf16"):
        assert (torch.randn(2, 3) @ torch.randn(3, 2)).dtype == torch.bfloat16
    with autocast("fp16"):
        assert nn.Linear(3, 2)(torch.randn(2, 3)).dtype == torch.float16
    with pytest.raises(ValueError, match="amp must be one of"):
        autocast("int8")
    with pytest.raises(ValueError, match="device_type"):
        autocast("bf16", "tpu")


def test_grad_scaler_scales_only_fp16():
    assert grad_scaler("fp16").is_enabled()
    assert not grad_scaler("bf16").is_enabled()
    assert not grad_scaler("off").is_enabled()


def test_output_dtypes_under_bf16():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    rows = output_dtypes(model, torch.randn(5, 4), "bf16", loss_fn=nn.functional.cross_entropy,
                         target=torch.randint(0, 3, (5,)))
    assert [r[1] for r in rows] == ["Linear", "ReLU", "Linear", "cross_entropy"]
    assert [r[2] for r in rows] == [torch.bfloat16] * 3 + [torch.float32]
    assert output_dtypes(model, torch.randn(5, 4), "off")[0][2] == torch.float32
    assert not model._forward_hooks and not model[0]._forward_hooks  # hooks removed


def test_fp16_gradients_underflow_without_scaling_and_survive_with_it():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(16, 8)

    def grads(amp, scale):
        model.zero_grad()
        scaler = torch.amp.GradScaler("cpu", enabled=scale)
        with autocast(amp):
            loss = (model(x).float() * 1e-8).sum()
        scaler.scale(loss).backward()
        if scale:
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
        return model.weight.grad.clone()

    reference = grads("off", False)
    assert torch.count_nonzero(grads("fp16", False)) == 0
    torch.testing.assert_close(grads("fp16", True), reference, rtol=2e-2, atol=1e-10)


def test_amp_config_and_training():
    with pytest.raises(ValueError, match="amp must be one of"):
        TrainConfig(amp="fp8")
    full = train_reference(TrainConfig(epochs=3), 2)
    bf16 = train_reference(TrainConfig(epochs=3, amp="bf16"), 2)
    assert abs(bf16["losses"][-1] - full["losses"][-1]) < 0.05 * full["losses"][-1]
    # fp16's GradScaler starts at 2**16 and skips the first steps whose gradients overflow,
    # so it lags at first and catches up
    fp16 = train_reference(TrainConfig(epochs=3, amp="fp16"), 2)
    assert fp16["losses"][-1] > full["losses"][-1]
    full, fp16 = (train_reference(TrainConfig(epochs=20, amp=amp), 2) for amp in ("off", "fp16"))
    assert abs(fp16["losses"][-1] - full["losses"][-1]) < 0.1 * full["losses"][-1]


def test_amp_inside_ddp_matches_one_process():
    config = TrainConfig(amp="bf16")
    results = launch(train_ddp, 2, config, echo=False)
    reference = train_reference(config, 2)
    for name, value in reference["params"].items():
        torch.testing.assert_close(results[0]["params"][name], value, rtol=1e-2, atol=2e-3)
        assert torch.equal(results[0]["params"][name], results[1]["params"][name])


def test_fp16_underflows_only_below_half_its_smallest_subnormal():
    """Notebook 08's rule: normals stop at 2**-14, subnormals at 2**-24, and a value rounds to the
    nearest fp16 number, so only values below 2**-25 become zero (2**-25 itself ties to even: 0)."""
    info = torch.finfo(torch.float16)
    assert info.tiny == 2.0**-14 and info.tiny * info.eps == 2.0**-24
    def fp16(x):
        return torch.tensor(x, dtype=torch.float64).half().item()

    assert fp16(4e-8) == fp16(3e-8) == 2.0**-24  # below the smallest subnormal, still not zero
    assert fp16(2.0**-25) == 0 and fp16(2.0**-25 * 1.001) == 2.0**-24 and fp16(2.9e-8) == 0


def test_scaler_steps_records_the_skipped_first_step_of_fp16_training():
    """Notebook 08's fp16 curve lags fp32 because GradScaler skips step 0 (inf at 65536), not
    because of fp16's rounding: started at 256, nothing is skipped and the gap closes."""
    fp32 = train_reference(TrainConfig(epochs=3, amp="off"), 2)["losses"]
    with scaler_steps() as steps:
        fp16 = train_reference(TrainConfig(epochs=3, amp="fp16"), 2)["losses"]
    assert steps[0] == ScalerStep(0, 65536.0, 32768.0) and steps[0].skipped
    assert [s.step for s in steps if s.skipped] == [0] and len(steps) == len(fp16)
    with scaler_steps(init_scale=256) as low:
        fp16_low = train_reference(TrainConfig(epochs=3, amp="fp16"), 2)["losses"]
    assert low[0].scale == 256 and not any(s.skipped for s in low)

    def gap(losses):
        return max(abs(a / b - 1) for a, b in zip(losses, fp32, strict=True))

    assert gap(fp16_low) < 0.01 < gap(fp16)
    with scaler_steps() as none:  # bf16 and fp32: a disabled scaler decides nothing
        train_reference(TrainConfig(epochs=1, amp="bf16"), 2)
    assert none == []


def test_scaler_steps_puts_the_scaler_back_and_counts_per_scaler():
    init, update = torch.amp.GradScaler.__init__, torch.amp.GradScaler.update
    with scaler_steps(init_scale=8.0) as steps:
        scalers = [torch.amp.GradScaler("cpu", growth_interval=1), torch.amp.GradScaler("cpu", 4.0)]
        for scaler in scalers:
            weight = nn.Parameter(torch.zeros(1))
            optimizer = torch.optim.SGD([weight], lr=0.0)
            scaler.scale(torch.ones(1))
            weight.grad = torch.ones(1)
            scaler.step(optimizer)
            scaler.update()
    assert steps == [ScalerStep(0, 8.0, 16.0), ScalerStep(0, 8.0, 8.0)]  # the second asked for 4.0
    assert (torch.amp.GradScaler.__init__, torch.amp.GradScaler.update) == (init, update)
    with pytest.raises(ValueError, match="init_scale"), scaler_steps(init_scale=0):
        pass
