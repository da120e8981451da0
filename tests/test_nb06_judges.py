"""Notebook 06's judges: the watcher of 06.1 and 06.2 counts every way of waiting for an
all-reduce (so that a wait inside the backward pass is caught and one after it is recognised), and
06.3 reads any whole number and turns anything else into a hint, never an exception."""

import math
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from course_utils.distributed import launch
from course_utils.exercises import nb06
from course_utils.exercises.all_reduces import all_reduces_watched


def _waits(rank, world_size):
    """On each rank: how many times the watcher saw each all-reduce waited for, one way each."""
    import torch.distributed as dist

    def started():
        return dist.all_reduce(torch.ones(4), async_op=True)

    with all_reduces_watched() as reduced:
        dist.all_reduce(torch.ones(4))  # blocking: waits inside the call
        started().wait()
        started().get_future().wait()
        torch.futures.wait_all([started().get_future(), started().get_future()])
        handle = started()
        while not handle.is_completed():
            pass
        future = started().get_future()
        while not future.done():
            pass
        started().get_future().then(lambda f: f.value()).wait()
        never = started()
        seen_before_barrier = [r["waited"] for r in reduced]
    never.wait()
    dist.barrier()
    sent = [r["sent"].tolist() for r in reduced]
    return seen_before_barrier, sent


def test_every_way_of_waiting_counts_and_a_handle_never_waited_for_does_not():
    for waited, sent in launch(_waits, 2, echo=False):
        assert [bool(w) for w in waited] == [True] * 8 + [False], waited
        assert sent == [[1.0] * 4] * len(sent)


def _callback_chained_after_the_end(rank, world_size):
    """A callback chained to an all-reduce that has already finished runs at once, in this thread,
    possibly before the watcher's own callback (chained first, but run by the backend's thread,
    which waits for the GIL): here this thread keeps the GIL until it has chained its division."""
    import sys

    import torch.distributed as dist

    from course_utils.exercises.nb06_hints import written_in_flight

    interval, done = sys.getswitchinterval(), torch._C.Future.done  # done: as torch has it, unwatched
    with all_reduces_watched() as reduced:
        grad = torch.full((4,), float(rank + 1))
        sys.setswitchinterval(100.0)  # no other Python thread runs until this thread waits
        try:
            work = dist.all_reduce(grad, async_op=True)
            future, deadline = work.get_future(), time.monotonic() + 5
            while time.monotonic() < deadline and not done(future):
                pass  # spins with the GIL held: the all-reduce ends, its callbacks wait
            finished = done(future)
            chained = work.get_future().then(lambda f: f.value()[0].div_(world_size))
        finally:
            sys.setswitchinterval(interval)
        chained.wait()
    return finished, written_in_flight(reduced, world_size), grad.tolist()


def test_a_callback_chained_after_the_all_reduce_ended_is_no_race():
    for finished, raced, grad in launch(_callback_chained_after_the_end, 2, echo=False):
        assert finished and not raced and grad == [1.5] * 4


@pytest.mark.parametrize("answer", [(4, 2), [4.0, 2.0], (np.int64(4), np.float32(2)), torch.tensor([4, 2]),
                                    (torch.tensor(4), Fraction(2)), np.array([4, 2])])
def test_06_3_accepts_any_pair_of_whole_numbers(answer):
    assert nb06._judge_bucket_count(answer) is None


NOT_COUNTS = [4, (4,), (4, 2, 1), (float("inf"), 2), (-math.inf, 2), (math.nan, 2), (4.5, 2), ("4", "2"),
              None, [[4, 2]], (True, 2), (np.True_, 2), torch.tensor([[4, 2]]), (4 + 0j, 2), (10**400, 2),
              (1e300, 2), (-3, 2), (Fraction(10**400, 3), 2), "42"]


@pytest.mark.parametrize("answer", NOT_COUNTS, ids=repr)
def test_06_3_answers_anything_else_with_a_hint(answer):
    hint = nb06._judge_bucket_count(answer)
    assert isinstance(hint, str) and hint, (answer, hint)


def test_06_3_asks_caps_where_every_look_alike_rule_parts_from_ddps():
    """At each cap, some look-alike rule gives DDP's count (at 0.75 MiB two of them give 4); over the
    two caps every rule's pair differs from the right one, and each gets its own hint."""
    from course_utils.ddp.buckets import assign_buckets
    from course_utils.ddp.by_hand_timing import comm_heavy_model

    params = list(comm_heavy_model(nb06.BUCKET_WIDTH).parameters())
    right = tuple(len(assign_buckets(params, cap)) for cap in nb06.BUCKET_CAPS_MB)
    rules = [nb06.look_alike_rules(params, cap) for cap in nb06.BUCKET_CAPS_MB]
    pairs = {name: tuple(r[name] for r in rules) for name in rules[0]}
    assert any(pair[0] == right[0] for pair in pairs.values())  # the lesson's size alone cannot tell
    for name, pair in pairs.items():
        assert pair != right, name
        assert nb06._judge_bucket_count(pair) is not None, name
