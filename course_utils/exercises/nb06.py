"""Judges of the exercises of notebook 06 (DDP by hand); their content is in nb06.toml.

06.1 and 06.2 run the answer on real gloo ranks (2, 3 and 4) through ``run_on_ranks``, with the
rank side in ``nb06_ranks``. What ran is counted where every collective ends, in the methods of the
rank's ``ProcessGroup`` (``all_reduces.all_reduces_watched``), whatever name the answer called it
by, and so is every way of waiting for the handles those all-reduces returned (``wait()``, a wait
on their futures, ``torch.futures.wait_all``, polling ``is_completed()`` until it is true): the
check sees whether a wait happened inside the backward pass (communication serialised) or never
happened at all. A blocking all-reduce waits inside the call, so it counts as waited for.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .core import load_bank, untimed
from .nb06_ranks import HOOK_STEPS, average_rank, hooks_rank
from .on_ranks import hint_from_ranks

__all__ = ["CASES", "EXERCISES"]

#: 06.3: the model whose buckets the learner counts (``comm_heavy_model(WIDTH)``) and the cap (MB)
BUCKET_WIDTH, BUCKET_CAP_MB = 512, 0.75
#: 06.1's and 06.2's world sizes (06.2 trains HOOK_STEPS SGD steps in each)
WORLDS = (2, 3, 4)

CASES: dict[str, list[str]] = {
    "06.1": [f"world_size={n}, lesson_model with a tied weight and a frozen one, each rank its own rows"
             for n in WORLDS],
    "06.2": [f"world_size={n}, ranks seeded differently, a tied weight and a frozen one, "
             f"{HOOK_STEPS} SGD steps against one process" for n in WORLDS],
    "06.3": [f"comm_heavy_model({BUCKET_WIDTH}), bucket_cap_mb={BUCKET_CAP_MB}"],
}


# ---------------------------------------------------------------- 06.3: how many buckets

def _whole_number(answer: Any) -> int | None:
    """``answer`` as a whole number (an int, a numpy integer, a float or a one-value tensor holding a
    whole number), or None."""
    if isinstance(answer, torch.Tensor):
        if answer.numel() != 1 or answer.dtype == torch.bool or answer.is_complex():
            return None
        answer = answer.item()
    if isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Integral):
        return int(answer)
    if isinstance(answer, numbers.Real):
        try:
            value = float(answer)
        except (OverflowError, ValueError):  # a fraction too large for a float: no count of buckets
            return None
        return int(value) if math.isfinite(value) and value.is_integer() else None
    return None


def _old_rule_count(params: list, cap: float) -> int:
    """The buckets when a bucket never passes the cap (a parameter that would take it past opens the
    next one): the rule this course used before it took DDP's."""
    count, size = 0, 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if count == 0 or size + nbytes > cap:
            count, size = count + 1, 0
        size += nbytes
    return count


def _judge_bucket_count(answer: Any) -> str | None:
    count = _whole_number(answer)
    if count is None:
        return "write the number of buckets, a whole number"
    from ..ddp.by_hand import assign_buckets
    from ..ddp.by_hand_timing import comm_heavy_model

    with untimed():  # the course's own reference
        params = list(comm_heavy_model(BUCKET_WIDTH).parameters())
    right = len(assign_buckets(params, BUCKET_CAP_MB))
    cap = BUCKET_CAP_MB * 2**20
    total = sum(p.numel() * p.element_size() for p in params)
    weights = [p for p in params if p.dim() == 2]
    if count == right:
        return None
    if count == len(params):
        return ("that is one bucket per parameter, what no cap at all gives: with a cap, gradients share "
                "a bucket until it has reached the cap")
    if count == len(weights):
        return ("that is one bucket per layer (or the parameters walked in the order they were "
                "registered): a bucket knows nothing of layers; it holds gradients, counted in bytes, "
                "taken from the last parameter registered to the first, until they reach the cap")
    if count == _old_rule_count(params, cap):
        return ("that keeps every bucket within the cap: a bucket closes only once it has reached the "
                "cap, so its last parameter may take it past the cap, and a parameter larger than the "
                "cap shares its bucket with the ones before it")
    if count in (math.floor(total / cap), math.ceil(total / cap)):
        return ("that divides the model's size by the cap, as if the buckets were filled exactly to the "
                "cap: a parameter is never split, so a bucket holds whole gradients and usually ends "
                "past the cap")
    if count <= 1:
        return "the model's gradients take more bytes than the cap: more than one bucket is needed"
    return ("walk the parameters from the last one registered to the first (the order backward produces "
            "their gradients), adding each one's bytes (four per float32 value, the biases too) to the "
            "current bucket, and close the bucket as soon as it has reached the cap")


# ---------------------------------------------------------------- 06.1 and 06.2 on every world size

def _on_every_world_size(rank_fn: Any, answer: Any) -> str | None:
    """The first hint ``rank_fn`` gives on ``answer``, trying each of ``WORLDS`` in turn."""
    for world_size in WORLDS:
        hint = hint_from_ranks(rank_fn, world_size, answer, hang_hint=(
            "the ranks hung: every rank must all-reduce the same gradients, in the same order"))
        if hint is not None:
            return hint
    return None


def _judge_average_gradients(answer: Any) -> str | None:
    return _on_every_world_size(average_rank, answer)


def _judge_hooks(answer: Any) -> str | None:
    return _on_every_world_size(hooks_rank, answer)


EXERCISES = load_bank(__name__)
