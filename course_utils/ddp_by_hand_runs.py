"""The runs of notebook 06 (DDP by hand): the same training under each version of
:mod:`course_utils.ddp_by_hand` and under torch's DDP, launched with ``launch``.

``train_rank`` trains ``lesson_model`` for a few steps under one version and returns the
parameters, the timeline and the all-reduces that ran, counted from the process group's own
record (the Flight Recorder, not a count of calls); ``train_one_process`` is the same training in
one process on whole batches. ``step_times_rank`` times a step of every version side by side on a
model where communication matters (``make bench``).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .compat import dump_flight_recorder
from .ddp_by_hand import DDPByHand, Event, Timeline, average_gradients, broadcast_from_rank_0
from .devices import rank_device, wrap_ddp
from .models import seeded
from .snapshots import state_copy

__all__ = ["VERSIONS", "comm_heavy_model", "draw_timelines", "lesson_batches", "lesson_model",
           "step_times_rank", "timeline_intervals", "timelines_rank", "train_one_process", "train_rank",
           "train_versions"]

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
    as ``wrapper(model, bucket_cap_mb)`` in place of :class:`DDPByHand` (a learner's answer), with
    the same ``finish_gradient_synchronization()``; it records no timeline.
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
        loss.backward()
        timeline.mark("backward_end")
        at_end = _all_reduces() if count else []
        if version == "after_backward":
            average_gradients(model, timeline)
        elif version != "torch_ddp":
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


def timeline_intervals(events: Sequence[Event], t0: float | None = None) -> dict[str, list[tuple]]:
    """A rank's events as the bars of a timeline, in seconds from ``t0`` (default: its first event).

    ``backward``: (start, end) of each backward pass; ``all_reduce``: (index, start, done) of each
    all-reduce, ``done`` being ``None`` if the backend's "done" was not recorded; ``wait``: (index,
    start, end) of each wait. Give every rank the same ``t0`` to draw them on one axis.
    """
    t0 = min(e.t for e in events) if t0 is None else t0
    bars: dict[str, list[tuple]] = {"backward": [], "all_reduce": [], "wait": []}
    open_: dict[tuple[str, int | None], float] = {}
    for e in events:
        kind, _, edge = e.what.rpartition("_")
        if edge == "start":
            if kind == "all_reduce":  # a new all-reduce of this index: the last one of it is over
                bars["all_reduce"].append((e.index, e.t - t0, None))
            else:
                open_[kind, e.index] = e.t
        elif kind == "all_reduce":  # done: the latest all-reduce of this index not yet done
            at = max(i for i, bar in enumerate(bars["all_reduce"]) if bar[0] == e.index and bar[2] is None)
            bars["all_reduce"][at] = (e.index, bars["all_reduce"][at][1], e.t - t0)
        else:
            start = open_.pop((kind, e.index)) - t0
            bars[kind].append((start, e.t - t0) if kind == "backward" else (e.index, start, e.t - t0))
    return bars


def draw_timelines(per_version: dict[str, list[Sequence[Event]]], title: str = "") -> Any:
    """Notebook 06's measured timeline: one panel per version, one lane per rank, each panel on the
    clock of its earliest event (the same scale in every panel). Grey bars: the backward passes;
    coloured bars: each all-reduce, from the moment it was started to the moment the backend
    finished it; black ticks: the training loop waiting for it. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(per_version), 1, figsize=(9, 1.2 + 1.1 * len(per_version)), sharex=True)
    axes = [axes] if len(per_version) == 1 else list(axes)
    colours = plt.get_cmap("tab10")
    for ax, (version, ranks) in zip(axes, per_version.items(), strict=True):
        t0 = min(e.t for events in ranks for e in events)
        for rank, events in enumerate(ranks):
            bars = timeline_intervals(events, t0)
            y = len(ranks) - 1 - rank
            ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for a, b in bars["backward"]], (y - 0.4, 0.35),
                           color="0.75", label="backward" if rank == 0 else None)
            for index, start, done in bars["all_reduce"]:
                end = start if done is None else done
                ax.broken_barh([(1e3 * start, max(1e3 * (end - start), 0.05))], (y + 0.02, 0.35),
                               color=colours(index % 10), alpha=0.85)
            for _, start, end in bars["wait"]:
                ax.plot([1e3 * start, 1e3 * end], [y - 0.02, y - 0.02], color="black", lw=2)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(range(len(ranks)))])
        ax.set_title(version.replace("_", " "), fontsize=10, loc="left")
    axes[-1].set_xlabel("ms since the step's first event (grey: backward; colours: one all-reduce each, "
                        "start to done; black: waiting)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def timelines_rank(rank: int, world_size: int, width: int, rows: int, bucket_cap_mb: float,
                   steps: int = 3) -> dict[str, list[Event]]:
    """The events of the last of ``steps`` training steps of ``comm_heavy_model(width)`` under each
    version by hand (``rows`` rows per rank; the bucketed one with ``bucket_cap_mb``), one version
    after the other, for notebook 06's timeline. The earlier steps warm up."""
    device = rank_device()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, width, generator=g).to(device)
    y = torch.randint(0, 10, (rows,), generator=g).to(device)
    result = {}
    for version in VERSIONS[:3]:
        model = comm_heavy_model(width).to(device)
        ddp_model = model if version == "after_backward" else \
            DDPByHand(model, bucket_cap_mb if version == "bucketed" else None)
        for step in range(steps):
            timeline = Timeline(record=step == steps - 1)
            ddp_model.timeline = timeline  # the wrapper marks its all-reduces on it
            model.zero_grad()
            dist.barrier()
            loss = F.cross_entropy(ddp_model(x), y)
            timeline.mark("backward_start")
            loss.backward()
            timeline.mark("backward_end")
            if version == "after_backward":
                average_gradients(model, timeline)
            else:
                ddp_model.finish_gradient_synchronization()
        result[version] = timeline.events
        ddp_model = model = None
    gc.collect()
    return result


def comm_heavy_model(width: int, layers: int = 4) -> nn.Module:
    """``layers`` square layers of ``width`` (4 MiB each at width 1024) and a head of 10 classes:
    many parameters and little computation on a small batch, so that sending the gradients is a
    large part of a step (how large depends on the machine and the network)."""
    def build() -> nn.Module:
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*blocks, nn.Linear(width, 10))

    return seeded(0, build)


def step_times_rank(rank: int, world_size: int, width: int, rows: int, bucket_cap_mb: float,
                    rounds: int) -> dict[str, Any]:
    """Median seconds of one training step under each of ``VERSIONS``, measured side by side:
    every round times one step of each version in turn, after a barrier, on ``comm_heavy_model``
    (``rows`` rows per rank). Both bucketed versions use ``bucket_cap_mb``; the first round warms up.
    Also returns how many buckets each bucketed version made."""
    device = rank_device()
    models = {v: comm_heavy_model(width).to(device) for v in VERSIONS}
    wrapped = {"after_backward": models["after_backward"],
               "per_parameter": DDPByHand(models["per_parameter"]),
               "bucketed": DDPByHand(models["bucketed"], bucket_cap_mb),
               "torch_ddp": wrap_ddp(models["torch_ddp"], device, bucket_cap_mb=bucket_cap_mb)}
    optimizers = {v: torch.optim.SGD(m.parameters(), lr=1e-3) for v, m in wrapped.items()}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, width, generator=g).to(device)
    y = torch.randint(0, 10, (rows,), generator=g).to(device)
    seconds: dict[str, list[float]] = {v: [] for v in VERSIONS}
    for i in range(rounds + 1):
        for version, ddp_model in wrapped.items():
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            optimizers[version].zero_grad()
            F.cross_entropy(ddp_model(x), y).backward()
            if version == "after_backward":
                average_gradients(ddp_model)
            elif version != "torch_ddp":
                ddp_model.finish_gradient_synchronization()
            optimizers[version].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                seconds[version].append(time.perf_counter() - start)
    ddp_buckets = wrapped["torch_ddp"]._get_ddp_logging_data().get("num_buckets_reduced")
    result = {"step_s": {v: statistics.median(s) for v, s in seconds.items()},
              "buckets": {"bucketed": len(wrapped["bucketed"].buckets), "torch_ddp": ddp_buckets}}
    wrapped = optimizers = models = None  # DDP gone before the process group (gloo's clean exit)
    gc.collect()
    return result
