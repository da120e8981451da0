"""Small functions that notebook 05 runs on several ranks with ``distributed.launch``.

They live here so that the notebook and the tests share them (``launch`` also runs a function
defined in a notebook cell: it sends it to the ranks by value).
Each takes ``(rank, world_size, ...)``, runs inside an initialised process group, and returns what
the notebook prints or asserts. Each computes on ``rank_device()``: the CPU under gloo,
``cuda:LOCAL_RANK`` under NCCL, so the same lessons run on GPUs (tensors and models are put there,
and what comes back is moved to the CPU).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..devices import rank_device
from ..distributed import rank_print
from .collectives import SyncBatchNormByHand

__all__ = [
    "TwoHeads",
    "all_reduce_sum",
    "batchnorm_reference",
    "batchnorm_under_ddp",
    "block_in_collective",
    "ddp_buckets",
    "hello",
    "mismatched_all_reduce",
    "raise_on_rank",
    "save_on_rank_0",
    "torch_sync_batchnorm_on_cpu",
    "unused_parameters",
]


def hello(rank: int, world_size: int) -> dict:
    """Say who we are: the rank, the world size, the group's backend and this rank's device."""
    print(f"hello from rank {rank} of {world_size}")
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "device": str(rank_device())}


def all_reduce_sum(rank: int, world_size: int) -> list[float]:
    """Every rank contributes ``rank + 1``; after ``all_reduce`` every rank holds the sum."""
    t = torch.tensor([float(rank + 1)], device=rank_device())
    print(f"before all_reduce: {t.item():.0f}")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    print(f"after  all_reduce: {t.item():.0f}")
    return t.tolist()


def raise_on_rank(rank: int, world_size: int, bad_rank: int, message: str) -> int:
    """``bad_rank`` raises ``ValueError(message)``; the others wait for it in a barrier forever."""
    if rank == bad_rank:
        raise ValueError(message)
    dist.barrier()
    return rank


def block_in_collective(rank: int, world_size: int, sleeping_rank: int) -> int:
    """``sleeping_rank`` never joins the all_reduce its peers wait in: a hang, on purpose."""
    if rank == sleeping_rank:
        time.sleep(3600)
    t = torch.ones(1, device=rank_device())
    dist.all_reduce(t)
    t.item()  # NCCL's all_reduce returns at once; reading the result waits for it
    return rank


class TwoHeads(nn.Module):
    """A model with a head that ``forward`` never uses: DDP waits for its gradient forever."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.used_head = nn.Linear(4, 1)
        self.unused_head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used_head(torch.relu(self.body(x)))


def unused_parameters(rank: int, world_size: int, find_unused: bool, steps: int = 3) -> list[float]:
    """Train ``TwoHeads`` under DDP for a few steps, with or without ``find_unused_parameters``."""
    device = rank_device()
    torch.manual_seed(0)
    ddp_model = DDP(TwoHeads().to(device), find_unused_parameters=find_unused)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)  # CPU generator: the same numbers on every machine
    losses = []
    for step in range(steps):
        loss = ddp_model(torch.randn(8, 4, generator=g).to(device)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(round(loss.item(), 4))
        rank_print(f"step {step}: loss {loss.item():.4f}", only_rank=0)
    del ddp_model, optimizer
    gc.collect()
    return losses


def _bn_batch(world_size: int, rows_per_rank: int = 4, features: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(world_size * rows_per_rank, features, generator=g) * 2 + 1


def _bn_model(norm: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), norm, nn.Linear(3, 1))


def batchnorm_under_ddp(rank: int, world_size: int, sync: bool) -> dict:
    """One training step of ``Linear -> BatchNorm -> Linear`` on this rank's rows of a batch.

    ``sync=False`` uses ``nn.BatchNorm1d`` (statistics of this rank's rows only);
    ``sync=True`` uses ``SyncBatchNormByHand`` (statistics of the whole global batch).
    Returns this rank's outputs, the averaged gradient of the first layer, and the running mean.
    """
    device = rank_device()
    x = _bn_batch(world_size)
    rows = x.shape[0] // world_size
    local = x[rank * rows:(rank + 1) * rows].to(device)
    norm = SyncBatchNormByHand(3) if sync else nn.BatchNorm1d(3)
    model = _bn_model(norm).to(device)
    ddp_model = DDP(model)
    out = ddp_model(local)
    out.square().mean().backward()
    result = {"output": out.detach().cpu(), "grad": model[0].weight.grad.cpu(),
              "running_mean": model[1].running_mean.cpu()}
    del ddp_model, model
    gc.collect()
    return result


def batchnorm_reference(world_size: int) -> dict:
    """The same step in one process on the whole global batch, with plain BatchNorm."""
    x = _bn_batch(world_size)
    model = _bn_model(nn.BatchNorm1d(3))
    out = model(x)
    out.square().mean().backward()
    return {"output": out.detach(), "grad": model[0].weight.grad.clone(),
            "running_mean": model[1].running_mean.clone()}


def torch_sync_batchnorm_on_cpu(rank: int, world_size: int) -> str:
    """What ``nn.SyncBatchNorm`` says when it meets a CPU tensor inside a process group.

    The CPU tensor is the point of this lesson: launch it with ``backend="gloo"`` (its rank
    device is then the CPU; under NCCL the same layer runs on the GPU without an error).
    """
    device = rank_device()
    layer = nn.SyncBatchNorm(3).to(device)
    try:
        layer(torch.randn(4, 3, device=device))
    except ValueError as err:
        return f"ValueError: {err}"
    return f"no error on {device}"


def save_on_rank_0(rank: int, world_size: int, path: str) -> dict:
    """Train one step; rank 0 alone prints and saves; then every rank loads the file and checks.

    Saves ``ddp_model.module.state_dict()`` (no ``module.`` prefix), the form a plain model loads.
    """
    device = rank_device()
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    ddp_model = DDP(model)
    g = torch.Generator().manual_seed(rank)
    ddp_model(torch.randn(6, 4, generator=g).to(device)).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    wrapped_keys = list(ddp_model.state_dict())
    if rank == 0:
        torch.save(ddp_model.module.state_dict(), path)
    rank_print("checkpoint written by rank 0 only", only_rank=0)
    dist.barrier()  # nobody reads before rank 0 has finished writing
    loaded = torch.load(path, map_location=device)  # else every rank would load onto rank 0's GPU
    same = all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    del ddp_model, model
    gc.collect()
    return {"wrapped_keys": wrapped_keys, "saved_keys": list(loaded), "matches_my_copy": same}


def ddp_buckets(rank: int, world_size: int, bucket_cap_mb: float, iterations: int = 2) -> list[list[dict]]:
    """Which gradients DDP all-reduces together, and in what order, in each backward pass.

    A communication hook sees every bucket as DDP hands it over during backward; it records the
    bucket's parameters and size, then all-reduces it as DDP would (sum, then divide). Returns
    one list of buckets per iteration: DDP puts everything in one bucket for the first
    iteration, then rebuilds the buckets in the order the gradients became ready.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    device = rank_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10)).to(device)
    names = {p: n for n, p in model.named_parameters()}
    ddp_model = DDP(model, bucket_cap_mb=bucket_cap_mb)
    seen: list[list[dict]] = []

    def recording_hook(state, bucket):
        seen[-1].append({"index": bucket.index(), "params": [names[p] for p in bucket.parameters()],
                         "numel": bucket.buffer().numel()})
        return allreduce_hook(state, bucket)

    ddp_model.register_comm_hook(None, recording_hook)
    for _ in range(iterations):
        seen.append([])
        ddp_model(torch.randn(8, 64, device=device)).sum().backward()
    del ddp_model, model
    gc.collect()
    return seen


def mismatched_all_reduce(rank: int, world_size: int, detail: bool) -> str:
    """A classic hang: every rank all-reduces, but with a different shape (2 + rank values).

    With ``detail`` the collectives run on a group created under debug level DETAIL (what
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for every group): before each collective the ranks
    compare fingerprints (operation, shapes, dtypes) and raise at once on a mismatch.
    """
    import re

    import torch.distributed as dist

    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    group = dist.new_group(list(range(world_size)))
    tensor = torch.ones(2 + rank, device=rank_device())
    try:
        dist.all_reduce(tensor, group=group)
    except RuntimeError as err:
        message = str(err)
        shapes = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                            r"SequenceNumber=\d+, OpType=(\w+), TensorShape=(\[[\d, ]*\])", message)
        described = "; ".join(f"rank {r}: {op} of shape {shape}" for r, op, shape in shapes)
        return f"RuntimeError: {message.split('.')[0]}. ({described})"
    return f"rank {rank}: no error, got {tensor.tolist()}"
