"""Notebook 12's listed wrong answers whose ranks hang get their hints, none of which gives the
answer away: each judged in a launch of its own, as a check judges it (see
test_exercise_hints_nb12.py). A module of its own: each hang takes its stall window (about 8 s, in
which the ranks use no CPU), so that pytest-xdist runs it beside the others."""

import pytest
from test_exercise_hints_nb12 import HANG, answer_of, gets_its_hint

from course_utils.exercises import find, verdict

HANGING = sorted(HANG)


@pytest.mark.parametrize("key, i", HANGING, ids=[f"{key}-wrong{i}" for key, i in HANGING])
def test_a_wrong_answer_that_hangs_gets_its_hint_alone(key, i):
    ex = find(key)
    gets_its_hint(key, i, verdict(ex, answer_of(key, ex.wrong[i][0])))
