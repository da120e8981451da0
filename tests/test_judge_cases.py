"""Every judge says which cases it tries: each bank module ``nbNN.py`` defines ``CASES``, exercise
key -> one short description per case, built from the list its judge iterates over. A judge of a
fix or an implement tries more than one case, so that a number written into an answer (a world
size, a scale, a batch size) cannot pass it.

The listing of every exercise's cases is printed by ``test_the_listing_names_every_exercise``
(``pytest -s``).
"""

import importlib

import pytest

from course_utils.exercises import bank, verdict
from course_utils.exercises.core import _banks, reference

#: the banks whose module must define CASES: a bank joins this set once its judges list their cases
#: (a bank outside it is reported as an expected failure while its module has no CASES)
LISTED = {f"{n:02d}" for n in range(13)}
#: the exercises whose judge runs the answer in this process (not on ranks): the check below counts
#: the calls the judge makes
IN_PROCESS = {"00", "01", "02", "03", "04", "08", "09", "11"}
ALL = bank("all")


def _cases(number: str):
    return getattr(importlib.import_module(f"course_utils.exercises.nb{number}"), "CASES", None)


def _require_cases(number: str) -> dict:
    cases = _cases(number)
    if cases is None:
        assert number not in LISTED, f"nb{number}.py defines no CASES, but its bank is in LISTED"
        pytest.xfail(f"nb{number}.py does not list its judges' cases yet (CASES); add {number!r} to LISTED "
                     "once it does")
    return cases


def test_every_bank_is_known_here():
    assert LISTED <= set(_banks()), sorted(LISTED - set(_banks()))
    assert set(_banks()) == {f"{n:02d}" for n in range(13)}, _banks()


@pytest.mark.parametrize("number", _banks())
def test_each_bank_lists_cases_for_its_exercises_only(number):
    cases = _require_cases(number)
    assert isinstance(cases, dict), type(cases)
    keys = [ex.key for ex in bank(number)]
    assert set(cases) <= set(keys), f"CASES names exercises the bank lacks: {sorted(set(cases) - set(keys))}"


@pytest.mark.parametrize("ex", ALL, ids=[ex.key for ex in ALL])
def test_every_judge_lists_its_cases_and_a_fix_or_implement_tries_several(ex):
    cases = _require_cases(ex.notebook)
    assert ex.key in cases, f"nb{ex.notebook}.py's CASES has no entry for {ex.key}"
    listed = cases[ex.key]
    assert isinstance(listed, list) and listed, listed
    assert all(isinstance(c, str) and c.strip() for c in listed), listed
    assert len(set(listed)) == len(listed), f"{ex.key} lists a case twice: {listed}"
    if ex.kind in ("fix", "implement"):
        assert len(listed) > 1, f"{ex.key} ({ex.kind}) tries one configuration only: {listed}"


_RUNS_ANSWER = [ex for ex in ALL if ex.kind != "predict" and ex.notebook in IN_PROCESS]


@pytest.mark.parametrize("ex", _RUNS_ANSWER, ids=[ex.key for ex in _RUNS_ANSWER])
def test_the_judge_runs_the_answer_once_per_listed_case_at_least(ex):
    """A listing longer than what the judge runs would claim cases it never tries."""
    solution = reference(ex.key)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return solution(*args, **kwargs)

    result = verdict(ex, counted)
    assert result.right, str(result)
    assert len(calls) >= len(_cases(ex.notebook)[ex.key]), (len(calls), _cases(ex.notebook)[ex.key])


def test_the_listing_names_every_exercise(capsys):
    lines = []
    for number in _banks():
        cases = _cases(number)
        for ex in bank(number):
            listed = cases.get(ex.key) if cases is not None else None
            lines.append(f"{ex.key} {ex.kind:<9} " + ("; ".join(listed) if listed else "(not listed yet)"))
    print("\n".join(lines))
    assert len(lines) == len(ALL)
    assert all(not line.endswith("(not listed yet)") for line in lines if line[:2] in LISTED)
