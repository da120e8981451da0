"""Judges of the exercises of notebook 06 (DDP by hand); their content is in nb06.toml.

06.1 and 06.2 run the answer on real gloo ranks (2, 3 and 4) by a plan (``together.by_plan``), with the
rank side in ``nb06_ranks``. What ran is counted where every collective ends, in the methods of the
rank's ``ProcessGroup`` (``all_reduces.all_reduces_watched``), whatever name the answer called it
by, and so is every way of waiting for the handles those all-reduces returned (``wait()``, a wait
on their futures, ``torch.futures.wait_all``, polling ``is_completed()`` until it is true): the
check sees whether a wait happened inside the backward pass (communication serialised) or never
happened at all. A blocking all-reduce waits inside the call, so it counts as waited for.
"""

from __future__ import annotations

import math
from typing import Any

from .answers import reals, whole
from .core import load_bank, untimed
from .nb06_ranks import HOOK_STEPS, average_rank, hooks_rank
from .together import by_plan, case_by_case

__all__ = ["CASES", "EXERCISES"]

#: 06.3: the model whose buckets the learner counts (``comm_heavy_model(WIDTH)``) and the caps (MiB)
BUCKET_WIDTH, BUCKET_CAPS_MB = 512, (0.75, 1.5)
#: 06.1's and 06.2's world sizes (06.2 trains HOOK_STEPS SGD steps in each)
WORLDS = (2, 3, 4)

CASES: dict[str, list[str]] = {
    "06.1": [f"world_size={n}, lesson_model with a tied weight and a frozen one, each rank its own rows"
             for n in WORLDS],
    "06.2": [f"world_size={n}, ranks seeded differently, a tied weight and a frozen one, "
             f"{HOOK_STEPS} SGD steps against one process; then two layers of one shape in an order that "
             "depends on the rank" for n in WORLDS],
    "06.3": [f"comm_heavy_model({BUCKET_WIDTH}), bucket_cap_mb={cap}" for cap in BUCKET_CAPS_MB],
}


# ---------------------------------------------------------------- 06.3: how many buckets

def _never_past(params: list, cap: float) -> int:
    """The buckets when a bucket never passes the cap (a parameter that would take it past opens the
    next one)."""
    count, size = 0, 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if count == 0 or size + nbytes > cap:
            count, size = count + 1, 0
        size += nbytes
    return count


class _Sized:
    """A parameter of ``n`` one-byte values: what the rule counts when it counts values."""

    dtype, device = "one byte", "anywhere"  # all alike: the rule keeps dtypes and devices apart

    def __init__(self, n: int) -> None:
        self.n = n

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 1


def look_alike_rules(params: list, cap_mb: float) -> dict[str, int]:
    """What the rules a learner may apply instead of DDP's give at ``cap_mb`` (the hint of each)."""
    from ..ddp.buckets import ddp_construction_buckets, fill_buckets

    cap = cap_mb * 2**20
    total = sum(p.numel() * p.element_size() for p in params)
    return {"as built": len(ddp_construction_buckets(params, cap_mb)), "per parameter": len(params),
            "per layer": sum(p.dim() == 2 for p in params), "never past": _never_past(params, cap),
            "size up": math.ceil(total / cap), "size down": math.floor(total / cap),
            "at least the cap": sum(p.numel() * p.element_size() >= cap for p in params),
            "values": len(fill_buckets([_Sized(p.numel()) for p in reversed(params)], cap_mb)),
            "whole MiB": round(total / 2**20)}


_RULE_HINTS = {
    "as built": ("that is how DDP assigns buckets when it is built (the parameters in registration order, "
                 "the list of buckets then reversed), which it keeps with find_unused_parameters=True; "
                 "assign_buckets walks the gradients in the order they arrive, last layer first, as DDP's "
                 "rebuild after the first iteration does"),
    "per parameter": ("that is one bucket per parameter, what no cap at all gives: with a cap, gradients "
                      "share a bucket until it has reached the cap"),
    "per layer": ("that is one bucket per layer: a bucket knows nothing of layers; it holds gradients, "
                  "counted in bytes, taken last parameter first, until they reach the cap"),
    "never past": ("that keeps every bucket within the cap: a bucket closes only once it has reached the "
                   "cap, so its last parameter may take it past, and a parameter larger than the cap shares "
                   "its bucket with the ones before it"),
    "size up": ("that divides the model's size by the cap, as if the buckets were filled exactly to the "
                "cap: a parameter is never split, so a bucket holds whole gradients and usually ends past "
                "the cap"),
    "at least the cap": ("that counts the parameters at least as large as the cap: a bucket holds every "
                         "gradient walked until it reaches the cap, the small ones too"),
    "values": ("that counts values, not bytes: a float32 value takes four bytes, and the cap is in MiB "
               "of bytes"),
    "whole MiB": ("that is the model's size in MiB, which does not depend on the cap: the number of "
                  "buckets does (compare your two answers)"),
}
_RULE_HINTS["size down"] = _RULE_HINTS["size up"]


def _judge_bucket_count(answer: Any) -> str | None:
    values = reals(answer, length=len(BUCKET_CAPS_MB))
    counts = None if values is None else [whole(v) for v in values]
    if counts is None or None in counts:
        return (f"write the two numbers of buckets, at bucket_cap_mb={BUCKET_CAPS_MB[0]} and then at "
                f"{BUCKET_CAPS_MB[1]}, as two whole numbers in a tuple")
    from ..ddp.buckets import assign_buckets
    from ..ddp.by_hand_timing import comm_heavy_model

    with untimed():  # the course's own reference
        params = list(comm_heavy_model(BUCKET_WIDTH).parameters())
    right = [len(assign_buckets(params, cap)) for cap in BUCKET_CAPS_MB]
    if counts == right:
        return None
    rules = [look_alike_rules(params, cap) for cap in BUCKET_CAPS_MB]
    for name, hint in _RULE_HINTS.items():  # a rule that gives both answers (first, the likeliest)
        if counts == [r[name] for r in rules]:
            return hint
    if counts[::-1] == right:
        return "the two counts are swapped: the first is at 0.75 MiB, the second at 1.5 MiB (fewer buckets)"
    if min(counts) <= 1:
        return "the model's gradients take more bytes than either cap: more than one bucket each time"
    wrong = next(i for i in range(len(right)) if counts[i] != right[i])
    return (f"the count at {BUCKET_CAPS_MB[wrong]} MiB is not what DDP's rule gives: walk the parameters "
            "from the last one registered to the first (the order backward produces their gradients), "
            "adding each one's bytes (four per float32 value, the biases too) to the current bucket, and "
            "close the bucket as soon as it has reached the cap")


# ---------------------------------------------------------------- 06.1 and 06.2 on every world size

#: the hint when 06.1's or 06.2's ranks hang
HANG_HINT = "the ranks hung: every rank must all-reduce the same gradients, in the same order"

_judge_average_gradients = by_plan(case_by_case(average_rank, [(n,) for n in WORLDS]), HANG_HINT)
_judge_hooks = by_plan(case_by_case(hooks_rank, [(n,) for n in WORLDS]), HANG_HINT)


EXERCISES = load_bank(__name__)
