"""Show the course's own code in a notebook: a whole function or class, or one marked region of it.

A notebook that teaches code kept in ``course_utils`` shows it with ``show(obj)``; a lesson that is
only part of a function marks that part in the module::

    def train(...):
        ...
        # region: step
        loss = loss_fn(model(x), y)
        loss.backward()
        # endregion
        ...

and the notebook calls ``show(train, "step")``. The markers are comments, so they cost nothing at
run time; a test (``tests/test_show.py``) checks that every region a notebook shows exists, so an
edit of the module cannot silently change or break what a lesson shows.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import Any

__all__ = ["regions", "show", "source"]

_START = re.compile(r"^\s*# region: ([\w-]+)\s*$")
_END = re.compile(r"^\s*# endregion\s*$")


def _source_of(obj: Any) -> str:
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.ismethod(obj)
            or inspect.ismodule(obj)):
        raise TypeError(f"obj must be a function, method, class or module, got {type(obj).__name__}")
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError) as err:
        raise ValueError(f"the source of {obj.__qualname__ if hasattr(obj, '__qualname__') else obj!r} "
                         f"cannot be read ({err})") from None


def regions(obj: Any) -> list[str]:
    """The names of the regions marked in ``obj``'s source, in order."""
    return [m.group(1) for line in _source_of(obj).splitlines() if (m := _START.match(line))]


def source(obj: Any, region: str | None = None) -> str:
    """``obj``'s source, or only the lines of ``region`` (markers left out), dedented."""
    text = _source_of(obj)
    if region is None:
        return "\n".join(line for line in text.splitlines() if not (_START.match(line) or _END.match(line)))
    if not isinstance(region, str):
        raise TypeError(f"region must be a str naming a '# region: NAME' marker, got {type(region).__name__}")
    lines, inside, found = [], False, False
    for line in text.splitlines():
        start = _START.match(line)
        if start and start.group(1) == region:
            inside = found = True
        elif inside and _END.match(line):
            inside = False
        elif inside and not start:
            lines.append(line)
    if not found:
        name = getattr(obj, "__qualname__", repr(obj))
        raise ValueError(f"{name} has no region {region!r}; its regions are {regions(obj)}")
    if inside:
        raise ValueError(f"region {region!r} is not closed by '# endregion'")
    return textwrap.dedent("\n".join(lines))


def show(obj: Any, region: str | None = None) -> None:
    """Print ``obj``'s source (or one region of it) with the name of the module it lives in."""
    code = source(obj, region)
    where = f"{getattr(obj, '__module__', None) or obj.__name__}.{getattr(obj, '__qualname__', '')}"
    label = where.rstrip(".") + (f"  (region '{region}')" if region else "")
    print(f"# {label}\n{code}")
