"""When DDP by hand sends, and what a step costs (notebook 06, and ``make bench``).

``timelines_rank`` records, on each rank, when backward ran and when each all-reduce was started,
finished and waited for, under each version of :mod:`course_utils.ddp.by_hand`;
``timeline_intervals`` and ``draw_timelines`` turn those events into bars. ``step_times_rank``
times a step of every version and of torch's DDP side by side on ``comm_heavy_model``, a model
where communication matters.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..devices import rank_device, wrap_ddp
from ..models import seeded
from .by_hand import DDPByHand, Event, Timeline, average_gradients
from .by_hand_runs import VERSIONS

__all__ = ["comm_heavy_model", "draw_timelines", "overlap_counts", "step_times_rank", "timeline_intervals",
           "timelines_rank"]


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
                   steps: int = 3, recorded: int = 1) -> dict[str, list[list[Event]]]:
    """The events of the last ``recorded`` of ``steps`` training steps of ``comm_heavy_model(width)``
    under each version by hand (``rows`` rows per rank; the bucketed one with ``bucket_cap_mb``),
    one version after the other, for notebook 06's timeline: per version, one list of events per
    recorded step. The earlier steps warm up."""
    device = rank_device()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, width, generator=g).to(device)
    y = torch.randint(0, 10, (rows,), generator=g).to(device)
    result: dict[str, list[list[Event]]] = {}
    for version in VERSIONS[:3]:
        model = comm_heavy_model(width).to(device)
        ddp_model = model if version == "after_backward" else \
            DDPByHand(model, bucket_cap_mb if version == "bucketed" else None)
        result[version] = []
        for step in range(steps):
            timeline = Timeline(record=step >= steps - recorded)
            ddp_model.timeline = timeline  # the wrapper marks its all-reduces on it
            model.zero_grad()
            dist.barrier()
            loss = F.cross_entropy(ddp_model(x), y)
            timeline.mark("backward_start")
            loss.backward()  # DDPByHand marks backward_end itself, before it waits, as it ends
            if version == "after_backward":
                timeline.mark("backward_end")
                average_gradients(model, timeline)
            if timeline.record:
                result[version].append(timeline.events)
        ddp_model = model = None
    gc.collect()
    return result


def overlap_counts(events: Sequence[Event]) -> dict[str, int]:
    """What one step's events show of overlap: how many all-reduces were ``issued`` before backward
    ended (started during the backward pass), how many were ``done`` before it ended (sent while
    backward still computed: overlap shown, not assumed), of ``total``."""
    end = next(e.t for e in events if e.what == "backward_end")
    return {"issued": sum(e.what == "all_reduce_start" and e.t < end for e in events),
            "done": sum(e.what == "all_reduce_done" and e.t < end for e in events),
            "total": sum(e.what == "all_reduce_start" for e in events)}


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
    """Seconds of one training step under each of ``VERSIONS``, measured side by side: every round
    times one step of each version in turn, after a barrier, on ``comm_heavy_model`` (``rows`` rows
    per rank). Both bucketed versions use ``bucket_cap_mb``; the first round warms up. Returns
    ``step_s`` (the median per version), ``rounds_s`` (every round's seconds per version, for the
    spread) and how many buckets each bucketed version made."""
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
            optimizers[version].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                seconds[version].append(time.perf_counter() - start)
    ddp_buckets = wrapped["torch_ddp"]._get_ddp_logging_data().get("num_buckets_reduced")
    result = {"step_s": {v: statistics.median(s) for v, s in seconds.items()}, "rounds_s": seconds,
              "buckets": {"bucketed": len(wrapped["bucketed"].buckets), "torch_ddp": ddp_buckets}}
    wrapped = optimizers = models = None  # DDP gone before the process group (gloo's clean exit)
    gc.collect()
    return result
