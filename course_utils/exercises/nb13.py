"""Judges of the exercises of notebook 13 (batch size and learning rate); their content is in nb13.toml.

13.1 reads a pair of learning rates. 13.2 runs the answer on squared norms drawn from gradients of
a known mean and covariance, on several world sizes and per-rank batches, beside the course's
estimator and the look-alikes the lesson is about. 13.3 runs the answer on real gloo ranks (2 and
3, several numbers of micro-batches in each launch) through ``run_on_ranks``, with the rank side
in ``nb13_ranks``, and compares the weights with one process on the same global batches: what N·k
ranks end with (notebook 05).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .answers import NOT_A_NUMBER, reals
from .core import load_bank, untimed
from .nb13_ranks import ACCUMULATION_LR, accumulation_answer_rank, global_batches
from .on_ranks import run_on_ranks

__all__ = ["CASES", "EXERCISES"]

#: 13.1: the recipe (global batch, SGD's and AdamW's learning rates) and the new world
RECIPE_BATCH, SGD_LR, ADAMW_LR, GPUS, ROWS_PER_GPU = 256, 0.1, 1e-3, 4, 60
#: 13.2: (world size N, rows per rank B, seed): the squared norms of N ranks' gradients of B rows
NOISE_CASES = [(2, 4, 0), (4, 8, 1), (8, 2, 2), (3, 16, 3)]
NOISE_DIM, NOISE_DRAWS = 6, 600
#: 13.3: world size -> the numbers of micro-batches tried in its launch; rows per rank
ACCUMULATION_CASES = {2: (2, 3), 3: (4, 2)}
ACCUMULATION_ROWS = 12

CASES: dict[str, list[str]] = {
    "13.1": [f"a recipe tuned at a global batch of {RECIPE_BATCH} (SGD lr {SGD_LR:g}, AdamW lr "
             f"{ADAMW_LR:g}), run on {GPUS} GPUs with {ROWS_PER_GPU} rows each"],
    "13.2": [f"N={n} ranks of B={b} rows, {NOISE_DRAWS} draws of gradients of known mean and covariance "
             f"(dimension {NOISE_DIM}, seed {seed})" for n, b, seed in NOISE_CASES]
    + ["b_big equal to b_small", "b_big smaller than b_small"],
    "13.3": [f"world_size={n}, k={k} micro-batches of a rank's {ACCUMULATION_ROWS} rows, against one process "
             "on the global batch" for n, ks in ACCUMULATION_CASES.items() for k in ks],
}


# ---------------------------------------------------------------- 13.1: the learning rates

def _judge_learning_rates(answer: Any) -> str | None:
    values = reals(answer, 2)
    if values is None:
        return f"write a pair: (SGD's learning rate, AdamW's learning rate); {NOT_A_NUMBER}"
    sgd, adamw = values

    def near(value: float, ratio: float, base: float) -> bool:
        return math.isclose(value, base * ratio, rel_tol=2e-3)

    new, per_gpu = GPUS * ROWS_PER_GPU / RECIPE_BATCH, ROWS_PER_GPU / RECIPE_BATCH
    if near(sgd, new, SGD_LR) and near(adamw, math.sqrt(new), ADAMW_LR):
        return None
    if near(sgd, math.sqrt(new), SGD_LR) and near(adamw, new, ADAMW_LR):
        return "the two rules are swapped: the linear rule is SGD's, the square-root rule is Adam's"
    if near(sgd, per_gpu, SGD_LR) or near(adamw, math.sqrt(per_gpu), ADAMW_LR):
        return ("that scales by the rows per GPU: the recipe's 256 is a global batch, what all the GPUs "
                "together take in one step, so compare it with the new global batch")
    if near(sgd, GPUS, SGD_LR) or near(adamw, math.sqrt(GPUS), ADAMW_LR):
        return ("that scales by the GPUs alone: a rule follows the global batch, not the number of GPUs "
                "(the recipe's 256 rows may have been on any number of them)")
    if near(sgd, 1, SGD_LR) and near(adamw, 1, ADAMW_LR):
        return ("DDP's mean does not change the learning rate the recipe needs at its own batch, but the "
                "global batch changed: the rules rescale the learning rate by how much")
    if near(sgd, 1 / new, SGD_LR) or near(adamw, 1 / math.sqrt(new), ADAMW_LR):
        return ("the ratio is upside down: a smaller global batch than the recipe's takes a smaller "
                "learning rate")
    if near(sgd, new, SGD_LR):
        return "SGD's is right; AdamW's takes the square-root rule, not the linear one"
    if near(adamw, math.sqrt(new), ADAMW_LR):
        return "AdamW's is right; SGD's takes the linear rule, not the square-root one"
    return ("work out the new global batch (rows per GPU times GPUs), its ratio to the recipe's, then "
            "apply each optimizer's rule to its own learning rate")


# ---------------------------------------------------------------- 13.2: gradient_noise_scale

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
            small, big, sq_norm, trace = _draws(world, rows, seed)
        b_small, b_big = rows, world * rows
        estimates = []
        for s, b in zip(small.tolist(), big.tolist(), strict=True):
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
        mean_sq = sum(e[0] for e in estimates) / len(estimates)
        mean_trace = sum(e[1] for e in estimates) / len(estimates)
        if not (math.isclose(mean_sq, sq_norm, rel_tol=0.25, abs_tol=0.02)
                and math.isclose(mean_trace, trace, rel_tol=0.1)):
            return (f"averaged over {NOISE_DRAWS} draws of N={world} ranks of B={rows} rows, your estimates "
                    "are not the distribution's |G|² and tr(Σ): each estimate must be unbiased; write down "
                    "the expected squared norm of a gradient over B rows for both sizes, and solve the two "
                    "equations for the two unknowns")
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


# ---------------------------------------------------------------- 13.3: accumulation on ranks

def _reference(world: int, k: int, how: str) -> torch.Tensor:
    """One process on 13.3's global batches (what N·k ranks end with), or a look-alike: ``"k times"``
    (each micro-batch's loss not divided by k), ``"last only"`` (each rank's last micro-batch alone,
    its loss divided by k)."""
    from ..ddp import batch_task
    from ..ddp.batch_size import MOMENTUM

    model = batch_task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=ACCUMULATION_LR, momentum=MOMENTUM)
    for x, y in global_batches(world, ACCUMULATION_ROWS):
        if how == "last only":
            x = torch.cat([part.tensor_split(k)[-1] for part in x.tensor_split(world)])
            y = torch.cat([part.tensor_split(k)[-1] for part in y.tensor_split(world)])
        scale = {"right": 1.0, "k times": float(k), "last only": 1.0 / k}[how]
        optimizer.zero_grad()
        (torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y) * scale).backward()
        optimizer.step()
    return model.weight.detach()[0]


def _accumulation_hint(world: int, k: int, ranks: list[dict]) -> str | None:
    first = ranks[0]
    with untimed():
        right = _reference(world, k, "right")
    if any(r["unfinished_step"] for r in ranks):
        return ("the optimizer stepped while the last backward's all-reduce was still running: wait for it "
                "and average, with the wrapper's finish_gradient_synchronization, before the optimizer's "
                "step")
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
    got = first["weights"]
    if torch.allclose(got, right, rtol=1e-4, atol=1e-6):
        return None
    with untimed():
        k_times, last_only = _reference(world, k, "k times"), _reference(world, k, "last only")
    if torch.allclose(got, k_times, rtol=1e-4, atol=1e-6):
        return ("the gradient is k times the mean: each micro-batch's loss is a mean over its rows, so the "
                "k accumulated gradients add up to k times the gradient of the rank's rows")
    if torch.allclose(got, last_only, rtol=1e-4, atol=1e-6):
        return ("only the last micro-batch's gradient reached the step: zero_grad between the micro-batches "
                "throws the accumulated ones away; clear the gradients once per optimizer step")
    return (f"on {world} ranks with k={k}, the weights are not those of {world * k} ranks on the same rows "
            "(one process on the global batch)")


def _judge_accumulation(answer: Any) -> str | None:
    for world, ks in ACCUMULATION_CASES.items():
        hang = ("the ranks hung: every rank must run the same backward passes, with the same ones under "
                "no_sync")
        results, hint = run_on_ranks(accumulation_answer_rank, world, answer, ks, ACCUMULATION_ROWS,
                                     hang_hint=hang)
        if results is None:
            return hint
        for k in ks:
            hint = _accumulation_hint(world, k, [r[k] for r in results])
            if hint is not None:
                return hint
    return None


EXERCISES = load_bank(__name__)
