"""Notebook 11's listed wrong answers get their hints, and none of its hints gives the answer away:
the tests of test_exercise_hints.py, on the exercises it leaves to this module, so that
pytest-xdist runs them beside the others.

The checks of 11.1, 11.3, 11.4, 11.5 and 11.8 run ranks. Their listed answers are judged together
(``nb11.verdicts``: one launch per world size, one answer after another, as each would be judged
alone), except those whose ranks hang: a hang is always judged in a launch of its own (in a batch
it would be judged twice, where the batch stops and then alone). Each answer's hint is still
checked on its own.
"""

import functools

import pytest
from test_exercise_hints import (
    ALL,
    ON_A_WORKER_OF_THEIR_OWN,
    _leak,
    every_listed_wrong_answer_gets_its_hint,
    no_hint_gives_the_answer_away,
)

from course_utils.exercises import find, nb11, verdict
from course_utils.exercises.answer_cells import _execute

THESE = [ex for ex in ALL if ex.notebook == ON_A_WORKER_OF_THEIR_OWN]
ON_RANKS = [ex for ex in THESE if ex.key in nb11.PLANS]
IN_PROCESS = [ex for ex in THESE if ex.key not in nb11.PLANS]
#: the listed wrong answers (exercise, index in its `wrong` list) whose ranks hang
HANG = {("11.1", 0), ("11.3", 0), ("11.3", 3), ("11.4", 0)}
WRONG = [(ex.key, i) for ex in ON_RANKS for i in range(len(ex.wrong))]


def _answer(key: str, source: str):
    ex = find(key)
    return _execute(ex, source, "answer")[ex.answer]


def returns_none(*args, **kwargs):  # the probe of test_exercise_hints._hints: a function that returns None
    return None


@functools.cache
def judged_together(key: str) -> tuple:
    """The verdicts of every listed wrong answer of ``key`` and of ``returns_none``, in that order:
    those that hang alone, the others together."""
    ex = find(key)
    answers = [_answer(key, source) for source, _ in ex.wrong] + [returns_none]
    together = [i for i in range(len(answers)) if (key, i) not in HANG]
    got = dict(zip(together, nb11.verdicts(key, [answers[i] for i in together]), strict=True))
    got.update({i: verdict(ex, answers[i]) for i in range(len(answers)) if i not in got})
    return tuple(got[i] for i in range(len(answers)))


def test_this_module_and_test_exercise_hints_cover_every_exercise_once():
    import test_exercise_hints

    assert THESE and sorted(ex.key for ex in THESE + test_exercise_hints.HERE) == sorted(ex.key for ex in ALL)
    assert {ex.key for ex in ON_RANKS} == set(nb11.PLANS) == {"11.1", "11.3", "11.4", "11.5", "11.8"}


@pytest.mark.parametrize("key, i", WRONG, ids=[f"{key}-wrong{i}" for key, i in WRONG])
def test_every_listed_wrong_answer_on_ranks_gets_its_hint(key, i):
    source, fragment = find(key).wrong[i]
    result = judged_together(key)[i]
    assert result.status == "not yet", (source, str(result))
    assert fragment in result.hint, (source, str(result))
    assert result.hint.startswith(nb11.HANG_HINT) == ((key, i) in HANG), (
        "HANG lists the answers whose ranks hang, and only those", str(result))


@pytest.mark.parametrize("ex", ON_RANKS, ids=[ex.key for ex in ON_RANKS])
def test_no_hint_on_ranks_gives_the_answer_away(ex):
    hints = [(source, r.hint) for (source, _), r in zip(ex.wrong, judged_together(ex.key), strict=False)]
    hints += [("a function that returns None", judged_together(ex.key)[-1].hint),
              ("the starter", verdict(ex, _answer(ex.key, ex.starter)).hint)]
    leaks = [f"{answer!r} -> {hint!r}: {why}" for answer, hint in hints if (why := _leak(ex, None, hint))]
    assert not leaks, "\n".join(leaks)


@pytest.mark.parametrize("ex", IN_PROCESS, ids=[ex.key for ex in IN_PROCESS])
def test_every_listed_wrong_answer_gets_its_hint(ex):
    every_listed_wrong_answer_gets_its_hint(ex)


@pytest.mark.parametrize("ex", IN_PROCESS, ids=[ex.key for ex in IN_PROCESS])
def test_no_hint_gives_the_answer_away(ex):
    no_hint_gives_the_answer_away(ex)


# ------------------------------------------------------------ judged together is judged alone

KILLS_RANK_1 = '''
import os

from torch import full, ones
from torch.distributed import all_reduce, broadcast


def sync_step(rank, world_size):
    grads, flag = ones(4), full((1,), float(rank))
    all_reduce(grads)
    if rank == 1:
        os._exit(3)  # dies before the broadcast: rank 0 waits in it alone
    broadcast(flag, 0)
    return grads.tolist(), flag.item()
'''
RAISES_ON_RANK_1 = '''
from torch import full, ones
from torch.distributed import all_reduce, broadcast


def sync_step(rank, world_size):
    grads, flag = ones(4), full((1,), float(rank))
    all_reduce(grads)
    broadcast(flag, 0)
    if rank == world_size - 1:
        raise ValueError("the last rank gives up")
    return grads.tolist(), flag.item()
'''


def test_answers_judged_together_get_what_each_gets_alone():
    """An answer that kills its rank, and one that raises on one rank, between answers that run to
    the end: each gets what a launch of its own gives it, and the others are not disturbed."""
    ex = find("11.3")
    sources = [ex.solution, KILLS_RANK_1, ex.wrong[2][0], RAISES_ON_RANK_1, ex.also_right[0], ex.wrong[1][0]]
    answers = [_answer("11.3", source) for source in sources]
    together = nb11.verdicts("11.3", answers)
    alone = [verdict(ex, answer) for answer in answers]
    assert [str(v) for v in together] == [str(v) for v in alone]
    assert [v.status for v in together] == ["right", "not yet", "not yet", "not yet", "right", "not yet"]
    assert "rank 1" in together[1].hint and "ValueError" in together[3].hint, (together[1], together[3])


@pytest.mark.stress  # two stalls (the batch's, then the hang's own launch): `make stress`
def test_a_hang_in_a_batch_is_judged_alone_and_the_answers_after_it_still_run():
    """A hang stops the batch where it is (as a killed rank does, in `make test` above)."""
    ex = find("11.3")
    answers = [_answer("11.3", s) for s in (ex.wrong[2][0], ex.wrong[3][0], ex.solution)]
    got = nb11.verdicts("11.3", answers)
    assert [v.status for v in got] == ["not yet", "not yet", "right"]
    assert got[1].hint.startswith(nb11.HANG_HINT) and ex.wrong[2][1] in got[0].hint
