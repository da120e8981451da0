"""Exercise 12.8's listed wrong answers get their hints, none of which gives the answer away, judged
together (see test_exercise_hints_nb12.py): a module of its own, because each answer's check waits
for rank 0's slow writes (0.3 s, then 2 s), so that pytest-xdist runs it beside the others."""

import pytest
from test_exercise_hints_nb12 import SAVING, gets_its_hint, judged_together, the_other_hints_give_nothing_away

from course_utils.exercises import find

WRONG = [(key, i) for key in SAVING for i in range(len(find(key).wrong))]


@pytest.mark.parametrize("key, i", WRONG, ids=[f"{key}-wrong{i}" for key, i in WRONG])
def test_every_listed_wrong_answer_gets_its_hint(key, i):
    gets_its_hint(key, i, judged_together(key)[i])


@pytest.mark.parametrize("key", SAVING)
def test_no_other_hint_gives_the_answer_away(key):
    the_other_hints_give_nothing_away(key)
