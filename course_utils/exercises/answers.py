"""Numbers as a learner may write them, read the same way by every judge.

A prediction can be written ``4``, ``4.0``, ``Fraction(8, 2)``, ``np.int64(4)``, ``np.float32(4)``,
``Decimal("4")`` or ``torch.tensor(4)`` (a 0-d tensor or array, the result of a computation); all
of them are the number 4. ``True`` is not a number here (it is ``1`` to Python, never what a
learner meant), nor is a string, a complex number, a list or a tensor of more than one value.

:func:`real` reads one real number, :func:`whole` one whole number (``4.0`` is 4, ``4.5`` is
none), :func:`reals` a sequence of them; each returns None for anything else, and the judge gives
its hint (:data:`NOT_A_NUMBER` says what a number is).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

__all__ = ["NOT_A_NUMBER", "real", "reals", "whole"]

#: the end of a hint for an answer that is not a number at all
NOT_A_NUMBER = "write a number (an int, a float, a fraction; a 0-d tensor is fine), not text or a list"


def _scalar(answer: Any) -> Any:
    """A 0-d tensor or NumPy array as the Python number it holds; anything else unchanged."""
    if type(answer).__module__.split(".")[0] in ("torch", "numpy") and getattr(answer, "ndim", None) == 0:
        try:
            return answer.item()
        except (TypeError, ValueError, RuntimeError):
            return answer
    return answer


def real(answer: Any) -> float | None:
    """``answer`` as a float when it is one real number (see the module), else None. NaN and
    infinities are numbers here: the judge decides what they mean."""
    value = _scalar(answer)
    if isinstance(value, bool) or (hasattr(value, "dtype") and str(getattr(value, "dtype", "")) == "bool"):
        return None
    if isinstance(value, (numbers.Real, Decimal)) and not isinstance(value, complex):
        try:
            return float(value)
        except (TypeError, ValueError, OverflowError):
            return None
    return None


def whole(answer: Any) -> int | None:
    """``answer`` as an int when it is one whole number, however written (``4``, ``4.0``,
    ``Fraction(8, 2)``, ``np.int64(4)``, a 0-d tensor holding 4), else None."""
    value = _scalar(answer)
    if isinstance(value, bool) or real(value) is None:
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    exact = Fraction(value) if isinstance(value, (numbers.Rational, Decimal)) else None
    if exact is not None:
        return int(exact) if exact.denominator == 1 else None
    number = float(value)
    return int(number) if math.isfinite(number) and number.is_integer() else None


def reals(answer: Any, length: int | None = None) -> list[float] | None:
    """``answer`` as a list of floats when it is a sequence of real numbers (a list, a tuple, a
    1-d tensor or array), of ``length`` of them if given; else None."""
    if hasattr(answer, "tolist") and getattr(answer, "ndim", None) == 1:
        answer = answer.tolist()
    if isinstance(answer, (str, bytes)) or not isinstance(answer, Sequence):
        return None
    values = [real(v) for v in answer]
    if any(v is None for v in values) or (length is not None and len(values) != length):
        return None
    return values  # type: ignore[return-value]
