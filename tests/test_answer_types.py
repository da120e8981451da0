"""Every prediction is read the same way however its numbers are written (exercises/answers.py):
the reference solution's value, each of its numbers written as an int or a float, a Fraction, a
Decimal, a NumPy scalar or a 0-d tensor, is right; True in the place of a number gets a hint.

The banks of notebooks 00, 01, 02, 03, 05 and 12; the value is what the solution's source defines,
run as tests/test_exercises.py runs it.
"""

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from course_utils.exercises import bank, verdict
from course_utils.exercises.answer_cells import _execute

BANKS = ("00", "01", "02", "03", "05", "12")
PREDICTIONS = [ex for nb in BANKS for ex in bank(nb) if ex.kind == "predict"]

#: how a learner may write a number x (NumPy's integer only for a whole x)
FORMS = {
    "int or float": lambda x: x,
    "float": float,
    "Fraction": lambda x: Fraction(str(x)),
    "Decimal": lambda x: Decimal(str(x)),
    "np.int64": lambda x: np.int64(x) if float(x).is_integer() else np.float64(x),
    "np.float32": np.float32,
    "np.float64": np.float64,
    "0-d tensor": torch.tensor,
    "0-d float tensor": lambda x: torch.tensor(float(x), dtype=torch.float64),
    "0-d array": np.array,
}


def _value(ex):
    return _execute(ex, ex.solution, "solution")[ex.answer]


def _numbers(value) -> int:
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(_numbers(v) for v in value)
    return int(isinstance(value, (int, float)) and not isinstance(value, bool))


def _written(value, form):
    """``value`` with every number in it written by ``form``, its containers kept."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(_written(v, form) for v in value)
    return form(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _first_number_true(value):
    """``value`` with its first number replaced by True."""
    done = False

    def swap(v):
        nonlocal done
        if isinstance(v, (list, tuple)):
            return type(v)(swap(x) for x in v)
        if not done and isinstance(v, (int, float)) and not isinstance(v, bool):
            done = True
            return True
        return v
    return swap(value)


NUMERIC = [ex for ex in PREDICTIONS if _numbers(_value(ex))]


def test_the_predictions_without_numbers_are_known():
    assert {ex.key for ex in PREDICTIONS} - {ex.key for ex in NUMERIC} == {"12.7", "12.10"}


@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
@pytest.mark.parametrize("ex", NUMERIC, ids=[ex.key for ex in NUMERIC])
def test_the_solution_is_right_however_its_numbers_are_written(ex, form):
    answer = _written(_value(ex), FORMS[form])
    result = verdict(ex, answer)
    assert result.status == "right", (answer, str(result))


@pytest.mark.parametrize("ex", NUMERIC, ids=[ex.key for ex in NUMERIC])
def test_true_is_not_a_number(ex):
    value = _value(ex)
    for answer in {repr(a): a for a in (True, _first_number_true(value))}.values():
        result = verdict(ex, answer)
        assert result.status == "not yet" and result.hint, (answer, str(result))
