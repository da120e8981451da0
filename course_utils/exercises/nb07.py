"""Judges of the exercises of notebook 07 (batch size and learning rate); their content is in nb07.toml.

07.1 reads two pairs of learning rates, one per new world: one with another global batch, one with
the recipe's global batch on more GPUs of fewer rows, where reasoning per GPU parts from reasoning
on the global batch. 07.2 runs the answer on squared norms drawn from gradients of a known mean and
covariance, on several world sizes and per-rank batches, beside the look-alikes the lesson is
about, and requires every draw's three values to be the unbiased estimates (of the estimates
linear in the two squared norms, only one of each is unbiased) and their ratio. 07.3 runs the
answer on real gloo ranks (2 and 3, several numbers of micro-batches in each launch) by a plan
(``together.by_plan``), with the rank side in ``nb07_ranks``, compares the weights with one process on
the same global batches (what N·k ranks end with, notebook 05), and counts each step's all-reduces
and backward passes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .answers import NOT_A_NUMBER, reals
from .core import load_bank, untimed
from .nb07_ranks import accumulation_answer_rank, reference_weights
from .on_ranks import Plan
from .together import by_plan

__all__ = ["CASES", "EXERCISES"]

#: 07.1: the recipe (global batch on so many GPUs, SGD's and AdamW's learning rates) and the new worlds
RECIPE_BATCH, RECIPE_GPUS, SGD_LR, ADAMW_LR = 256, 8, 0.1, 1e-3
NEW_WORLDS = [(4, 60), (16, 16)]  # (GPUs, rows per GPU): another global batch; the same one
#: 07.2: (world size N, rows per rank B, seed): the squared norms of N ranks' gradients of B rows
NOISE_CASES = [(2, 4, 0), (4, 8, 1), (8, 2, 2), (3, 16, 3)]
NOISE_DIM, NOISE_DRAWS = 6, 600
#: 07.3: world size -> the numbers of micro-batches tried in its launch; rows per rank
ACCUMULATION_CASES = {2: (2, 3), 3: (4, 2)}
ACCUMULATION_ROWS = 12

CASES: dict[str, list[str]] = {
    "07.1": [f"a recipe tuned at a global batch of {RECIPE_BATCH} on {RECIPE_GPUS} GPUs (SGD lr {SGD_LR:g}, "
             f"AdamW lr {ADAMW_LR:g}), run on {gpus} GPUs with {rows} rows each"
             for gpus, rows in NEW_WORLDS],
    "07.2": [f"N={n} ranks of B={b} rows, {NOISE_DRAWS} draws of gradients of known mean and covariance "
             f"(dimension {NOISE_DIM}, seed {seed})" for n, b, seed in NOISE_CASES]
    + ["b_big equal to b_small", "b_big smaller than b_small"],
    "07.3": [f"world_size={n}, k={k} micro-batches of a rank's {ACCUMULATION_ROWS} rows, against one process "
             "on the global batch" for n, ks in ACCUMULATION_CASES.items() for k in ks],
}


# ---------------------------------------------------------------- 07.1: the learning rates

def _pairs(answer: Any) -> list[list[float]] | None:
    """Two pairs of numbers (a list or tuple of two sequences of two), or None."""
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence) or len(answer) != len(NEW_WORLDS):
        return None
    pairs = [reals(pair, 2) for pair in answer]
    return None if any(p is None for p in pairs) else pairs  # type: ignore[return-value]


def _judge_learning_rates(answer: Any) -> str | None:
    pairs = _pairs(answer)
    if pairs is None:
        return ("write two pairs, one per new world: ((SGD's rate, AdamW's rate) on 4 GPUs, (SGD's rate, "
                f"AdamW's rate) on 16 GPUs); {NOT_A_NUMBER}")
    for (gpus, rows), (sgd, adamw) in zip(NEW_WORLDS, pairs, strict=True):
        hint = _rates_hint(gpus, rows, sgd, adamw)
        if hint is not None:
            return f"on {gpus} GPUs with {rows} rows each: {hint}"
    return None


def _rates_hint(gpus: int, rows: int, sgd: float, adamw: float) -> str | None:
    def near(value: float, ratio: float, base: float) -> bool:
        return math.isclose(value, base * ratio, rel_tol=2e-3)

    def either(ratio: float) -> bool:  # SGD's or AdamW's rate scaled by ``ratio`` under its rule
        return near(sgd, ratio, SGD_LR) or near(adamw, math.sqrt(ratio), ADAMW_LR)

    new = gpus * rows / RECIPE_BATCH
    if near(sgd, new, SGD_LR) and near(adamw, math.sqrt(new), ADAMW_LR):
        return None
    if near(sgd, math.sqrt(new), SGD_LR) and near(adamw, new, ADAMW_LR):
        return "the two rules are swapped: the linear rule is SGD's, the square-root rule is Adam's"
    if either(rows / (RECIPE_BATCH / RECIPE_GPUS)) or either(rows / RECIPE_BATCH):
        return ("that scales by the rows per GPU: a rule follows the global batch (rows per GPU times GPUs, "
                "what all the GPUs together take in one step), so compare the new global batch with the "
                f"recipe's {RECIPE_BATCH}")
    if either(gpus / RECIPE_GPUS) or either(gpus):
        return ("that scales by the GPUs: a rule follows the global batch, not the number of GPUs (the same "
                "global batch on more GPUs of fewer rows each is the same training)")
    if near(sgd, 1, SGD_LR) and near(adamw, 1, ADAMW_LR):
        return ("DDP's mean does not change the learning rate the recipe needs at its own batch, but the "
                "global batch changed: the rules rescale the learning rate by how much")
    if either(1 / new):
        return ("the ratio is upside down: a smaller global batch than the recipe's takes a smaller "
                "learning rate")
    if near(sgd, new, SGD_LR):
        return "SGD's is right; AdamW's takes the square-root rule, not the linear one"
    if near(adamw, math.sqrt(new), ADAMW_LR):
        return "AdamW's is right; SGD's takes the linear rule, not the square-root one"
    return ("work out the new global batch (rows per GPU times GPUs), its ratio to the recipe's, then "
            "apply each optimizer's rule to its own learning rate")


# ---------------------------------------------------------------- 07.2: gradient_noise_scale

def _draws(world: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The squared norms (mean local, averaged) of ``NOISE_DRAWS`` steps of ``world`` ranks of
    ``rows`` rows each, per-row gradients ``G + L z``; and the true ``|G|²`` and ``tr(Σ)``."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(NOISE_DIM, generator=g, dtype=torch.float64) * 0.3
    factor = torch.randn(NOISE_DIM, NOISE_DIM, generator=g, dtype=torch.float64) / NOISE_DIM ** 0.5
    noise = torch.randn(NOISE_DRAWS, world, rows, NOISE_DIM, generator=g, dtype=torch.float64)
    per_row = mean + noise @ factor.T
    local = per_row.mean(2)  # each rank's gradient over its rows
    small = local.square().sum(-1).mean(1)  # the mean over the ranks of the local squared norms
    big = local.mean(1).square().sum(-1)  # the averaged gradient's squared norm
    return small, big, float(mean.square().sum()), float((factor @ factor.T).trace())


def _formula(small: float, big: float, b_small: float, b_big: float) -> tuple[float, float, float]:
    sq_norm = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    return sq_norm, trace, trace / sq_norm


def _close(got: list[float], want: tuple[float, ...]) -> bool:
    return all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-9) for a, b in zip(got, want, strict=True))


def _refuses(answer: Any, b_small: float, b_big: float) -> str | None:
    try:
        answer(0.5, 0.3, b_small, b_big)
    except ValueError:
        return None
    except Exception as err:  # noqa: BLE001 - another exception is the learner's mistake to name
        return (f"with b_big={b_big:g} and b_small={b_small:g} it raised {type(err).__name__}: refuse "
                "sizes that give nothing to solve with a ValueError that says so")
    return (f"with b_big={b_big:g} and b_small={b_small:g} it returned estimates: the two equations need two "
            "batch sizes, the big one larger; raise a ValueError")


def _judge_noise_scale(answer: Any) -> str | None:
    for b_small, b_big in ((8, 8), (16, 4)):
        hint = _refuses(answer, b_small, b_big)
        if hint is not None:
            return hint
    for world, rows, seed in NOISE_CASES:
        with untimed():
            small, big, _, _ = _draws(world, rows, seed)
        b_small, b_big = rows, world * rows
        draws = list(zip(small.tolist(), big.tolist(), strict=True))
        estimates = []
        for s, b in draws:
            got = reals(answer(s, b, b_small, b_big), 3)
            if got is None:
                return f"return three numbers, (|G|², tr(Σ), B_simple); {NOT_A_NUMBER}"
            hint = _look_alike(got, s, b, b_small, b_big)
            if hint is not None:
                return hint
            estimates.append(got)
        if len({tuple(e) for e in estimates}) == 1:
            return ("your function gives the same estimates for different squared norms: they must be "
                    "worked out from the two squared norms and the two batch sizes it is given")
        hint = _unbiased(estimates, draws, b_small, b_big, f"N={world} ranks of B={rows} rows")
        if hint is not None:
            return hint
    return None


def _unbiased(estimates: list[list[float]], draws: list[tuple[float, float]], b_small: float, b_big: float,
              case: str) -> str | None:
    """The hint for estimates that are not, draw by draw, the unbiased ones (with two squared norms
    there is only one linear estimate of each that is unbiased on every distribution), or None."""
    right = [_formula(s, b, b_small, b_big) for s, b in draws]
    # what a value may differ by from rounding alone: the terms it is worked out from, float32 or float64
    scales = [((b_big * abs(b) + b_small * abs(s)) / (b_big - b_small),
               (abs(s) + abs(b)) / (1 / b_small - 1 / b_big)) for s, b in draws]
    for index, name in ((1, "tr(Σ)"), (0, "|G|²")):
        if all(abs(got[index] - want[index]) <= 1e-5 * scale[index]
               for got, want, scale in zip(estimates, right, scales, strict=True)):
            continue
        ratios = [got[index] / want[index] for got, want in zip(estimates, right, strict=True) if want[index]]
        if ratios and all(math.isclose(r, ratios[0], rel_tol=1e-5) for r in ratios):
            return (f"your {name} is a fixed multiple of the unbiased estimate, the same on every draw "
                    f"({case}): a bias that no averaging over steps removes; the estimate's expected value "
                    f"must be the true {name} on every distribution, with no factor of your own")
        return (f"your estimate of {name} is not unbiased ({case}, {NOISE_DRAWS} draws): with two squared "
                "norms only one linear combination of them has the true value as its average on every "
                "distribution; write down the expected squared norm of a gradient over B rows for both "
                "sizes, and solve the two equations for the two unknowns")

    def ratio(a: float, b: float) -> float:
        return a / b if b else math.copysign(math.inf, a) if a else math.nan

    for got in estimates:
        if math.isclose(got[2], ratio(got[1], got[0]), rel_tol=1e-5):
            continue
        over_big = [ratio(e[1], b) for e, (_, b) in zip(estimates, draws, strict=True)]
        if all(math.isclose(e[2], r, rel_tol=1e-5) for e, r in zip(estimates, over_big, strict=True)):
            return ("B_simple divides tr(Σ) by the averaged gradient's squared norm, which is not |G|²: it "
                    "still holds noise; B_simple is the ratio of your own two estimates")
        return ("|G|² and tr(Σ) are right; B_simple must be their ratio, tr(Σ) over |G|², on every draw as "
                "they came out (a single step's |G|² can be negative: averaging the estimates over steps, "
                "not changing one step's ratio, deals with that)")
    return None


def _look_alike(got: list[float], small: float, big: float, b_small: float, b_big: float) -> str | None:
    """The hint for an answer that matches a look-alike of the estimator on this draw, or None."""
    right = _formula(small, big, b_small, b_big)
    if _close(got, right):
        return None
    if math.isclose(got[0], big, rel_tol=1e-6):
        return ("the averaged gradient's squared norm is not |G|²: it still holds noise, a smaller share "
                "than one rank's gradient but not none; use the two squared norms together")
    if _close(got, _formula(small, big, b_big, b_small)):
        return ("the batch sizes are swapped: b_small goes with the squared norm of the gradient over fewer "
                "rows (one rank's), b_big with the averaged one")
    if b_big != 2 * b_small and _close(got, _formula(small, big, b_small, 2 * b_small)):
        return ("that takes b_big to be twice b_small, a world size of 2 written in: this check runs "
                "other world sizes; use the b_big it is given")
    if _close(got[:2], right[:2]) and math.isclose(got[2], 1 / right[2], rel_tol=1e-5):
        return "|G|² and tr(Σ) are right; B_simple is the noise over the signal, not the other way round"
    if _close(got[:2], right[1::-1]):
        return "the two estimates are in the wrong order: return (|G|², tr(Σ), B_simple)"
    return None


# ---------------------------------------------------------------- 07.3: accumulation on ranks

def _accumulation_hint(world: int, k: int, ranks: list[dict]) -> str | None:
    first = ranks[0]
    with untimed():
        right = reference_weights(world, ACCUMULATION_ROWS, k, "right")
    agree = all(torch.allclose(r["weights"], first["weights"], rtol=1e-5, atol=1e-7) for r in ranks)
    counts = [c for r in ranks for c in r["all_reduces"]]
    if not agree:
        if not any(counts):
            return ("the ranks ended with different weights: their gradients were never all-reduced; the "
                    "last micro-batch's backward must run outside no_sync")
        return ("the ranks ended with different weights: gradient was added on each rank after the "
                "all-reduce; the all-reduce must come after the last micro-batch, once every gradient of "
                "the step has been added up")
    if any(c > 1 for c in counts):
        return (f"every micro-batch's backward all-reduced ({max(counts)} all-reduces in a step): the "
                "numbers can come out right, but accumulating is there to save those all-reduces; only "
                "the last backward of a step synchronises, the others run under no_sync")
    if set(len_ for r in ranks for len_ in r["rows"]) != {ACCUMULATION_ROWS // k}:
        return ("the forward passes did not see k micro-batches of a rank's rows: a fixed number of "
                "micro-batches was written in, and this check runs several k")
    backwards = {c for r in ranks for c in r["backwards"]}
    if backwards != {k}:
        return (f"the backward ran {min(backwards)} time(s) in a step for k={k} micro-batches: one backward "
                "of the micro-batches' losses added up keeps every micro-batch's graph alive until it runs, "
                "the memory of the whole batch at once that accumulating is there to avoid; run a backward "
                "per micro-batch, as soon as its loss is computed")
    got = first["weights"]
    if torch.allclose(got, right, rtol=1e-4, atol=1e-6):
        return None
    with untimed():
        k_times, last_only = (reference_weights(world, ACCUMULATION_ROWS, k, how)
                              for how in ("k times", "last only"))
    if torch.allclose(got, k_times, rtol=1e-4, atol=1e-6):
        return ("the gradient is k times the mean: each micro-batch's loss is a mean over its rows, so the "
                "k accumulated gradients add up to k times the gradient of the rank's rows")
    if torch.allclose(got, last_only, rtol=1e-4, atol=1e-6):
        return ("only the last micro-batch's gradient reached the step: zero_grad between the micro-batches "
                "throws the accumulated ones away; clear the gradients once per optimizer step")
    return (f"on {world} ranks with k={k}, the weights are not those of {world * k} ranks on the same rows "
            "(one process on the global batch)")


def _accumulation_plan(answer: Any) -> Plan:
    for world, ks in ACCUMULATION_CASES.items():
        results, hint = yield (accumulation_answer_rank, world, answer, ks, ACCUMULATION_ROWS)
        if results is None:
            return hint
        for k in ks:
            hint = _accumulation_hint(world, k, [r[k] for r in results])
            if hint is not None:
                return hint
    return None


_judge_accumulation = by_plan(_accumulation_plan, "the ranks hung: every rank must run the same backward "
                                                  "passes, with the same ones under no_sync")


EXERCISES = load_bank(__name__)
