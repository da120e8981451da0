"""Checks that run an answer on real ranks, through ``launch`` with a timeout (notebooks 05, 08
and 10), so that a wrong answer cannot hang the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .time_limit import untimed

__all__ = ["hint_from_ranks", "run_on_ranks"]


def run_on_ranks(rank_fn: Callable[..., Any], world_size: int, *args: Any, hang_hint: str,
                 timeout_s: float = 60.0) -> tuple[list | None, str | None]:
    """Run an answer (or a judge's rank function) on real ranks for a check.

    Returns ``(results, None)``, or ``(None, hint)`` when the ranks hung (``hang_hint``) or one
    raised (its first line). Checks run on gloo, on the CPU, on any machine: they judge the logic
    of an answer, so answer cells need no device code. The one way a judge launches ranks
    (notebooks 05, 08 and 10).
    """
    from ..distributed import LaunchTimeout, RankError, launch

    try:
        with untimed():  # the ranks have the launch timeout
            return launch(rank_fn, world_size, *args, echo=False, timeout_s=timeout_s, stacks=False,
                          backend="gloo"), None
    except LaunchTimeout:
        return None, hang_hint
    except RankError as err:
        first = (err.message.strip().splitlines() or [""])[0]
        return None, f"rank {err.rank} raised {err.exc_type}: {first}"


def hint_from_ranks(rank_fn: Callable[..., str | None], world_size: int, *args: Any,
                    hang_hint: str, timeout_s: float = 60.0) -> str | None:
    """Judge on real ranks with :func:`run_on_ranks`, where ``rank_fn`` returns each rank's hint
    (None when satisfied): the first hint, or the hang or error hint."""
    results, hint = run_on_ranks(rank_fn, world_size, *args, hang_hint=hang_hint, timeout_s=timeout_s)
    return hint if results is None else next((h for h in results if h is not None), None)
