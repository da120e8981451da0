"""Cases the first tests left out: SyncBatchNormByHand's running variance and options, the ring on
non-contiguous and non-fp32 tensors, the parallel criterion with output_device and dim=1, and
launch stopping the processes its ranks start."""

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils.collectives import SyncBatchNormByHand, ring_all_reduce
from course_utils.distributed import LaunchTimeout, launch
from course_utils.parallel_criterion import DataParallelCriterion, DataParallelModel
from course_utils.simulated import sim_devices

pytestmark = pytest.mark.usefixtures("nothing_left_behind")


def _rows(world_size):
    """Uneven rows per rank (2, 3, 4...), so the statistics must be weighted by count."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rank + 2, 3, generator=g) * 2 + 1 for rank in range(world_size)]


def _sync_bn_rank(rank, world_size, momentum, affine, steps):
    norm = SyncBatchNormByHand(3, momentum=momentum, affine=affine)
    outputs = []
    for step in range(steps):
        x = _rows(world_size)[rank] + step
        out = norm(x)
        if affine:
            out.square().sum().backward()
        outputs.append(out.detach())
    grads = None
    if affine:
        grads = [p.grad.clone() for p in (norm.weight, norm.bias)]
        for g in grads:
            dist.all_reduce(g)  # the summed loss of every rank
    return {"outputs": outputs, "mean": norm.running_mean.clone(), "var": norm.running_var.clone(),
            "tracked": int(norm.num_batches_tracked), "grads": grads}


@pytest.mark.parametrize(("momentum", "affine"), [(0.1, True), (None, True), (0.3, False)])
def test_sync_batchnorm_by_hand_equals_batchnorm_on_the_global_batch(momentum, affine):
    world_size, steps = 3, 3
    results = launch(_sync_bn_rank, world_size, momentum, affine, steps, echo=False)
    reference = nn.BatchNorm1d(3, momentum=momentum, affine=affine)
    for step in range(steps):
        out = reference(torch.cat(_rows(world_size)) + step)
        if affine:
            out.square().sum().backward()
        torch.testing.assert_close(torch.cat([r["outputs"][step] for r in results]), out.detach())
    for r in results:  # every rank tracks the same statistics as one process on all the rows
        torch.testing.assert_close(r["mean"], reference.running_mean)
        torch.testing.assert_close(r["var"], reference.running_var)
        assert r["tracked"] == steps
        if affine:
            torch.testing.assert_close(r["grads"], [reference.weight.grad, reference.bias.grad])
        else:
            assert r["grads"] is None and reference.weight is None


def _ring_on_awkward_tensors(rank, world_size):
    results = []
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) * (rank + 1)
    cases = [base.t(),  # non-contiguous
             base[:, ::2],  # strided view
             (torch.arange(10) * (rank + 1)).to(torch.int64),
             (torch.arange(7) + rank).to(torch.float16),  # small integers: exact in fp16
             (torch.arange(5) + rank).to(torch.bfloat16)]
    for tensor in cases:
        expected = tensor.clone()
        dist.all_reduce(expected)
        before = tensor.data_ptr()
        ring_all_reduce(tensor)  # in place, on the tensor the caller holds
        results.append((tensor.dtype, tensor.is_contiguous(), tensor.data_ptr() == before,
                        torch.equal(tensor, expected)))
    return results


def test_ring_all_reduce_handles_non_contiguous_and_non_fp32_tensors_in_place():
    for per_rank in launch(_ring_on_awkward_tensors, 3, echo=False):
        dtypes = [dtype for dtype, *_ in per_rank]
        assert dtypes == [torch.float64, torch.float64, torch.int64, torch.float16, torch.bfloat16]
        assert [contiguous for _, contiguous, _, _ in per_rank][:2] == [False, False]
        assert all(same_storage and equal for *_, same_storage, equal in per_rank), per_rank


@pytest.mark.parametrize("output_device", [None, "sim:2"])
def test_parallel_criterion_with_dim_1_and_an_output_device_equals_one_device(output_device):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inputs, targets = torch.randn(6, 5, 4), torch.randn(6, 5, 2)  # (time, batch, features)
    reference = nn.functional.mse_loss(model(inputs), targets)
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    devices = sim_devices(3)  # a batch of 5 on 3 devices: chunks of 2, 2 and 1
    outputs = DataParallelModel(model, devices, dim=1)(inputs)
    assert [o.shape[1] for o in outputs] == [2, 2, 1]
    loss = DataParallelCriterion(nn.MSELoss(), devices, dim=1, output_device=output_device)(outputs, targets)
    loss.backward()
    torch.testing.assert_close(loss, reference)  # the uneven chunks' means, weighted by size
    torch.testing.assert_close([p.grad for p in model.parameters()], expected)


def _start_a_child_and(rank, world_size, pid_file, then):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).with_suffix(f".{rank}").write_text(str(child.pid))
    if then == "hang":
        time.sleep(600)
    return child.pid


def _dead(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("then", ["return", "hang"])
def test_launch_stops_the_processes_its_ranks_started(tmp_path, then):
    pid_file = tmp_path / "child"
    if then == "hang":
        with pytest.raises(LaunchTimeout):
            launch(_start_a_child_and, 2, str(pid_file), then, timeout_s=3, echo=False, stacks=False)
    else:
        launch(_start_a_child_and, 2, str(pid_file), then, echo=False)
    pids = [int(pid_file.with_suffix(f".{rank}").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 5
    while not all(_dead(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_dead(pid) for pid in pids), pids
