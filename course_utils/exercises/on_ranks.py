"""Checks that run an answer on real ranks, through ``launch`` (notebooks 05, 08 and 10), so that
a wrong answer cannot hang the kernel.

Slow is not stuck: a check runs its ranks inside ``launcher.waiting.watching_stalls``, so they
count as hung when none of the unfinished ranks has used the CPU for ``STALL_S`` (5 s: each waits
for a peer, in a collective or a barrier), however long a busy machine takes to start and run
them; a rank that computes without end is stopped once it has used ``CPU_BUDGET_S`` of CPU, and
:data:`RANKS_LIMIT_S` of wall time is the last resort. Fresh-interpreter starts (macOS, Windows,
a GPU) spend their seconds of imports on the CPU, which counts as progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .time_limit import untimed

__all__ = ["RANKS_LIMIT_S", "RUNAWAY_HINT", "hint_from_ranks", "run_on_ranks"]

#: the wall-clock limit of a check's launch, a last resort (hangs and runaways are caught sooner)
RANKS_LIMIT_S = 90.0
#: the hint when the ranks kept computing without finishing
RUNAWAY_HINT = ("the ranks kept computing and did not finish: look for a loop that never ends, or "
                "far more work than the check needs")


def run_on_ranks(rank_fn: Callable[..., Any], world_size: int, *args: Any, hang_hint: str,
                 timeout_s: float = RANKS_LIMIT_S) -> tuple[list | None, str | None]:
    """Run an answer (or a judge's rank function) on real ranks for a check.

    Returns ``(results, None)``, or ``(None, hint)`` when the ranks hung (``hang_hint``), ran away
    (:data:`RUNAWAY_HINT`) or one raised (its first line). Checks run on gloo, on the CPU, on any
    machine: they judge the logic of an answer, so answer cells need no device code. The one way
    a judge launches ranks (notebooks 05, 08 and 10).
    """
    from ..distributed import LaunchTimeout, RankError, launch
    from ..launcher.waiting import watching_stalls

    try:
        with untimed(), watching_stalls():  # the ranks are judged on evidence, not the check's clock
            return launch(rank_fn, world_size, *args, echo=False, timeout_s=timeout_s, stacks=False,
                          backend="gloo"), None
    except LaunchTimeout as err:
        return None, hang_hint if getattr(err, "cause", "stalled") == "stalled" else RUNAWAY_HINT
    except RankError as err:
        first = (err.message.strip().splitlines() or [""])[0]
        return None, f"rank {err.rank} raised {err.exc_type}: {first}"


def hint_from_ranks(rank_fn: Callable[..., str | None], world_size: int, *args: Any,
                    hang_hint: str, timeout_s: float = RANKS_LIMIT_S) -> str | None:
    """Judge on real ranks with :func:`run_on_ranks`, where ``rank_fn`` returns each rank's hint
    (None when satisfied): the first hint, or the hang or error hint."""
    results, hint = run_on_ranks(rank_fn, world_size, *args, hang_hint=hang_hint, timeout_s=timeout_s)
    return hint if results is None else next((h for h in results if h is not None), None)
