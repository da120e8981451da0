"""Progress bars that look like one wherever the course runs (notebooks 01, 03 and 11).

``tqdm`` here takes tqdm's own arguments and picks its look when it is called:

- in a front end that draws widgets (JupyterLab, Jupyter Notebook, VS Code, Colab), tqdm's
  widget: a bar that fills, not text on stderr, which JupyterLab paints pink like an error;
- in a notebook run in batch (nbval, ``make execute``, nbconvert), tqdm's text bar on stdout: its
  stored output is the bar's last state, which nbval compares with the timings masked;
- in plain Python, tqdm's text bar on stderr, as tqdm does.

A front end that draws widgets is told apart from a batch run by what the kernel was asked: a
person's front end lets the kernel ask for input (``input()``), a batch run does not. The
environment variable ``COURSE_PROGRESS`` (``widget`` or ``text``) overrides the choice.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["PROGRESS_VARIABLE", "bar_kind", "tqdm"]

#: ``COURSE_PROGRESS=text`` (or ``widget``) forces that kind of bar.
PROGRESS_VARIABLE = "COURSE_PROGRESS"


def _kernel() -> Any:
    """The IPython kernel running this code, or None (plain Python, a terminal IPython)."""
    if "IPython" not in sys.modules:  # never imported: not in a kernel, and no need to import it
        return None
    shell = sys.modules["IPython"].get_ipython()
    return getattr(shell, "kernel", None)


def bar_kind() -> str:
    """``"widget"``, ``"text-stdout"`` (a notebook run in batch) or ``"text"`` (plain Python)."""
    choice = os.environ.get(PROGRESS_VARIABLE, "").strip().lower()
    if choice not in ("", "widget", "text"):
        raise ValueError(f"{PROGRESS_VARIABLE} must be 'widget', 'text' or unset, got {choice!r}")
    kernel = _kernel()
    if choice == "widget" or (not choice and kernel is not None and getattr(kernel, "_allow_stdin", False)
                              and importlib.util.find_spec("ipywidgets") is not None):
        return "widget"
    return "text-stdout" if kernel is not None else "text"


def tqdm(iterable: Iterable | None = None, **kwargs: Any) -> Any:
    """``tqdm.tqdm(iterable, **kwargs)``, drawn as a widget or as text (see the module)."""
    kind = bar_kind()
    if kind == "widget":
        from tqdm.notebook import tqdm as bar
    else:
        from tqdm import tqdm as bar

        if kind == "text-stdout":
            kwargs.setdefault("file", sys.stdout)
    return bar(iterable, **kwargs)
