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
