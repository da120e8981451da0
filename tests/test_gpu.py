"""Every CUDA branch of course_utils, on real GPUs: run by `make gpu-check` (or `pytest -m gpu tests`).

No GPU is available in CI, so these tests are collected everywhere and, without GPUs, reported
SKIPPED with the number of GPUs they need (pytest's `-ra` summary lists the reasons). A test that
can run on one GPU is parametrised by the device count: on one GPU its 1-GPU case runs and only
the 2-GPU case is skipped. `course_utils.tools.gpu_check` accepts a skip only when its reason is
"needs N GPUs; this machine has M" with N > M, so keep that wording in `needs_gpus`.

Precision: every test runs with TF32 off (the `exact_fp32` fixture, also for the processes the
tests start), so the fp32 comparisons below hold on Ampere and Hopper too, where TF32's 10-bit
mantissa would give differences of about 1e-3.
"""

import copy
import gc
import math
import subprocess
import sys

import psutil
import pytest
import torch
from torch import nn

from course_utils.dataparallel.by_hand import DataParallelByHand, data_parallel
from course_utils.dataparallel.evidence import compare_training
from course_utils.dataparallel.memory import ModelSpec, cuda_peak_bytes, ledger
from course_utils.dataparallel.parallel_criterion import DataParallelCriterion, DataParallelModel
from course_utils.dataparallel.simulated import course_devices
from course_utils.ddp import demos
from course_utils.ddp.amp import autocast, grad_scaler, output_dtypes
from course_utils.ddp.collectives import check_ring_all_reduce
from course_utils.ddp.train import TrainConfig, train_ddp, train_reference
from course_utils.devices import choose_backend
from course_utils.distributed import launch
from course_utils.faults.torchrun import torchrun
from course_utils.models import SmallCNN

#: NVML's count: it does not initialise CUDA, so collecting this file leaves forking safe.
GPUS = torch.cuda.device_count()
MiB = 2**20
#: fp32 on a GPU against fp32 elsewhere (the CPU, another split of the batch): with TF32 off only
#: the order of the sums differs, about 1e-7 relative per operation; 1e-4 leaves room for a few
#: training steps and still catches TF32 (about 1e-3) or any real error.
FP32 = {"rtol": 1e-4, "atol": 1e-5}


def needs_gpus(n: int) -> list:
    """The `gpu` marker and a skip, with its reason, on a machine with fewer than ``n`` GPUs."""
    reason = f"needs {n} GPU{'s' if n > 1 else ''}; this machine has {GPUS}"
    return [pytest.mark.gpu, pytest.mark.skipif(GPUS < n, reason=reason)]


pytestmark = pytest.mark.gpu
#: one GPU already exercises the real torch.nn.parallel path; two also split the batch
DEVICE_COUNTS = [pytest.param(n, marks=needs_gpus(n), id=f"{n}gpu") for n in (1, 2)]


@pytest.fixture(autouse=True)
def exact_fp32(monkeypatch):
    """TF32 off here and in every process a test starts (NVIDIA_TF32_OVERRIDE=0); restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def to_cpu(value):
    """Tensors anywhere inside dicts, lists and tuples, moved to the CPU for comparison."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


# ----------------------------------------------------------------------- by_hand on real GPUs


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).cuda()


@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_by_hand_equals_nn_data_parallel(n):
    """The same primitives as nn.DataParallel: same outputs, gradients and BatchNorm buffers.

    Both run torch.nn.parallel's scatter, replicate, parallel_apply and gather, so the kernels and
    chunks are the same: the default fp32 tolerances of assert_close apply (TF32 is off anyway)."""
    devices = course_devices(n)
    assert devices == [torch.device("cuda", i) for i in range(n)]  # real GPUs, not simulated
    ours_net, theirs_net = bn_net(), bn_net()
    ours = DataParallelByHand(ours_net, devices)
    theirs = nn.DataParallel(theirs_net, device_ids=list(range(n)))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(11, 6, generator=g).cuda()  # 11 rows: uneven chunks on 2 GPUs
        t = torch.randint(0, 3, (11,), generator=g).cuda()
        out_ours, out_theirs = ours(x), theirs(x)
        assert out_ours.device == out_theirs.device == torch.device("cuda", 0)
        torch.testing.assert_close(out_ours, out_theirs, msg=lambda m, s=step: f"step {s}: {m}")
        nn.functional.cross_entropy(out_ours, t).backward()
        nn.functional.cross_entropy(out_theirs, t).backward()
        for (name, p), q in zip(ours_net.named_parameters(), theirs_net.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, s=step, k=name: f"step {s} {k}: {m}")
        for (name, b), c in zip(ours_net.named_buffers(), theirs_net.buffers(), strict=True):
            torch.testing.assert_close(b, c, msg=lambda m, s=step, k=name: f"step {s} {k}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    assert ours_net[1].num_batches_tracked.item() == 3
    x = torch.randn(9, 6, generator=g).cuda()  # the functional forms too
    a, b = bn_net(), bn_net()
    torch.testing.assert_close(data_parallel(a, x, devices),
                               nn.parallel.data_parallel(b, x, list(range(n))))
    torch.testing.assert_close(a[1].running_mean, b[1].running_mean)


@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_compare_training_on_real_gpus(n):
    """Data-parallel training of a CNN equals one-GPU training (cuDNN convolutions, TF32 off)."""
    torch.manual_seed(0)
    model = SmallCNN().cuda()
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(10, 1, 16, 16, generator=g).cuda(),
                torch.randint(0, 4, (10,), generator=g).cuda()) for _ in range(3)]
    result = compare_training(model, batches, nn.functional.cross_entropy, course_devices(n), check=False)
    assert result.devices == n and result.steps == 3
    assert max(result.max_output_diff, result.max_grad_diff, result.max_param_diff) < 1e-4, str(result)


# ----------------------------------------------------------------------- the parallel criterion


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n", DEVICE_COUNTS)
def test_parallel_criterion_equals_one_device(n, reduction):
    """Outputs stay on their GPUs, the loss is reduced on GPU 0, training equals one GPU's."""
    devices = course_devices(n)
    torch.manual_seed(0)
    single = nn.Sequential(nn.Linear(5, 32), nn.ReLU(), nn.Linear(32, 7)).cuda()
    parallel = copy.deepcopy(single)
    model = DataParallelModel(parallel, devices)
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(reduction=reduction), devices)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (single, parallel)]
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(9, 5, generator=g).cuda()
        t = torch.randint(0, 7, (9,), generator=g).cuda()
        outputs = model(x)
        assert [o.device for o in outputs] == devices
        loss = criterion(outputs, t)
        expected = nn.functional.cross_entropy(single(x), t, reduction=reduction)
        assert loss.device == devices[0]
        torch.testing.assert_close(loss, expected, **FP32)
        loss.backward()
        expected.backward()
        for p, q in zip(parallel.parameters(), single.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **FP32, msg=lambda m, s=step: f"step {s}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for p, q in zip(parallel.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p, q, **FP32)


# ----------------------------------------------------------------------- memory: measured vs modelled

#: notebook 04's BERT-like model, 8 rows per GPU
BERT = {"vocab": 30522, "hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024}
SEQ = 128
MEMORY_CASES = [pytest.param(strategy, output_device, n, marks=needs_gpus(n),
                             id=f"{strategy}-out{output_device}-{n}gpu")
                for n in (1, 2) for strategy, output_device in
                (("dp", 0), ("dp", 1), ("parallel_criterion", 0), ("ddp", 0)) if output_device < n]


@pytest.mark.parametrize(("strategy", "output_device", "n"), MEMORY_CASES)
def test_cuda_peak_bytes_agree_with_the_ledger(strategy, output_device, n):
    """``torch.cuda.max_memory_allocated`` within a stated band around the ledger, per GPU.

    The ledger counts what coexists at the start of backward. The measured peak differs by:
    - less: every gradient is counted, but ``zero_grad`` sets them to None and backward creates
      them while it frees activations; and the activations were measured on the CPU, whose
      attention saves its probability matrices, which CUDA's memory-efficient attention does
      not. Hence the lower bound, 75 % of the ledger.
    - more: log_softmax's backward holds one more logits-sized gradient next to the log-
      probabilities on the device that computes the loss (the whole batch's logits for
      DataParallel's ``output_device``); DataParallel's other GPUs receive their chunk of the
      outputs' gradient, which the ledger leaves out; the caching allocator rounds every block
      up to 512 bytes; cuBLAS/cuBLASLt workspaces (one per handle and stream, up to 32 MiB each
      on Hopper) and Adam's foreach temporaries during the step (param-sized, but the step comes
      after backward has freed the activations). Hence the upper bound: 115 % of the ledger,
      plus those logits, plus 128 MiB.
    """
    spec = ModelSpec.bert_like(**BERT, seq_len=SEQ)
    batch = 8 * n
    gc.collect()
    torch.cuda.empty_cache()
    in_this_process = strategy != "ddp"  # DDP measures in its own rank processes
    baseline = [torch.cuda.memory_allocated(d) if in_this_process else 0 for d in range(n)]
    peaks = cuda_peak_bytes(strategy, {**BERT, "max_len": SEQ}, batch_size=batch, num_devices=n,
                            output_device=output_device)
    predicted = ledger(spec, strategy, batch_size=batch, num_devices=n, output_device=output_device)
    assert len(peaks) == n
    measured = [peak - base for peak, base in zip(peaks, baseline, strict=True)]
    for d in range(n):
        modelled = predicted.total(d)
        rows = batch if strategy == "dp" and d == output_device else predicted.rows_per_device[d]
        low, high = 0.75 * modelled, 1.15 * modelled + rows * spec.outputs * 4 + 128 * MiB
        assert low <= measured[d] <= high, (
            f"cuda:{d}: measured {measured[d] / MiB:.1f} MiB, ledger {modelled / MiB:.1f} MiB, "
            f"allowed {low / MiB:.1f} to {high / MiB:.1f} MiB")
    if strategy == "dp" and n == 2:  # the lesson of notebook 04: the output device fills up
        assert measured[output_device] > measured[1 - output_device]


# ----------------------------------------------------------------------- fp16 autocast on CUDA


@pytest.mark.parametrize("n", [pytest.param(1, marks=needs_gpus(1), id="1gpu")])
def test_fp16_autocast_with_grad_scaler(n):
    """fp16 outputs, an fp32 loss, a scaler that keeps tiny gradients and a finite scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).cuda()
    x, t = torch.randn(32, 8, device="cuda"), torch.randint(0, 4, (32,), device="cuda")
    rows = output_dtypes(model, x, "fp16", "cuda", loss_fn=nn.functional.cross_entropy, target=t)
    assert [r[2] for r in rows] == [torch.float16] * 3 + [torch.float32]
    scaler = grad_scaler("fp16", "cuda")
    assert scaler.is_enabled() and not grad_scaler("bf16", "cuda").is_enabled()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        with autocast("fp16", "cuda"):
            out = model(x)
            loss = nn.functional.cross_entropy(out, t)
        assert out.dtype == torch.float16 and loss.dtype == torch.float32
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    assert math.isfinite(scaler.get_scale()) and scaler.get_scale() > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]
    # a loss scaled by 1e-8: its fp16 gradients underflow to zero unless the scaler scales them
    tiny = []
    for scale in (False, True):
        model.zero_grad()
        scaler = torch.amp.GradScaler("cuda", enabled=scale)
        with autocast("fp16", "cuda"):
            small = (model(x).float() * 1e-8).sum()
        scaler.scale(small).backward()
        if scale:
            scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
        tiny.append(model[0].weight.grad.clone())
    assert torch.count_nonzero(tiny[0]) == 0 and torch.count_nonzero(tiny[1]) > 0


# ----------------------------------------------------------------------- NCCL with one rank


def assert_matches(got, expected, tolerance, where="result"):
    """``got == expected`` through dicts and lists; numbers and tensors within ``tolerance``."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), f"{where}: {got!r} != {expected!r}"
        for key in expected:
            assert_matches(got[key], expected[key], tolerance, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), \
            f"{where}: {got!r} != {expected!r}"
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_matches(a, b, tolerance, f"{where}[{i}]")
    elif isinstance(expected, (torch.Tensor, float)):
        torch.testing.assert_close(got, expected, **tolerance, msg=lambda m: f"{where}: {m}")
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def on_gloo(fn, *args):
    """The same demo on the CPU: one gloo rank."""
    return lambda: launch(fn, 1, *args, backend="gloo", echo=False)[0]


#: name: (demo, its arguments ("PATH" is a fresh file), what it must return, the tolerance)
DEMOS = {
    "hello": (demos.hello, (), lambda: {"rank": 0, "world_size": 1, "backend": "nccl",
                                            "device": "cuda:0"}, FP32),
    "all_reduce_sum": (demos.all_reduce_sum, (), lambda: [1.0], FP32),
    "ddp_buckets": (demos.ddp_buckets, (0.25,), on_gloo(demos.ddp_buckets, 0.25), FP32),
    "save_on_rank_0": (demos.save_on_rank_0, ("PATH",), lambda: {
        "wrapped_keys": ["module.weight", "module.bias"], "saved_keys": ["weight", "bias"],
        "matches_my_copy": True}, FP32),
    # its losses are rounded to 4 decimals: a difference of 1e-7 can move the last one
    "unused_parameters": (demos.unused_parameters, (True,),
                          on_gloo(demos.unused_parameters, True), {"rtol": 0, "atol": 2e-4}),
    "batchnorm_under_ddp": (demos.batchnorm_under_ddp, (False,),
                            lambda: demos.batchnorm_reference(1), FP32),
    "sync_batchnorm_under_ddp": (demos.batchnorm_under_ddp, (True,),
                                 lambda: demos.batchnorm_reference(1), FP32),
    "check_ring_all_reduce": (check_ring_all_reduce, ([1, 1000],), lambda: [
        {"size": size, "max_diff": 0.0, "bytes_sent": 0, "formula": 0.0} for size in (1, 1000)], FP32),
}


@pytest.mark.parametrize("name", [pytest.param(d, marks=needs_gpus(1)) for d in DEMOS])
def test_ddp_demos_under_nccl(name, tmp_path):
    """One GPU hosts one NCCL rank: every demo of ddp.demos that makes sense on one rank runs
    there and returns what it returns on the CPU."""
    assert choose_backend(1) == "nccl"
    fn, args, expected, tolerance = DEMOS[name]
    args = tuple(str(tmp_path / "checkpoint.pt") if a == "PATH" else a for a in args)
    [got] = launch(fn, 1, *args, backend="nccl", echo=False, timeout_s=180)
    assert_matches(to_cpu(got), to_cpu(expected()), tolerance)


@pytest.mark.parametrize("n", [pytest.param(1, marks=needs_gpus(1), id="1gpu")])
def test_train_ddp_under_nccl_equals_the_cpu_reference(n):
    """DDP on a GPU with NCCL ends where the one-process CPU training does, within FP32."""
    config = TrainConfig(epochs=3, momentum=0.9)
    [result] = launch(train_ddp, n, config, backend="nccl", echo=False, timeout_s=300)
    reference = train_reference(config, n)
    assert result["steps"] == len(reference["losses"]) == 12
    torch.testing.assert_close(result["losses"], reference["losses"], **FP32)
    for name, value in reference["params"].items():
        torch.testing.assert_close(result["params"][name], value, **FP32, msg=lambda m, k=name: f"{k}: {m}")


@pytest.mark.parametrize("n", [pytest.param(1, marks=needs_gpus(1), id="1gpu")])
def test_torchrun_restart_under_nccl_resumes_bitwise(n, tmp_path):
    """torchrun with NCCL: rank 0 dies at step 3, the agent restarts it, training resumes from
    the snapshot of step 2 and ends with the uninterrupted run's parameters, bitwise (same GPU,
    same kernels, same order), as tests/test_restarts.py asserts on the CPU."""
    job_args = ("--epochs", "3", "--momentum", "0.9")  # 12 steps of one rank x 24 rows
    env = {"LOGLEVEL": "INFO", "NCCL_DEBUG": "VERSION"}  # the agent's decisions; NCCL's version
    plain = torchrun("course_utils.ddp.train", n, "--out", tmp_path / "plain.pt", *job_args,
                     timeout_s=300, env=env)
    assert plain.returncode == 0, "\n".join(plain.lines + plain.log_lines[-30:])
    snapshot, out = tmp_path / "snapshot.pt", tmp_path / "params.pt"
    job = torchrun("course_utils.ddp.train", n, "--out", out, "--snapshot", snapshot,
                   "--snapshot-every", "2", "--kill-rank", "0", "--kill-at-step", "3", *job_args,
                   timeout_s=300, env=env,
                   launcher_args=("--standalone", "--max-restarts=1", "--monitor-interval=0.2"))
    report = "\n".join(job.lines + job.log_lines[-30:])
    assert job.returncode == 0, report
    assert job.restarts == 1, report
    assert "rank 0: SIGKILL to myself after step 3" in job.lines, report
    for start in ("attempt 1: resumed from the snapshot of step 2", "rank 0 of 1: finished at step 12"):
        assert any(line.startswith(start) for line in job.lines), report
    assert any("NCCL version" in line for line in job.lines + job.log_lines), f"no NCCL?\n{report}"
    expected, got = torch.load(tmp_path / "plain.pt"), torch.load(out)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    for key, value in train_reference(TrainConfig(epochs=3, momentum=0.9), n)["params"].items():
        torch.testing.assert_close(got[key], value, **FP32)
    left = []  # nothing of the job may outlive it
    for process in psutil.process_iter(["cmdline"]):
        try:
            left += [process] if any(str(tmp_path) in part for part in process.info["cmdline"] or []) else []
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    assert left == []


# ------------------------------------------------------------- a check and the GPU generators

GPU_DRAWS = """
import sys, torch
from course_utils import env
seeded, check = sys.argv[1] == "seeded", sys.argv[2]
if seeded:
    torch.manual_seed(0)  # the learner's seed, queued until CUDA starts
if check != "none":
    with env.random_state_kept():  # what a check does around its judge
        torch.manual_seed(1)
        if check == "starts CUDA":
            torch.randn(2, device="cuda")
print(torch.randn(4, device="cuda").tolist())
"""


@pytest.mark.parametrize("n", [pytest.param(1, marks=needs_gpus(1), id="1gpu")])
def test_a_check_leaves_the_gpu_generators_as_the_learner_left_them(n):
    """Seeded or not, a check before CUDA starts, or one that starts it, changes none of the
    learner's next draws on the GPU (each case in a fresh process: CUDA starts once a process)."""
    def draws(seeded, check):
        done = subprocess.run([sys.executable, "-c", GPU_DRAWS, seeded, check], capture_output=True,
                              text=True, timeout=300, check=True)
        return done.stdout.strip()

    for seeded in ("seeded", "unseeded"):
        alone = draws(seeded, "none")
        assert [draws(seeded, check) for check in ("before CUDA", "starts CUDA")] == [alone, alone], seeded
