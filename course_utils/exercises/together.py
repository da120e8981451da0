"""Judges that run the answer on ranks by a *plan* (:data:`.on_ranks.Plan`), and many answers to one
such exercise judged in few launches.

A plan is a generator: it yields each launch it needs, ``(rank_fn, world_size, *args)``, is sent
what came back, ``(results, hint)`` as :func:`.on_ranks.run_on_ranks` returns it, and returns its
hint (None: right). A learner's check runs the plan of one answer, each launch on ranks of its own
(:func:`.on_ranks.run_plan`). :func:`verdicts` runs the plans of many answers at once
(:func:`.on_ranks.run_plans`): what they ask of one rank function and world size runs in one launch,
answer after answer, and an answer that raises, hangs or kills a rank is judged again alone. The
tests judge every listed answer of these exercises so (notebooks 05, 06, 07, 10 and 12).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .answer_cells import _unattempted
from .core import Exercise, Verdict, answer_defined, find, run_source, verdict
from .on_ranks import Plan, run_plan, run_plans

__all__ = ["by_plan", "case_by_case", "first_hint", "judged_by_plan", "run_sources", "verdicts"]


def by_plan(plan_of: Callable[[Any], Plan], hang_hint: str) -> Callable[[Any], str | None]:
    """The judge that runs ``plan_of(answer)``, each launch on ranks of its own; ``hang_hint`` is
    the hint when the ranks hang. It keeps both, for :func:`verdicts`."""
    def judge(answer: Any) -> str | None:
        return run_plan(plan_of(answer), hang_hint)
    judge.plan_of = plan_of  # type: ignore[attr-defined]
    judge.hang_hint = hang_hint  # type: ignore[attr-defined]
    return judge


def first_hint(results: list | None, hint: str | None) -> str | None:
    """What a launch of rank functions that each return a hint (None when satisfied) says: the
    hang or error hint, else the first hint a rank returned."""
    return hint if results is None else next((h for h in results if h is not None), None)


def case_by_case(rank_fn: Callable[..., str | None], cases: list[tuple]) -> Callable[[Any], Plan]:
    """The plan of a check whose ``rank_fn`` returns each rank's hint: for each case
    ``(world_size, *args)`` in turn, ``rank_fn(rank, world_size, answer, *args)`` on that many ranks,
    up to the first hint (:func:`first_hint`)."""
    def plan(answer: Any) -> Plan:
        for world_size, *args in cases:
            hint = first_hint(*(yield (rank_fn, world_size, answer, *args)))
            if hint is not None:
                return hint
        return None
    return plan


def judged_by_plan(key: str) -> bool:
    """Whether exercise ``key``'s judge runs a plan (and so :func:`verdicts` can judge its answers)."""
    return hasattr(find(key).judge, "plan_of")


def verdicts(key: str, answers: list) -> list[Verdict]:
    """What :func:`~course_utils.exercises.verdict` says of each answer to exercise ``key``, whose
    judge runs a plan (:func:`by_plan`), judged in few launches."""
    ex = find(key)
    if not judged_by_plan(key):
        raise ValueError(f"exercise {key}'s judge runs no plan on ranks: judge its answers one by one")
    judge = ex.judge
    judged = [callable(a) and not _unattempted(ex, a) for a in answers]
    outcomes = iter(run_plans([judge.plan_of(a) for a, j in zip(answers, judged, strict=True) if j],
                              judge.hang_hint))

    def replay(outcome: Any) -> Exercise:
        def judge(answer: Any) -> str | None:
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        return dataclasses.replace(ex, judge=judge)
    return [verdict(replay(next(outcomes)) if j else ex, a) for a, j in zip(answers, judged, strict=True)]


def run_sources(key: str, sources: list[str]) -> list[Verdict]:
    """:func:`~course_utils.exercises.run_source` of each answer cell source to exercise ``key``:
    judged together (:func:`verdicts`) where its judge runs a plan, else one by one."""
    if not judged_by_plan(key):
        return [run_source(key, src) for src in sources]
    ex = find(key)
    return verdicts(key, [answer_defined(ex, src) for src in sources])
