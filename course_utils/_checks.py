"""Argument checks shared by the course's public functions: clear messages, one wording."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_dense", "check_int", "check_number", "check_positive_int", "check_seconds", "type_name"]


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def type_name(obj: Any) -> str:
    """The type of ``obj`` as an error message names it: ``generator``, ``threading.Lock``."""
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_int(name: str, value: Any) -> int:
    """Return ``value`` if it is a plain int (``bool`` is refused), else raise ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy and torch integer scalars are accepted if they convert exactly
        message = f"{name} must be an int, got {_describe(value)}"
        index = getattr(value, "__index__", None)
        if index is None or isinstance(value, bool):
            raise TypeError(message)
        try:
            value = index()
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(message) from None
    return int(value)


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """An int that is at least ``minimum``; ``TypeError`` or ``ValueError`` otherwise."""
    value = check_int(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value


def check_number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
                 below: float | None = None) -> float:
    """A real number (int or float, not bool), never NaN, within the bounds given; else a
    ``TypeError`` (wrong type) or ``ValueError`` (NaN, infinite or out of bounds)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    bounds = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else "",
              f"< {below:g}" if below is not None else ""]
    wanted = " and ".join(b for b in bounds if b) or "finite"
    if (not math.isfinite(value) or (above is not None and not value > above)
            or (at_least is not None and not value >= at_least) or (below is not None and not value < below)):
        raise ValueError(f"{name} must be a number {wanted}, got {value!r}")
    return value


def check_seconds(name: str, value: Any) -> float:
    """A time limit: a number of seconds > 0 (not NaN, not infinite)."""
    try:
        return check_number(name, value, above=0)
    except (TypeError, ValueError):  # one wording for every bad time limit
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}") from None


def check_dense(module: Any) -> None:
    """Refuse a module with sparse gradients (an embedding built with ``sparse=True``): the course's
    data parallelism by hand flattens gradients, which a sparse tensor cannot be."""
    if any(getattr(m, "sparse", False) for m in module.modules()):
        raise ValueError("sparse gradients (an embedding with sparse=True) are not written here; "
                         "torch's DDP all-reduces them")
