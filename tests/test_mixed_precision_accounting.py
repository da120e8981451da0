"""Notebook 11's mixed-precision memory: the accounting the course's recipe implies (autocast and
FSDP2 keep fp32 parameters: 4 + 4 + 8 bytes), DeepSpeed's and Apex O2's beside it (2 + 2 + 12),
and exercise 11.3 judged by the first."""

import pytest
import torch
from torch import nn

from course_utils.dataparallel.memory import ModelSpec
from course_utils.exercises import nb11
from course_utils.sharding import ledgers

STATE = ("parameters", "gradients", "optimizer state")


def model_state(spec, strategy, accounting, n):
    led = ledgers.sharded_ledger(spec, strategy, batch_size=8, num_devices=n, mixed_precision=accounting)
    return sum(led.rows[0][c] for c in STATE)


def test_autocast_keeps_parameters_gradients_and_adamw_state_in_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 8))
    assert out.dtype == torch.bfloat16  # the computation ran in bf16...
    out.float().sum().backward()
    optimizer.step()
    held = [t for p in model.parameters() for t in (p, p.grad, *optimizer.state[p].values())
            if t.dim() > 0]  # AdamW's step counter is a scalar
    assert len(held) == 4 * 4 and {t.dtype for t in held} == {torch.float32}  # ...and all stays fp32
    assert ledgers.BYTES_PER_PARAMETER["autocast"] == (4, 4, 8)


def test_autocast_s_16_bit_weight_copies_live_until_each_layer_s_backward():
    """Not state, but not short-lived either: autograd saves autocast's bf16 copy of each weight
    whose layer's input needs a gradient (all but the first layer) for that layer's backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 6))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(5, 24))
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    copies = [t for t in saved if t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[0] != 5]
    assert sorted(tuple(t.shape) for t in copies) == sorted(tuple(w.t().shape) for w in weights[1:])
    assert sum(t.nbytes for t in copies) == 2 * sum(w.numel() for w in weights[1:])
    for copy, weight in zip(copies, weights[1:], strict=True):
        assert torch.equal(copy.t(), weight.detach().bfloat16())  # the cast weight itself
    out.float().sum().backward()  # and backward uses them
    assert all(w.grad is not None for w in weights)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_two_accountings_by_stage(n):
    spec = ModelSpec.linear(1023, 1)  # 1024 parameters, divisible by 8: no padding
    psi = spec.parameters
    autocast = {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n,
                "zero3": 16 * psi / n}
    master = {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / n, "zero2": 2 * psi + 14 * psi / n,
              "zero3": 16 * psi / n}
    for strategy in autocast:
        assert model_state(spec, strategy, "autocast", n) == autocast[strategy]
        assert model_state(spec, strategy, "master_weights", n) == master[strategy]
        assert model_state(spec, strategy, True, n) == master[strategy]  # notebook 10's spelling
        assert model_state(spec, strategy, False, n) == autocast[strategy]  # fp32 holds the same


def test_bert_zero1_on_four_ranks_is_10_bytes_per_parameter_not_7():
    bert = ModelSpec.bert_like()
    mib = 2**20
    autocast = model_state(bert, "zero1", "autocast", 4)
    master = model_state(bert, "zero1", "master_weights", 4)
    assert round(autocast / bert.parameters) == 10 and round(master / bert.parameters) == 7
    assert (round(autocast / mib), round(master / mib)) == (1259, 882)


def test_a_bad_accounting_is_refused():
    with pytest.raises(ValueError, match="mixed_precision"):
        ledgers.sharded_ledger(ModelSpec.linear(3, 1), "ddp", batch_size=2, num_devices=2,
                                mixed_precision="fp16")


def test_exercise_09_3_is_judged_by_the_autocast_accounting():
    p, g, k = ledgers.BYTES_PER_PARAMETER["autocast"]
    for psi, n in ((1e9, 8), (7e9, 4), (3e9, 64)):
        assert nb11._STATE["ddp"](psi, n) == (p + g + k) * psi
        assert nb11._STATE["zero2"](psi, n) == p * psi + (g + k) * psi / n
        assert nb11._STATE["fsdp"](psi, n) == (p + g + k) * psi / n
    # the two accountings disagree on at least one case, where the master-copy count gets its hint
    differ = [args for args in nb11._CASES
              if nb11._choose(*args) != nb11._choose(*args, state_bytes=nb11._MASTER_WEIGHTS)]
    assert differ

    def master_copy_answer(parameters, gpu_bytes, gpus, activation_bytes):
        return nb11._choose(parameters, gpu_bytes, gpus, activation_bytes, nb11._MASTER_WEIGHTS)

    hint = nb11._judge_choose(master_copy_answer)
    assert hint is not None and "DeepSpeed's and Apex O2's accounting" in hint
