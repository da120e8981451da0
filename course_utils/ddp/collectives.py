"""Communication by hand: a ring all-reduce and a synchronised BatchNorm (notebook 05).

``ring_all_reduce`` sums a tensor across all ranks using only point-to-point ``send``/``recv``,
the way NCCL and gloo's ring algorithm do: a reduce-scatter (N-1 steps, after which each rank
holds the full sum of one chunk), then an all-gather (N-1 steps that pass the finished chunks
around). Each rank sends ``2 (N-1)/N`` times the tensor's size, however many ranks there are.

``SyncBatchNormByHand`` computes BatchNorm's statistics over every rank's batch with a
differentiable all-reduce. PyTorch's ``nn.SyncBatchNorm`` does the same but accepts only GPU
tensors; this one runs on the CPU with gloo, so the lesson runs anywhere.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_int, check_positive_int
from ..devices import rank_device

__all__ = [
    "SyncBatchNormByHand",
    "check_ring_all_reduce",
    "chunk_bounds",
    "ring_all_reduce",
    "ring_bytes_per_rank",
]


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``world_size`` contiguous ``(start, stop)`` ranges covering ``numel`` elements.

    Sizes differ by at most one (the first ``numel % world_size`` chunks get the extra element);
    when ``numel < world_size`` some chunks are empty.
    """
    numel = check_int("numel", numel)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    world_size = check_positive_int("world_size", world_size)
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for i in range(world_size):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_bytes_per_rank(nbytes: int, world_size: int) -> float:
    """What one rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1)/N * nbytes``."""
    world_size = check_positive_int("world_size", world_size)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return 2 * (world_size - 1) / world_size * nbytes


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send ``send`` to the right neighbour while receiving ``recv`` from the left one.

    The send is posted first and the receive runs while it is in flight: if every rank did a
    blocking send first, a large message could leave all of them waiting for a receiver. Empty
    chunks are not sent; both ends know the sizes, so they skip the same messages.
    """
    request = dist.isend(send.contiguous(), right) if send.numel() else None
    if recv.numel():
        dist.recv(recv, left)
    if request is not None:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor) -> int:
    """Sum ``tensor`` over all ranks, in place, with a ring of sends and receives.

    Returns the number of bytes this rank sent. Works for any size and world size, including
    sizes that do not divide evenly and tensors smaller than the world.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("ring_all_reduce needs a process group: run it inside launch(...)")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size == 1:
        return 0
    flat = tensor.detach().reshape(-1).clone() if not tensor.is_contiguous() else tensor.detach().view(-1)
    bounds = chunk_bounds(flat.numel(), world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    sent = 0

    # one receive buffer, reused: a fresh allocation per step costs page faults on big tensors
    buffer = torch.empty(max(b - a for a, b in bounds), dtype=flat.dtype, device=flat.device)
    # region: ring
    # reduce-scatter: after step s, the chunk received has been summed over s + 2 ranks
    for step in range(world_size - 1):
        s0, s1 = bounds[(rank - step) % world_size]
        r0, r1 = bounds[(rank - step - 1) % world_size]
        incoming = buffer[: r1 - r0]
        _exchange(flat[s0:s1], incoming, right, left)
        flat[r0:r1] += incoming
        sent += (s1 - s0) * flat.element_size()
    # now rank r holds the complete sum of chunk (r + 1) % N; pass the finished chunks around,
    # receiving straight into place
    for step in range(world_size - 1):
        s0, s1 = bounds[(rank + 1 - step) % world_size]
        r0, r1 = bounds[(rank - step) % world_size]
        _exchange(flat[s0:s1], flat[r0:r1], right, left)
        sent += (s1 - s0) * flat.element_size()
    # endregion
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return sent


def check_ring_all_reduce(rank: int, world_size: int, sizes: list[int], seed: int = 0) -> list[dict]:
    """For each size, compare ``ring_all_reduce`` with ``dist.all_reduce`` on random data.

    Run it with ``launch``. Returns one record per size: the largest difference between the two
    results and the bytes this rank sent, next to ``2 (N-1)/N`` times the tensor's size.
    """
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"sizes must be a list of ints, got {sizes!r}")
    sizes = [check_positive_int("size", size) for size in sizes]
    if not sizes:
        raise ValueError("sizes is empty: give at least one tensor size to check")
    device = rank_device()
    records = []
    for size in sizes:
        g = torch.Generator().manual_seed(seed * 1000 + rank * 7919 + size)
        x = torch.randn(size, generator=g).to(device)  # the same numbers on every machine
        by_hand, builtin = x.clone(), x.clone()
        sent = ring_all_reduce(by_hand)
        dist.all_reduce(builtin)
        records.append({
            "size": size,
            "max_diff": (by_hand - builtin).abs().max().item() if size else 0.0,
            "bytes_sent": sent,
            "formula": ring_bytes_per_rank(x.nbytes, world_size),
        })
    return records


class _AllReduceSum(torch.autograd.Function):
    """all_reduce(SUM) whose backward is also an all_reduce(SUM) of the incoming gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class SyncBatchNormByHand(nn.BatchNorm1d):
    """BatchNorm over ``(batch, features)`` whose statistics span every rank's batch.

    In training it all-reduces the per-feature sum, sum of squares and count, so each rank
    normalises with the mean and variance of the *global* batch, and the gradients flow through
    the all-reduce. Outside a process group (or in eval mode) it is plain ``BatchNorm1d``.
    """

    def __init__(self, num_features: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(check_positive_int("num_features", num_features), *args, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Module's name
        if not (self.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size() > 1):
            return super().forward(input)
        if input.dim() != 2:
            raise ValueError(f"expected a (batch, features) input, got shape {tuple(input.shape)}")
        count = torch.tensor([float(input.shape[0])], dtype=input.dtype, device=input.device)
        stats = torch.cat([input.sum(0), input.square().sum(0), count])
        stats = _AllReduceSum.apply(stats)
        features = input.shape[1]
        total = stats[-1]
        mean = stats[:features] / total
        var = stats[features: 2 * features] / total - mean.square()
        with torch.no_grad():
            self.num_batches_tracked += 1
            m = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.item()
            unbiased = var * total / (total - 1)
            self.running_mean.mul_(1 - m).add_(m * mean)
            self.running_var.mul_(1 - m).add_(m * unbiased)
        out = (input - mean) / torch.sqrt(var + self.eps)
        return out * self.weight + self.bias if self.affine else out
