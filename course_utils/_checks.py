"""Argument checks shared by the course's public functions: clear messages, one wording."""

from __future__ import annotations

from typing import Any

__all__ = ["check_int", "check_positive_int"]


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value: Any) -> int:
    """Return ``value`` if it is a plain int (``bool`` is refused), else raise ``TypeError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy and torch integer scalars are accepted if they convert exactly
        index = getattr(value, "__index__", None)
        if index is None or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {_describe(value)}")
        value = index()
    return int(value)


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """An int that is at least ``minimum``; ``TypeError`` or ``ValueError`` otherwise."""
    value = check_int(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return value
