"""Holding a global batch on fewer ranks (notebook 07, section 5): gradient accumulation with
``no_sync``, and learning-rate schedules that keep their meaning when the world size changes.

:func:`accumulate_step` is one optimizer step in ``k`` micro-batches on :class:`.by_hand.DDPByHand`:
the first ``k - 1`` backward passes under ``no_sync()`` (the gradients add up on each rank), the
last one synchronised. :func:`accumulation_rank` trains with it and counts, from the process
group's own record (the Flight Recorder), the all-reduces each optimizer step ran.

A schedule counted in optimizer steps means something else when N changes the steps in an epoch;
:func:`lr_by_epoch` shows a step-counted decay beside one counted in samples seen.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .._checks import check_positive_int
from ..compat import dump_flight_recorder
from ..devices import rank_device
from . import batch_task
from .batch_size import MOMENTUM
from .by_hand import DDPByHand

__all__ = ["accumulate_step", "accumulation_rank", "accumulation_runs", "all_reduce_records", "lr_by_epoch",
           "steps_per_epoch"]


def all_reduce_records() -> list[int]:
    """The record ids of the all-reduces this process's group has run, as its Flight Recorder
    holds them (the last 2000 collectives): what reached the backend, whoever called it."""
    dump = dump_flight_recorder(stacks=False)
    if dump is None:
        raise RuntimeError("this torch cannot dump its Flight Recorder: the all-reduces cannot be counted")
    return [e["record_id"] for e in dump.get("entries", []) if e["profiling_name"].endswith(":all_reduce")]


def _all_reduces_after(last: int) -> tuple[int, int]:
    """How many all-reduces ran after record ``last``, and the newest record id."""
    ids = all_reduce_records()
    return sum(1 for i in ids if i > last), max(ids, default=last)


def accumulate_step(ddp_model: DDPByHand, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor, k: int) -> None:
    """One optimizer step on this rank's rows ``x``, ``y``, in ``k`` micro-batches: the gradients
    of the first ``k - 1`` add up locally, the last backward all-reduces their sum."""
    # region: accumulate
    micro_batches = list(zip(x.tensor_split(k), y.tensor_split(k), strict=True))
    for i, (xm, ym) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else contextlib.nullcontext():
            loss = F.binary_cross_entropy_with_logits(ddp_model(xm).squeeze(-1), ym)
            (loss / k).backward()  # the mean over the rank's rows: each micro-batch's share
    optimizer.step()  # the last backward has averaged the gradients (DDPByHand finishes, as DDP)
    optimizer.zero_grad()
    # endregion


def _synced_every_micro_batch(ddp_model: DDPByHand, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                              y: torch.Tensor, k: int) -> None:
    """Accumulation without ``no_sync``: every backward all-reduces (and waits for it as it ends)."""
    for xm, ym in zip(x.tensor_split(k), y.tensor_split(k), strict=True):
        (F.binary_cross_entropy_with_logits(ddp_model(xm).squeeze(-1), ym) / k).backward()
    optimizer.step()
    optimizer.zero_grad()


#: the ways to take one optimizer step in k micro-batches, by name
STEPS: dict[str, Callable[..., None]] = {"no_sync": accumulate_step,
                                         "sync every micro-batch": _synced_every_micro_batch}


def accumulation_rank(rank: int, world_size: int, k: int, rows_per_rank: int, steps: int, lr: float,
                      how: str = "no_sync") -> dict:
    """Train :func:`.batch_task.model` with :class:`.by_hand.DDPByHand` for ``steps`` optimizer
    steps on global batches of ``world_size * rows_per_rank`` rows, each rank on its slice in ``k``
    micro-batches (``how``: ``"no_sync"``, or ``"sync every micro-batch"``). Returns the weights,
    the all-reduces of each optimizer step, and the rows each rank put through the model per step."""
    device = rank_device()
    model = batch_task.model().to(device)
    ddp_model = DDPByHand(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=MOMENTUM)
    rows = _counting_rows(ddp_model)
    generator = torch.Generator().manual_seed(0)
    all_reduces, rows_per_step = [], []
    last = max(all_reduce_records(), default=-1)
    for _ in range(steps):
        x, y = batch_task.batch(generator, world_size * rows_per_rank)
        x, y = x.tensor_split(world_size)[rank].to(device), y.tensor_split(world_size)[rank].to(device)
        rows[0] = 0
        STEPS[how](ddp_model, optimizer, x, y, k)
        count, last = _all_reduces_after(last)
        all_reduces.append(count)
        rows_per_step.append(rows[0])
    weights = model.weight.detach().cpu()[0].clone()
    ddp_model = optimizer = None
    gc.collect()
    return {"weights": weights, "all_reduces": all_reduces, "rows": rows_per_step}


def accumulation_runs(rank: int, world_size: int, runs: list[tuple[int, int, str]], steps: int,
                      lr: float) -> list[dict]:
    """:func:`accumulation_rank` for each ``(k, rows_per_rank, how)`` of ``runs`` in turn, in this
    one process group: what notebook 07 compares, from one launch per world size."""
    import torch.distributed as dist

    out = []
    for k, rows_per_rank, how in runs:
        out.append(accumulation_rank(rank, world_size, k, rows_per_rank, steps, lr, how))
        dist.barrier()
    return out


def _counting_rows(ddp_model: nn.Module) -> list[int]:
    """A one-item list that counts the rows the model's forward sees (a forward pre-hook)."""
    seen = [0]
    ddp_model.module.register_forward_pre_hook(lambda _, args: seen.__setitem__(0, seen[0] + len(args[0])))
    return seen


def steps_per_epoch(dataset_size: int, per_rank_batch: int, world_size: int) -> int:
    """Optimizer steps in one epoch on each rank: ``DistributedSampler`` gives each rank
    ``ceil(dataset_size / world_size)`` indices, which a ``DataLoader`` batches."""
    dataset_size, per_rank_batch, world_size = (check_positive_int(n, v) for n, v in (
        ("dataset_size", dataset_size), ("per_rank_batch", per_rank_batch), ("world_size", world_size)))
    data = TensorDataset(torch.arange(dataset_size))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=0, shuffle=True, seed=0)
    return len(DataLoader(data, batch_size=per_rank_batch, sampler=sampler))


def lr_by_epoch(base_lr: float, decay_at: int, counted_in: str, dataset_size: int, per_rank_batch: int,
                world_size: int, epochs: int) -> list[float]:
    """The learning rate in force at the start of each epoch when a schedule multiplies it by 0.1
    at ``decay_at``, counted in ``"steps"`` (optimizer steps) or ``"samples"`` (rows seen by all
    the ranks together), run as a training loop would: ``DistributedSampler.set_epoch(epoch)`` at
    each epoch, one scheduler step per optimizer step (rank 0's view: every rank takes as many)."""
    if counted_in not in ("steps", "samples"):
        raise ValueError(f"counted_in must be 'steps' or 'samples', got {counted_in!r}")
    data = TensorDataset(torch.arange(check_positive_int("dataset_size", dataset_size)))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=per_rank_batch, sampler=sampler)
    param = nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([param], lr=base_lr)
    global_batch = per_rank_batch * world_size
    if counted_in == "steps":
        rule = lambda step: 0.1 if step >= decay_at else 1.0  # noqa: E731
    else:
        rule = lambda step: 0.1 if step * global_batch >= decay_at else 1.0  # noqa: E731
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rule)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        out.append(optimizer.param_groups[0]["lr"])
        for _ in loader:
            optimizer.step()
            schedule.step()
    return [round(lr, 12) for lr in out]
