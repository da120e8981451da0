"""The runs of notebook 06 (DDP by hand): the same training under each version of
:mod:`course_utils.ddp.by_hand` and under torch's DDP, launched with ``launch``.

``train_rank`` trains ``lesson_model`` for a few steps under one version and returns the
parameters, the timeline and the all-reduces that ran, counted from the process group's own
record (the Flight Recorder, not a count of calls); ``train_one_process`` is the same training in
one process on whole batches. The timelines and step times are in :mod:`.by_hand_timing`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..compat import dump_flight_recorder
from ..devices import rank_device, wrap_ddp
from ..faults.snapshots import state_copy
from ..models import seeded
from .by_hand import DDPByHand, Timeline, average_gradients, broadcast_from_rank_0

__all__ = ["VERSIONS", "lesson_batches", "lesson_model", "train_one_process", "train_rank", "train_versions"]

#: the four ways to keep the ranks' models equal: the three by hand, then torch's DDP
VERSIONS = ("after_backward", "per_parameter", "bucketed", "torch_ddp")
#: rows per step, over all ranks (divides into 1, 2, 3, 4 and 6 ranks), and the learning rate
GLOBAL_BATCH, LR = 12, 0.1


def lesson_model(tied: bool = False, frozen: bool = False, seed: int = 0) -> nn.Module:
    """A small MLP built under ``seed``: 8 inputs, three hidden layers of 16, 4 outputs.

    ``tied``: the third layer's weight *is* the second's (one parameter used twice);
    ``frozen``: the first layer's weight does not train (``requires_grad=False``).
    """
    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        if tied:
            model[4].weight = model[2].weight
        if frozen:
            model[0].weight.requires_grad_(False)
        return model

    return seeded(seed, build)


def lesson_batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of ``GLOBAL_BATCH`` rows (inputs, targets), the same everywhere."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
            for _ in range(steps)]


def _all_reduces() -> list[tuple[int, int]]:
    """(record id, elements) of each all-reduce this process's group has run, from its Flight
    Recorder: what reached the backend, whoever called it (DDP's C++ reducer included)."""
    dump = dump_flight_recorder(stacks=False)
    if dump is None:
        raise RuntimeError("this torch cannot dump its Flight Recorder: the all-reduces cannot be counted")
    return [(e["record_id"], sum(torch.Size(s).numel() for s in e["input_sizes"]))
            for e in dump.get("entries", []) if e["profiling_name"].endswith(":all_reduce")]


def _between(earlier: list[tuple[int, int]], later: list[tuple[int, int]]) -> list[int]:
    """The elements of each all-reduce in ``later`` that ``earlier`` had not seen."""
    last = max((r for r, _ in earlier), default=-1)
    return [n for r, n in later if r > last]


def train_rank(rank: int, world_size: int, version: str, bucket_cap_mb: float | None = None, *,
               steps: int = 3, tied: bool = False, frozen: bool = False,
               seeded_differently: bool = False, count: bool = False, record: bool = False,
               wrapper: Callable[..., nn.Module] | None = None) -> dict:
    """Train ``lesson_model`` for ``steps`` SGD steps (momentum 0.9) under ``version`` (one of
    ``VERSIONS``; ``bucketed`` uses ``bucket_cap_mb``), each rank on its slice of every batch.

    Returns ``params`` (the state dict, on the CPU), ``events`` (the rank's :class:`Timeline`
    events, with ``record``), ``buckets`` (the names in each bucket, for the versions by hand) and,
    with ``count``, per step the elements of each all-reduce that ran ``during`` the backward pass
    and ``after`` it, until the gradients were synchronised. ``seeded_differently``: rank r builds
    its model under seed r, and the version must make the ranks equal. ``wrapper``: a class built
    as ``wrapper(model, bucket_cap_mb)`` in place of :class:`DDPByHand` (a learner's answer), whose
    ``finish_gradient_synchronization()`` the loop calls after ``backward()``; it records no timeline.
    """
    device = rank_device()
    model = lesson_model(tied, frozen, seed=rank if seeded_differently else 0).to(device)
    timeline = Timeline(record=record)
    if version == "after_backward":
        broadcast_from_rank_0(model)
        ddp_model = model
    elif version == "torch_ddp":
        ddp_model = wrap_ddp(model, device)
    else:
        cap = bucket_cap_mb if version == "bucketed" else None
        ddp_model = DDPByHand(model, cap, timeline) if wrapper is None else wrapper(model, cap)
    names = {param: name for name, param in model.named_parameters()}
    buckets = [[names[p] for p in bucket] for bucket in getattr(ddp_model, "buckets", [])]
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR, momentum=0.9)
    counts = []
    for x, y in lesson_batches(steps):
        x, y = x.tensor_split(world_size)[rank].to(device), y.tensor_split(world_size)[rank].to(device)
        # region: step
        optimizer.zero_grad()
        loss = F.mse_loss(ddp_model(x), y)
        before = _all_reduces() if count else []
        timeline.mark("backward_start")
        loss.backward()  # DDPByHand has finished, as DDP has, and marked backward_end itself
        if not isinstance(ddp_model, DDPByHand):
            timeline.mark("backward_end")
        at_end = _all_reduces() if count else []
        if version == "after_backward":
            average_gradients(model, timeline)
        elif wrapper is not None:  # exercise 06.2's wrapper: the loop waits for its all-reduces
            ddp_model.finish_gradient_synchronization()
        if count:
            counts.append({"during": _between(before, at_end), "after": _between(at_end, _all_reduces())})
        optimizer.step()
        # endregion
    params = state_copy(model)
    ddp_model = optimizer = None  # gone before the process group (gloo's clean exit)
    gc.collect()
    return {"params": params, "events": timeline.events, "buckets": buckets, "counts": counts}


def train_versions(rank: int, world_size: int, runs: Sequence[tuple[str, float | None]],
                   options: dict[str, Any]) -> dict[tuple[str, float | None], dict]:
    """:func:`train_rank` for each ``(version, bucket_cap_mb)`` of ``runs`` in turn, in this one
    process group (``options``, a dict of its keyword arguments, go to every run): what notebook
    06 compares, from one launch."""
    results = {}
    for version, cap in runs:
        results[version, cap] = train_rank(rank, world_size, version, cap, **options)
        dist.barrier()
    return results


def train_one_process(steps: int = 3, tied: bool = False, frozen: bool = False) -> dict[str, torch.Tensor]:
    """The same training in one process, on whole batches: what every version must equal."""
    model = lesson_model(tied, frozen)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in lesson_batches(steps):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return state_copy(model)
