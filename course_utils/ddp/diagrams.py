"""Pictures of DDP's mechanisms, drawn from the same rules the course's code runs (notebook 05).

Each picture comes in two parts: a function that computes what happens (a plain data structure
that the tests check against the course's own code) and one that draws it with matplotlib.

- ``ddp_timeline`` / ``draw_ddp_overlap``: DDP's gradient buckets all-reduced while backward still
  runs, against all-reducing after backward;
- ``ring_schedule`` / ``draw_ring``: which chunk every rank sends at each step of the ring
  all-reduce's two phases, and how many ranks' values each chunk holds afterwards.

The picture of a DataParallel step is in :mod:`course_utils.dataparallel.diagrams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._checks import check_positive_int

__all__ = ["RingStep", "ddp_timeline", "draw_ddp_overlap", "draw_ring", "ring_schedule"]


# ------------------------------------------------------------------------------ DDP buckets

def ddp_timeline(layer_grad_ms: list[float], bucket_layers: list[int], allreduce_ms: list[float],
                 ) -> dict[str, Any]:
    """When each bucket's all-reduce runs, overlapped with backward and after it (notebook 05).

    Backward produces the layers' gradients last layer first, taking ``layer_grad_ms[i]`` for layer
    ``i``; bucket ``b`` holds the next ``bucket_layers[b]`` layers in that order and is ready when
    its last gradient is; its all-reduce takes ``allreduce_ms[b]``, one at a time, as on one
    communication stream. Returns the ``backward`` spans per layer, the ``overlapped`` and
    ``after`` spans per bucket, and both end times.
    """
    if sum(bucket_layers) != len(layer_grad_ms) or len(bucket_layers) != len(allreduce_ms):
        raise ValueError(f"bucket_layers must split the {len(layer_grad_ms)} layers (sum to it), one "
                         f"all-reduce time per bucket; got {bucket_layers} and {allreduce_ms}")
    if any(not isinstance(t, (int, float)) or t < 0 for t in [*layer_grad_ms, *allreduce_ms]):
        raise ValueError("times must be numbers >= 0")
    backward, clock = [], 0.0
    for layer in reversed(range(len(layer_grad_ms))):
        backward.append((layer, clock, clock + layer_grad_ms[layer]))
        clock += layer_grad_ms[layer]
    ready, done = [], 0
    for count in bucket_layers:
        done += count
        ready.append(backward[done - 1][2])
    overlapped, free = [], 0.0
    for b, ms in enumerate(allreduce_ms):
        start = max(ready[b], free)
        overlapped.append((b, start, start + ms))
        free = start + ms
    after, free = [], clock
    for b, ms in enumerate(allreduce_ms):
        after.append((b, free, free + ms))
        free += ms
    return {"backward": backward, "ready": ready, "overlapped": overlapped, "after": after,
            "end_overlapped": max(clock, overlapped[-1][2]), "end_after": after[-1][2]}


def draw_ddp_overlap(layer_grad_ms: list[float] | None = None, bucket_layers: list[int] | None = None,
                     allreduce_ms: list[float] | None = None, ax: Any = None):
    """Draw ``ddp_timeline`` as two timelines (overlapped, then after backward); returns the figure."""
    import matplotlib.pyplot as plt

    layer_grad_ms = layer_grad_ms or [2.0] * 8
    bucket_layers = bucket_layers or [2, 2, 2, 2]
    allreduce_ms = allreduce_ms or [3.0] * len(bucket_layers)
    t = ddp_timeline(layer_grad_ms, bucket_layers, allreduce_ms)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 2.8))
    colors = plt.get_cmap("tab10").colors
    rows = {"backward (compute)": 3, "all-reduce, overlapped (DDP)": 2, "all-reduce after backward": 0.6}
    layer_bucket, first = {}, 0
    for b, count in enumerate(bucket_layers):
        for layer in [s[0] for s in t["backward"][first:first + count]]:
            layer_bucket[layer] = b
        first += count
    for layer, start, end in t["backward"]:
        row = rows["backward (compute)"]
        ax.barh(row, end - start, left=start, color=colors[layer_bucket[layer] % 10], edgecolor="white")
        ax.text((start + end) / 2, row, f"L{layer}", ha="center", va="center", fontsize=7)
    for key, row in (("overlapped", rows["all-reduce, overlapped (DDP)"]),
                     ("after", rows["all-reduce after backward"])):
        for b, start, end in t[key]:
            ax.barh(row, end - start, left=start, color=colors[b % 10], alpha=0.8, edgecolor="white")
            ax.text((start + end) / 2, row, f"bucket {b}", ha="center", va="center", fontsize=7)
    ax.axvline(t["end_overlapped"], color="tab:green", ls="--", lw=1)
    ax.axvline(t["end_after"], color="tab:red", ls="--", lw=1)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlabel("time (ms, illustrative)")
    ax.set_title(f"Buckets all-reduced during backward end at {t['end_overlapped']:g} ms; "
                 f"after backward, at {t['end_after']:g} ms", fontsize=10)
    return ax.figure


# ------------------------------------------------------------------------------ the ring

@dataclass(frozen=True)
class RingStep:
    """One step of the ring: ``sends[r]`` is the chunk rank ``r`` sends to rank ``r + 1``;
    ``holds[r][c]`` is how many ranks' values chunk ``c`` on rank ``r`` sums after the step."""

    phase: str
    step: int
    sends: tuple[int, ...]
    holds: tuple[tuple[int, ...], ...]


def ring_schedule(world_size: int) -> list[RingStep]:
    """The ring all-reduce of ``collectives.ring_all_reduce``, step by step (notebook 05).

    Reduce-scatter: at step ``s`` rank ``r`` sends chunk ``(r - s) % N`` and adds what it receives;
    after ``N - 1`` steps rank ``r`` holds the full sum of chunk ``(r + 1) % N``. All-gather: at
    step ``s`` rank ``r`` passes on the finished chunk ``(r + 1 - s) % N``, and the receiver
    overwrites its copy.
    """
    n = check_positive_int("world_size", world_size)
    holds = [[1] * n for _ in range(n)]
    steps = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            sends = [((r - s) if phase == "reduce-scatter" else (r + 1 - s)) % n for r in range(n)]
            before = [row[:] for row in holds]
            for r in range(n):
                c, right = sends[r], (r + 1) % n
                added = before[right][c] if phase == "reduce-scatter" else 0
                holds[right][c] = before[r][c] + added
            steps.append(RingStep(phase, s, tuple(sends), tuple(tuple(row) for row in holds)))
    return steps


def draw_ring(world_size: int = 4):
    """Draw ``ring_schedule``: a row of panels per phase, one panel per step, ranks by chunks,
    shaded by how many ranks' values each chunk sums; the chunk each rank just received is boxed."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    steps = ring_schedule(world_size)
    n = world_size
    if not steps:
        raise ValueError("a ring needs world_size >= 2")
    per_phase = n - 1
    fig, axes = plt.subplots(2, per_phase, figsize=(max(3.0 * per_phase, 6.0), 6.4), squeeze=False)
    for ax, st in zip(axes.flat, steps, strict=True):
        ax.imshow(st.holds, cmap="Blues", vmin=0, vmax=n * 1.15)  # the darkest shade keeps contrast
        for r in range(n):
            received = st.sends[(r - 1) % n]  # what the left neighbour sent this step
            for c in range(n):
                value = st.holds[r][c]
                ax.text(c, r, value, ha="center", va="center", fontsize=12,
                        color="white" if value >= 0.6 * n else "black")
            ax.add_patch(Rectangle((received - 0.44, r - 0.44), 0.88, 0.88, fill=False,
                                   edgecolor="tab:orange", linewidth=3))
        ax.set_title(f"{st.phase}, step {st.step + 1}", fontsize=11)
        ax.set_xticks(range(n), [f"chunk {c}" for c in range(n)], fontsize=9)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=9)
    fig.suptitle(f"Ring all-reduce on {n} ranks: how many ranks' values each chunk sums "
                 f"(orange box: received this step)", fontsize=12)
    fig.tight_layout()
    return fig
