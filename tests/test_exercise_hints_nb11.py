"""Notebook 11's listed wrong answers get their hints, and none of its hints gives the answer away:
the tests of test_exercise_hints.py, on the exercises it leaves to this module (their checks run
ranks, several launches an answer), so that pytest-xdist runs them beside the others."""

import pytest
from test_exercise_hints import (
    ALL,
    ON_A_WORKER_OF_THEIR_OWN,
    every_listed_wrong_answer_gets_its_hint,
    no_hint_gives_the_answer_away,
)

THESE = [ex for ex in ALL if ex.notebook == ON_A_WORKER_OF_THEIR_OWN]


def test_this_module_and_test_exercise_hints_cover_every_exercise_once():
    import test_exercise_hints

    assert THESE and sorted(ex.key for ex in THESE + test_exercise_hints.HERE) == sorted(ex.key for ex in ALL)


@pytest.mark.parametrize("ex", THESE, ids=[ex.key for ex in THESE])
def test_every_listed_wrong_answer_gets_its_hint(ex):
    every_listed_wrong_answer_gets_its_hint(ex)


@pytest.mark.parametrize("ex", THESE, ids=[ex.key for ex in THESE])
def test_no_hint_gives_the_answer_away(ex):
    no_hint_gives_the_answer_away(ex)
