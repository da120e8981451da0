"""Notebook 05's collectives by hand: SyncBatchNormByHand against BatchNorm on the global batch
(running variance, momentum and affine options), and the ring all-reduce on non-contiguous and
non-fp32 tensors."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_utils.ddp.collectives import SyncBatchNormByHand, ring_all_reduce
from course_utils.distributed import launch

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
