"""Notebook 07's sweep: steps to the target against the global batch, for each learning-rate rule,
and what the curve's shape says (section 2), with AdaScale beside the rules (section 4).

The recipe is tuned once, at the smallest global batch :data:`BASE_BATCH` (the best learning rate
of a grid, for SGD with momentum and for AdamW); every rule then derives the learning rate at a
larger batch from it. Beside the rules, each batch also gets its own best learning rate from a
grid (half an octave apart): Shallue et al.'s curve, the reference every rule is compared with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import batch_task
from .batch_size import Config, linear_rule, sqrt_rule, sweep_batch
from .noise_scale import fairscale_smoothing

__all__ = ["ADAMW_GRID", "BASE_BATCH", "BATCHES", "CURVES", "SEEDS", "SGD_GRID", "TARGET", "Curves",
           "best_of", "critical_batch", "curves", "regions", "speedups", "tune"]

#: the recipe's global batch, and the global batches of the sweep (4 to 1024: 2**8 between them)
BASE_BATCH = 4
BATCHES = tuple(BASE_BATCH * 2**k for k in range(9))
#: seeds per configuration: the steps are counted on the loss averaged over them
SEEDS = 8
#: the target: within this much of the teacher's own loss (nats)
TARGET_GAP = 0.004
TARGET = batch_task.BEST_LOSS + TARGET_GAP
#: a run that has not reached the target after this many steps has no count
MAX_STEPS = 1500
#: Goyal et al.'s gradual warmup: from the recipe's learning rate up to the rule's, over these steps
WARMUP_STEPS = 10
#: the learning rates tried at the recipe's batch, half an octave apart
SGD_GRID = tuple(0.01 * 2 ** (j / 2) for j in range(12))
ADAMW_GRID = tuple(0.004 * 2 ** (j / 2) for j in range(12))
#: the curves :func:`curves` measures, in the order of the plots' legends
CURVES = ("SGD, best lr", "SGD, fixed lr", "SGD, linear rule", "SGD, linear rule + warmup", "SGD, AdaScale",
          "SGD, AdaScale, fairscale's smoothing", "AdamW, best lr", "AdamW, linear rule",
          "AdamW, square-root rule")


#: rates whose steps are within this factor of the fewest tie for the best (the optimum is flat)
TIE = 1.03


def best_of(steps: Sequence[int | None], lrs: Sequence[float]) -> tuple[int | None, float]:
    """The fewest steps of a grid, and the best learning rate: several rates of a grid often tie
    within a few steps (the optimum is flat), so the middle one of those within ``TIE`` of the
    fewest (the lower of the two middle ones for an even count), a choice that a step more or
    less on another machine does not change. ``(None, nan)`` when none reached the target."""
    reached = [(s, lr) for s, lr in zip(steps, lrs, strict=True) if s is not None]
    if not reached:
        return None, math.nan
    fewest = min(s for s, _ in reached)
    tied = sorted(lr for s, lr in reached if s <= TIE * fewest)
    return fewest, tied[(len(tied) - 1) // 2]


def tune(batch: int, optimizer: str, lrs: Sequence[float], seeds: int = SEEDS, target: float = TARGET,
         max_steps: int = 4 * MAX_STEPS) -> tuple[float, int]:
    """The best learning rate of ``lrs`` at ``batch`` rows (:func:`best_of`) and the fewest steps
    (the grid's rates stop at twice those)."""
    steps = sweep_batch(batch, [Config(optimizer, lr) for lr in lrs], seeds, target, max_steps, keep=()).steps
    fewest, lr = best_of(steps, lrs)
    if fewest is None:
        raise RuntimeError(f"no learning rate of the grid reached the target within {max_steps} steps")
    return lr, fewest


@dataclass
class Curves:
    """The sweep's measurements: per curve of :data:`CURVES`, the steps to the target at each of
    ``batches`` (None: not within the step limit); the best learning rate of each batch, per
    optimizer; AdaScale's mean gain at each step (the course's smoothing), per batch."""

    batches: tuple[int, ...]
    steps: dict[str, list[int | None]] = field(default_factory=dict)
    best_lr: dict[str, list[float]] = field(default_factory=dict)
    gains: dict[int, list[float]] = field(default_factory=dict)


def _grid(optimizer: str, lr: float, k: int) -> list[Config]:
    """Learning rates half an octave apart, from half ``lr`` to ``2 ** (k + 1)`` times ``lr``: the
    rules' rates (``lr``, ``2 ** k lr``, ``2 ** (k / 2) lr``) are on it too."""
    return [Config(optimizer, lr * 2 ** (j / 2)) for j in range(-2, 2 * k + 3)]


def curves(sgd_lr: float, adamw_lr: float, batches: Sequence[int] = BATCHES, *, seeds: int = SEEDS,
           target: float = TARGET, max_steps: int = MAX_STEPS, progress: bool = True) -> Curves:
    """Every curve of :data:`CURVES`, the recipe being ``sgd_lr`` and ``adamw_lr`` at
    ``batches[0]`` rows: one :func:`.batch_size.sweep_batch` per global batch, with a progress bar."""
    from ..progress_bars import tqdm

    base = batches[0]
    out = Curves(tuple(batches), {name: [] for name in CURVES}, {"SGD": [], "AdamW": []})
    for batch in tqdm(list(batches), desc="global batches", disable=not progress, mininterval=0, miniters=1):
        k = round(math.log2(batch / base))
        # region: rules
        rules = {
            "SGD, fixed lr": Config("sgd", sgd_lr),
            "SGD, linear rule": Config("sgd", linear_rule(sgd_lr, base, batch)),
            "SGD, linear rule + warmup": Config("sgd", linear_rule(sgd_lr, base, batch),
                                                warmup=WARMUP_STEPS, warmup_from=sgd_lr),
            "SGD, AdaScale": Config("sgd", sgd_lr, adascale=True, base_batch=base),
            "SGD, AdaScale, fairscale's smoothing": Config("sgd", sgd_lr, adascale=True, base_batch=base,
                                                           smoothing=fairscale_smoothing(batch // base)),
            "AdamW, linear rule": Config("adamw", linear_rule(adamw_lr, base, batch)),
            "AdamW, square-root rule": Config("adamw", sqrt_rule(adamw_lr, base, batch)),
        }
        grids = {"SGD": _grid("sgd", sgd_lr, k), "AdamW": _grid("adamw", adamw_lr, k)}  # each batch's best
        # endregion
        configs = [*rules.values(), *grids["SGD"], *grids["AdamW"]]
        run = sweep_batch(batch, configs, seeds, target, max_steps, keep=range(len(rules)))
        for name, steps in zip(rules, run.steps, strict=False):
            out.steps[name].append(steps)
        start = len(rules)
        for name, grid in grids.items():
            steps = run.steps[start:start + len(grid)]
            start += len(grid)
            fewest, lr = best_of(steps, [c.lr for c in grid])
            out.steps[f"{name}, best lr"].append(fewest)
            out.best_lr[name].append(lr)
        out.gains[batch] = run.gains[list(rules).index("SGD, AdaScale")]
    return out


def speedups(steps: Sequence[int | None]) -> list[float]:
    """For each doubling of the batch, how many times fewer steps it took (NaN where a count is missing)."""
    return [a / b if a and b else math.nan for a, b in zip(steps, steps[1:], strict=False)]


def regions(steps: Sequence[int | None], perfect: float = 1.8, none: float = 1.1) -> list[str]:
    """The region of each doubling of the batch: ``"perfect scaling"`` when it cut the steps by at
    least ``perfect`` (2 is perfect), ``"no gain"`` when by at most ``none``, else ``"diminishing
    returns"``."""
    return ["perfect scaling" if r >= perfect else "no gain" if r <= none else "diminishing returns"
            for r in speedups(steps)]


def critical_batch(batches: Sequence[int], steps: Sequence[int | None]) -> tuple[float, float]:
    """McCandlish et al.'s fit of steps against batch, ``S = S_min (1 + B_crit / B)``: a line in
    ``1 / B`` (``S = S_min + E_min / B``), fitted to the counted points with weights ``1 / S``
    (relative errors); returns ``(S_min, B_crit = E_min / S_min)``."""
    points = [(1 / b, s) for b, s in zip(batches, steps, strict=True) if s]
    if len(points) < 2:
        raise ValueError("the fit needs at least two batches that reached the target")
    w = [1 / s**2 for _, s in points]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / sw
    my = sum(wi * y for wi, (_, y) in zip(w, points, strict=True)) / sw
    slope = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points, strict=True)) / sum(
        wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
    s_min = my - slope * mx
    return s_min, slope / s_min
