"""Notebook 12's listed wrong answers get their hints, and none of its hints gives the answer away:
the tests of test_exercise_hints.py, on the exercises it leaves to this module and to two more,
so that pytest-xdist runs them beside the others and beside one another (each module stays on
one worker).

The checks of 12.1, 12.3, 12.4, 12.5 and 12.8 run ranks. Their listed answers are judged together
(``together.verdicts``: one launch per world size, one answer after another, each as it would be
judged alone), except those whose ranks hang: a hang is judged in a launch of its own, in
test_exercise_hints_nb12_hangs.py (in a batch it would be judged twice, where the batch stops and
then alone). 12.8's answers, whose checks wait for a slow write, are judged in
test_exercise_hints_nb12_saving.py. Each answer's hint is checked on its own.
"""

import functools

import pytest
from test_exercise_hints import (
    ALL,
    ON_A_WORKER_OF_THEIR_OWN,
    _leak,
    answer_of,
    every_listed_wrong_answer_gets_its_hint,
    no_hint_gives_the_answer_away,
    returns_none,
)

from course_utils.exercises import find, nb12, verdict
from course_utils.exercises.together import judged_by_plan, verdicts

THESE = [ex for ex in ALL if ex.notebook == ON_A_WORKER_OF_THEIR_OWN]
ON_RANKS = [ex for ex in THESE if ex.key in nb12.PLANS]
IN_PROCESS = [ex for ex in THESE if ex.key not in nb12.PLANS]
#: the listed wrong answers (exercise, index in its `wrong` list) whose ranks hang
HANG = {("12.1", 0), ("12.3", 0), ("12.3", 3), ("12.4", 0)}
#: the rank exercises whose answers are judged in test_exercise_hints_nb12_saving.py
SAVING = ("12.8",)
#: the listed wrong answers judged together here
HERE = [(ex.key, i) for ex in ON_RANKS if ex.key not in SAVING for i in range(len(ex.wrong))
        if (ex.key, i) not in HANG]


@functools.cache
def judged_together(key: str) -> dict:
    """The verdicts of the listed wrong answers of ``key`` that do not hang, by their index, and of
    ``returns_none`` (under the index after the last), judged together."""
    ex = find(key)
    indices = [i for i in range(len(ex.wrong)) if (key, i) not in HANG]
    answers = [answer_of(key, ex.wrong[i][0]) for i in indices] + [returns_none]
    return dict(zip([*indices, len(ex.wrong)], verdicts(key, answers), strict=True))


def gets_its_hint(key: str, i: int, result) -> None:
    """Wrong answer ``i`` of ``key`` got ``result``: its hint, which gives nothing away, and a hang
    exactly where HANG says."""
    source, fragment = find(key).wrong[i]
    assert result.status == "not yet", (source, str(result))
    assert fragment in result.hint, (source, str(result))
    assert result.hint.startswith(nb12.HANG_HINT) == ((key, i) in HANG), (
        "HANG lists the answers whose ranks hang, and only those", str(result))
    assert not (why := _leak(find(key), None, result.hint)), (source, result.hint, why)


def the_other_hints_give_nothing_away(key: str) -> None:
    """The hints of ``returns_none`` and of the starter give nothing away."""
    ex = find(key)
    for answer, hint in (("a function that returns None", judged_together(key)[len(ex.wrong)].hint),
                         ("the starter", verdict(ex, answer_of(key, ex.starter)).hint)):
        assert not (why := _leak(ex, None, hint)), (answer, hint, why)


def test_this_module_and_the_others_cover_every_exercise_and_answer_once():
    import test_exercise_hints

    assert THESE and sorted(ex.key for ex in THESE + test_exercise_hints.HERE) == sorted(ex.key for ex in ALL)
    assert {ex.key for ex in ON_RANKS} == set(nb12.PLANS) == {"12.1", "12.3", "12.4", "12.5", "12.8"}
    assert sorted(ex.key for ex in PLANNED) == ["05.4", "06.1", "06.2", "07.3", "10.2", "10.3", *nb12.PLANS]
    saving = [(key, i) for key in SAVING for i in range(len(find(key).wrong))]
    every = [(ex.key, i) for ex in ON_RANKS for i in range(len(ex.wrong))]
    assert sorted(HERE + saving + sorted(HANG)) == sorted(every)
    assert not HANG & set(saving)


@pytest.mark.parametrize("key, i", HERE, ids=[f"{key}-wrong{i}" for key, i in HERE])
def test_every_listed_wrong_answer_on_ranks_gets_its_hint(key, i):
    gets_its_hint(key, i, judged_together(key)[i])


@pytest.mark.parametrize("key", [ex.key for ex in ON_RANKS if ex.key not in SAVING])
def test_no_other_hint_on_ranks_gives_the_answer_away(key):
    the_other_hints_give_nothing_away(key)


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

#: returns on every rank, rank 0 from a barrier that only a launch's teardown (or the batch's barrier
#: after an item) matches; rank 0 is then left in the barrier after it
LEAVES_RANK_0_IN_A_BARRIER = '''
from torch import full, ones
from torch.distributed import all_reduce, barrier, broadcast


def sync_step(rank, world_size):
    grads, flag = ones(4), full((1,), float(rank))
    all_reduce(grads)
    broadcast(flag, 0)
    if rank == 0:
        barrier()
    return grads.tolist(), flag.item()
'''


def test_answers_judged_together_get_what_each_gets_alone():
    """An answer that kills its rank, one that raises on one rank and one that leaves a rank in a
    barrier, between answers that run to the end: each gets what a launch of its own gives it, and
    the others are not disturbed."""
    ex = find("12.3")
    sources = [ex.solution, KILLS_RANK_1, ex.wrong[2][0], RAISES_ON_RANK_1, ex.also_right[0],
               LEAVES_RANK_0_IN_A_BARRIER, ex.wrong[1][0]]
    answers = [answer_of("12.3", source) for source in sources]
    together = verdicts("12.3", answers)
    alone = [verdict(ex, answer) for answer in answers]
    assert [str(v) for v in together] == [str(v) for v in alone]
    assert [v.status for v in together] == ["right", "not yet", "not yet", "not yet", "right", "right",
                                            "not yet"]
    assert "rank 1" in together[1].hint and "ValueError" in together[3].hint, (together[1], together[3])


@pytest.mark.stress  # two stalls (the batch's, then the hang's own launch): `make stress`
def test_a_hang_in_a_batch_is_judged_alone_and_the_answers_after_it_still_run():
    """A hang stops the batch where it is (as a killed rank does, in `make test` above)."""
    ex = find("12.3")
    answers = [answer_of("12.3", s) for s in (ex.wrong[2][0], ex.wrong[3][0], ex.solution)]
    got = verdicts("12.3", answers)
    assert [v.status for v in got] == ["not yet", "not yet", "right"]
    assert got[1].hint.startswith(nb12.HANG_HINT) and ex.wrong[2][1] in got[0].hint


PLANNED = [ex for ex in ALL if judged_by_plan(ex.key)]


@pytest.mark.stress  # every answer judged alone, launch after launch: `make stress`
@pytest.mark.parametrize("ex", PLANNED, ids=[ex.key for ex in PLANNED])
def test_every_listed_answer_judged_alone_gets_what_make_test_asserts_of_it(ex):
    """make test judges the listed answers of the checks that run plans on ranks together (the also
    right ones in test_exercises.py, the wrong ones here and in test_exercise_hints.py). A learner's
    check judges an answer alone: so judged, the reference solution and every also-right answer are
    right, and every wrong one gets its hint. Left out: the wrong answers whose ranks hang (judged
    alone in make test too), and 12.8's, each of whose checks waits for slow writes (40 s in all;
    judged together since notebook 12's checks first ran plans)."""
    for source in (ex.solution, *ex.also_right):
        result = verdict(ex, answer_of(ex.key, source))
        assert result.right, (source, str(result))
    for i, (source, fragment) in enumerate(ex.wrong):
        if (ex.key, i) not in HANG and ex.key not in SAVING:
            result = verdict(ex, answer_of(ex.key, source))
            assert result.status == "not yet" and fragment in result.hint, (source, str(result))
