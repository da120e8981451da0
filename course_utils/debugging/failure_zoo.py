"""A zoo of real distributed-training failures, each a small rank function (notebook 12).

Every function here runs under ``distributed.launch(fn, world_size, ..., timeout_s=small)``: the
broken ones hang or raise on purpose (:func:`course_utils.debugging.hangs.run_broken` runs them and says
where each rank got stuck), and the fixed versions sit next to them: ``set_epoch``, evaluation on
one rank, padded accuracy, collectives out of order, saving before loading, a port still taken.
Training-loop failures (accumulation, uneven inputs, unused parameters, seeds, checkpoints) are in
:mod:`course_utils.debugging.training_bugs`.
"""

from __future__ import annotations

import re
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from ..devices import rank_device
from ..models import seeded

__all__ = [
    "collectives_in_order",
    "collectives_out_of_order",
    "eval_on_rank_0_only",
    "evaluate_everywhere",
    "evaluation_set",
    "exact_accuracy",
    "out_of_order_as_on_nccl",
    "padded_accuracy",
    "rendezvous_at",
    "sampler_orders",
    "save_then_load",
]


# ----------------------------------------------------------------------------- set_epoch

def sampler_orders(rank: int, world_size: int, size: int, epochs: int, set_epoch: bool) -> list[list[int]]:
    """The indices this rank reads in each epoch from a shuffling ``DistributedSampler``."""
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # the fix: a new shuffle every epoch
        orders.append(list(sampler))
    return orders


# ----------------------------------------------------------------------------- evaluation

def evaluation_set(size: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed validation set of ``size`` rows and labels, with a fixed model's predictions
    right on the first rows and on every third row after them (so padding shows)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    torch.manual_seed(0)
    x = torch.randn(size, 4)
    model = _classifier()
    with torch.no_grad():  # the model's own predictions, computed without calling it on the CPU
        labels = (x @ model.weight.T + model.bias).argmax(1)
    wrong = [i for i in range(size) if i >= 3 and i % 3 != 0]
    labels[wrong] = 1 - labels[wrong]
    return x, labels


def _classifier() -> nn.Module:
    return seeded(1, lambda: nn.Linear(4, 2))


def _correct_on(indices: list[int], size: int, device: torch.device) -> torch.Tensor:
    x, y = evaluation_set(size)
    model = _classifier().to(device)
    with torch.no_grad():
        return (model(x[indices].to(device)).argmax(1) == y[indices].to(device)).float()


def eval_on_rank_0_only(rank: int, world_size: int, size: int = 10) -> float | None:
    """The hang: only rank 0 evaluates, and evaluation all-reduces its counts."""
    if rank == 0:
        return evaluate_everywhere(rank, world_size, size)  # rank 0 waits here for the others
    return None  # the other ranks went on (to the next epoch, a barrier, the end)


def evaluate_everywhere(rank: int, world_size: int, size: int = 10) -> float:
    """The right pattern: every rank evaluates its shard, and the counts are all-reduced."""
    device = rank_device()
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=False)
    correct = _correct_on(list(sampler), size, device)
    counts = torch.tensor([correct.sum().item(), float(len(correct))], device=device)
    dist.all_reduce(counts)  # every rank must get here
    return (counts[0] / counts[1]).item()


def padded_accuracy(rank: int, world_size: int, size: int) -> dict[str, Any]:
    """Accuracy over a padded ``DistributedSampler``: the first rows count twice."""
    accuracy = evaluate_everywhere(rank, world_size, size)
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=False)
    return {"indices": list(sampler), "accuracy": accuracy}


def exact_accuracy(rank: int, world_size: int, size: int) -> dict[str, Any]:
    """Exact distributed accuracy: all-gather (index, correct) pairs, drop the padded duplicates."""
    device = rank_device()
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=False)
    indices = list(sampler)
    correct = _correct_on(indices, size, device)
    mine = torch.stack([torch.tensor(indices, dtype=torch.float, device=device), correct], 1)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]  # same length on every rank
    dist.all_gather(gathered, mine)
    seen: dict[int, float] = {}
    for index, ok in torch.cat(gathered).tolist():
        seen.setdefault(int(index), ok)  # a padded duplicate repeats an index already seen
    return {"counted": len(seen), "accuracy": sum(seen.values()) / len(seen)}


# ----------------------------------------------------------------------------- collective order

def collectives_out_of_order(rank: int, world_size: int, detail: bool = False) -> str:
    """The hang: rank 0 all-reduces then broadcasts; the others broadcast then all-reduce.

    With ``detail`` the collectives run on a group made under debug level DETAIL (what
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for every group): the ranks compare each collective's
    fingerprint first and raise on a mismatch instead of waiting forever.
    """
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    group = dist.new_group(list(range(world_size)))
    device = rank_device()
    grads, flag = torch.ones(4, device=device), torch.zeros(1, device=device)
    try:
        dist.all_reduce(torch.zeros(1, device=device), group=group)  # a step the ranks agree on
        if rank == 0:
            dist.all_reduce(grads, group=group)
            dist.broadcast(flag, 0, group=group)
        else:
            dist.broadcast(flag, 0, group=group)
            dist.all_reduce(grads, group=group)
    except RuntimeError as err:
        ops = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                         r"SequenceNumber=\d+, OpType=(\w+)", str(err))
        return "; ".join(f"rank {r} runs {op}" for r, op in sorted(set(ops)))
    return "no error"


def out_of_order_as_on_nccl(rank: int, world_size: int) -> str:
    """The same bug as NCCL runs it, imitated on gloo: each collective only *starts* (NCCL queues
    it on the GPU and returns), the program goes on, and it waits where it needs a result on the
    CPU, as ``loss.item()`` or ``tensor.cpu()`` wait for the GPU. The hang surfaces there."""
    device = rank_device()
    grads, flag = torch.ones(4, device=device), torch.zeros(1, device=device)
    if rank == 0:
        started = [dist.all_reduce(grads, async_op=True), dist.broadcast(flag, 0, async_op=True)]
    else:
        started = [dist.broadcast(flag, 0, async_op=True), dist.all_reduce(grads, async_op=True)]
    loss = (grads * 2).sum()  # the program goes on computing
    for work in started:
        work.wait()  # what loss.item() does under NCCL: wait for the GPU's queued work
    return f"loss {loss.item()}"


def collectives_in_order(rank: int, world_size: int) -> list[float]:
    """The fix: every rank makes the same collective calls in the same order."""
    device = rank_device()
    grads, flag = torch.ones(4, device=device), torch.full((1,), float(rank), device=device)
    dist.all_reduce(grads)
    dist.broadcast(flag, 0)
    return [grads[0].item(), flag.item()]


# ----------------------------------------------------------------------------- saving

def save_then_load(rank: int, world_size: int, path: str, barrier: bool) -> list[float]:
    """Rank 0 saves a checkpoint (slowly, as a big one is); every rank then loads it.

    Without ``barrier`` the other ranks read before rank 0 has written: ``FileNotFoundError``
    (or, worse, last run's file). ``map_location`` puts the tensors on this rank's device, not
    on the GPU they were saved from.
    """
    device = rank_device()
    torch.manual_seed(0)
    model = nn.Linear(2, 1).to(device)
    if rank == 0:
        time.sleep(0.5)  # writing a large checkpoint takes a while
        torch.save(model.state_dict(), path)
    if barrier:
        dist.barrier()  # nobody reads before rank 0 has written
    state = torch.load(path, map_location=device)
    return state["weight"].flatten().tolist()


# ----------------------------------------------------------------------------- ports

def rendezvous_at(rank: int, world_size: int, port: int) -> int:
    """Make a process group at ``tcp://127.0.0.1:PORT``, as the Korean article's scripts do
    (for ``launch(..., init="none")``). Rank 0 hosts the store there: a port still held by an
    interrupted cell's store makes it fail with ``EADDRINUSE``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    return rank
