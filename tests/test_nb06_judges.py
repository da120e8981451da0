"""Notebook 06's judges: the watcher of 06.1 and 06.2 counts every way of waiting for an
all-reduce (so that a wait inside the backward pass is caught and one after it is recognised), and
06.3 reads any whole number and turns anything else into a hint, never an exception."""

import math
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


@pytest.mark.parametrize("answer", [4, 4.0, np.int64(4), np.float32(4), torch.tensor(4), torch.tensor(4.0)])
def test_06_3_accepts_any_whole_number(answer):
    assert nb06._judge_bucket_count(answer) is None


NOT_A_COUNT = [float("inf"), -math.inf, math.nan, np.float64("inf"), 4.5, "4", None, [4], True, np.True_,
               torch.tensor(True), torch.tensor([4, 4]), 4 + 0j, 10**400, 1e300, -3, Fraction(10**400, 3)]


@pytest.mark.parametrize("answer", NOT_A_COUNT)
def test_06_3_answers_anything_else_with_a_hint(answer):
    hint = nb06._judge_bucket_count(answer)
    assert isinstance(hint, str) and hint, (answer, hint)


def test_06_3_asks_a_cap_whose_mistakes_all_differ():
    """The right count and the counts of the usual mistakes are six different numbers."""
    from course_utils.ddp.by_hand import assign_buckets
    from course_utils.ddp.by_hand_timing import comm_heavy_model

    params = list(comm_heavy_model(nb06.BUCKET_WIDTH).parameters())
    cap = nb06.BUCKET_CAP_MB * 2**20
    total = sum(p.numel() * p.element_size() for p in params)
    counts = {"right": len(assign_buckets(params, nb06.BUCKET_CAP_MB)), "per parameter": len(params),
              "per layer": sum(p.dim() == 2 for p in params),
              "never past the cap": nb06._old_rule_count(params, cap),
              "size / cap, rounded up": math.ceil(total / cap), "one": 1}
    assert len(set(counts.values())) == len(counts), counts
