"""Exercise 12.8's listed wrong answers get their hints, none of which gives the answer away, judged
together (see test_exercise_hints_nb12.py): a module of its own, because each answer's check waits
for rank 0's slow writes (0.3 s, then 2 s), so that pytest-xdist runs it beside the others."""

import pytest
from test_exercise_hints import answer_of
from test_exercise_hints_nb12 import SAVING, gets_its_hint, judged_together, the_other_hints_give_nothing_away

from course_utils.exercises import find, verdict

WRONG = [(key, i) for key in SAVING for i in range(len(find(key).wrong))]


@pytest.mark.parametrize("key, i", WRONG, ids=[f"{key}-wrong{i}" for key, i in WRONG])
def test_every_listed_wrong_answer_gets_its_hint(key, i):
    gets_its_hint(key, i, judged_together(key)[i])


@pytest.mark.parametrize("key", SAVING)
def test_no_other_hint_gives_the_answer_away(key):
    the_other_hints_give_nothing_away(key)


def test_a_sleep_that_outlasts_the_write_gets_the_hint_a_shorter_one_gets():
    """On a busy machine rank 1 can start its 1.5 s sleep late enough to read after rank 0's 2 s
    write: the timing then shows nothing wrong, and the hint comes from the missing collective. A
    sleep of 2.5 s stands in for that lag; its hint must still say what the 1.5 s answer's says."""
    source, fragment = next((src, hint) for src, hint in find("12.8").wrong if "time.sleep(1.5)" in src)
    assert fragment == "a sleep only guesses"
    result = verdict(find("12.8"), answer_of("12.8", source.replace("time.sleep(1.5)", "time.sleep(2.5)")))
    assert result.status == "not yet" and fragment in result.hint, str(result)
    assert "before rank 0 had written" not in result.hint, result.hint  # the timing showed nothing
