"""A check leaves the learner's random generators where they were: judges seed what they draw
(``torch.manual_seed(0)`` in those of exercises 03.1 and 12.6, all three generators in 12.9's), and
without ``env.random_state_kept`` a learner's next ``torch.randn`` would depend on having run a
check."""

import contextlib
import random

import numpy as np
import pytest
import torch

from course_utils import env
from course_utils.exercises import core, find, run_source


def _states():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def _same(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


def test_the_generators_come_back_after_seeding_and_drawing_and_after_an_error():
    torch.manual_seed(5)
    before = _states()
    with env.random_state_kept():
        env.seed_everything(0)
        torch.randn(3), np.random.rand(), random.random()
    assert _same(_states(), before)
    with pytest.raises(ZeroDivisionError), env.random_state_kept():
        torch.manual_seed(1)
        _ = 1 / 0
    assert _same(_states(), before)
    after = torch.randn(4)
    torch.manual_seed(5)
    assert torch.equal(after, torch.randn(4))  # the stream goes on from where it was


def _draws():
    return random.random(), np.random.rand(), torch.randn(5)


def _seed_all():
    random.seed(7), np.random.seed(7), torch.manual_seed(7)


def _same_draws(a, b):
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


@pytest.mark.parametrize("key", ["03.1", "12.6", "12.9"])  # 12.9's judge seeds Python's, NumPy's and torch's
def test_a_check_whose_judge_seeds_leaves_the_learners_draws_as_they_were(key, monkeypatch):
    solution = find(key).solution
    _seed_all()
    expected = _draws()
    _seed_all()
    assert run_source(key, solution).right
    assert _same_draws(_draws(), expected), "the check moved the learner's generators"

    # the judge does seed: without the guard, the learner's next draws change
    monkeypatch.setattr(core, "random_state_kept", contextlib.nullcontext)
    _seed_all()
    assert run_source(key, solution).right
    assert not _same_draws(_draws(), expected)


def _queued_for_the_gpus():
    """What CUDA would apply to the GPU generators when it starts: the seeds torch.cuda tracks and
    its queued calls of torch.cuda.random (by identity)."""
    calls = [id(e) for e in torch.cuda._queued_calls
             if getattr(e[0], "__module__", None) == "torch.cuda.random"]
    return [id(c) for c in torch.cuda._lazy_seed_tracker.call_order], calls


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="CUDA has started in this process: nothing is queued")
def test_what_a_check_queues_for_the_gpus_before_cuda_starts_is_taken_back(monkeypatch):
    """torch.manual_seed queues a seed for every GPU until CUDA starts, even on a machine without
    one: a judge's seed would be what the learner's GPUs start from."""
    torch.manual_seed(7)  # the learner's
    learners = _queued_for_the_gpus()
    assert any(learners[0])
    assert run_source("03.1", find("03.1").solution).right
    assert _queued_for_the_gpus() == learners
    monkeypatch.setattr(core, "random_state_kept", contextlib.nullcontext)
    assert run_source("03.1", find("03.1").solution).right
    assert _queued_for_the_gpus()[0] != learners[0]  # the judge's seed is queued in its place


def test_if_cuda_starts_inside_every_gpu_generator_starts_again_then_the_learners_queue_applies(monkeypatch):
    """Without a GPU, with stand-ins for CUDA's start and for the learner's queued calls
    (tests/test_gpu.py compares draws on a real GPU)."""
    applied = []

    def queued(name):
        def call():
            applied.append(name)

        call.__module__ = "torch.cuda.random"
        return call, []

    monkeypatch.setattr(torch.cuda._lazy_seed_tracker, "call_order", [None, queued("the learner's seed")])
    monkeypatch.setattr(torch.cuda, "_queued_calls", [queued("the learner's state"), (object, [])])
    started = iter([False, True])  # not when the check begins; by the time it ends
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: next(started))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", applied.append)
    with env.random_state_kept():
        pass
    assert applied == [torch.Generator().initial_seed(), "the learner's state", "the learner's seed"]
