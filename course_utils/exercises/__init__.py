"""Exercises that check themselves (every notebook from 01 on ends its sections with them; notebook
00 asks one warm-up prediction).

A notebook asks a question in a markdown cell, gives an answer cell to fill in (tagged
``answer:KEY``) and a check cell::

    rows_on_device_0 = ...          # your prediction
    check("02.1", rows_on_device_0)

``check`` says whether the answer is right, gives a hint aimed at the likely mistake when it is
not, reads "not attempted yet" while the answer cell is as shipped, and never raises. It comes
back within the exercise's time limit (a few seconds) whatever the answer does: an answer that
never finishes is stopped, and the hint says so.
``progress("02")`` lists which of a notebook's exercises pass.

Each notebook's exercises are defined in one place: their content (the answer cell as shipped,
the reference solution, the wrong answers learners commonly write and the hint each must get) in
``course_utils/exercises/nbNN.toml``, their judges in ``nbNN.py``. The solutions edition of the
notebooks is generated from them (``make solutions``), and ``tests/test_exercises.py`` proves that
every solution passes and every listed wrong answer gets its hint.
"""

from .core import (
    KINDS,
    TIME_LIMIT_S,
    Exercise,
    Verdict,
    bank,
    check,
    find,
    load_bank,
    progress,
    run_source,
    untimed,
    verdict,
)
from .on_ranks import run_on_ranks

__all__ = ["KINDS", "TIME_LIMIT_S", "Exercise", "Verdict", "bank", "check", "find", "load_bank", "progress",
           "run_on_ranks", "run_source", "untimed", "verdict"]
