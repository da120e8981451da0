"""Every judge reads a number the same way: however a learner writes it (exercises/answers.py)."""

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from course_utils.exercises.answers import real, reals, whole

FOUR = [4, 4.0, Fraction(8, 2), Decimal("4"), np.int64(4), np.int32(4), np.float32(4.0), np.float64(4.0),
        torch.tensor(4), torch.tensor(4.0), torch.tensor(4, dtype=torch.int16), np.array(4), np.array(4.0)]
NOT_NUMBERS = [True, False, np.bool_(True), torch.tensor(True), "4", b"4", None, [4], (4,), {4}, 4 + 0j,
               torch.tensor([4]), np.array([4.0]), torch.ones(2), ..., object()]


def _id(value):
    """A test id that is the same in every process (no address of an object in it)."""
    return type(value).__name__ if type(value) is object else repr(value)


@pytest.mark.parametrize("answer", FOUR, ids=_id)
def test_four_is_four_however_written(answer):
    assert real(answer) == 4.0 and isinstance(real(answer), float)
    assert whole(answer) == 4 and type(whole(answer)) is int


@pytest.mark.parametrize("answer", NOT_NUMBERS, ids=_id)
def test_what_is_not_one_number_is_none(answer):
    assert real(answer) is None
    assert whole(answer) is None


@pytest.mark.parametrize("answer", [4.5, Fraction(9, 2), Decimal("4.5"), np.float32(4.5), torch.tensor(4.5),
                                    float("nan"), float("inf"), -0.25])
def test_a_number_that_is_not_whole_is_real_but_not_whole(answer):
    assert real(answer) is not None
    assert whole(answer) is None


def test_zero_is_a_number_not_an_absence():
    for zero in (0, 0.0, Fraction(0), np.int64(0), torch.tensor(0.0)):
        assert real(zero) == 0.0 and whole(zero) == 0


def test_sequences_of_numbers():
    assert reals([1, Fraction(1, 2), np.float32(0.25)]) == [1.0, 0.5, 0.25]
    assert reals(torch.tensor([1.0, 2.0]), length=2) == [1.0, 2.0]
    assert reals(np.array([3, 4])) == [3.0, 4.0]
    assert reals([1, 2], length=3) is None
    assert reals([1, "2"]) is None and reals("12") is None and reals(5) is None and reals([True, 1]) is None
