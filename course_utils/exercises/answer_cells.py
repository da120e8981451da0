"""An answer cell's source, run as a notebook runs its cells (after the exercise's context), and
whether an answer is still the starter as shipped ("not attempted yet"): the fingerprint of its
code, ignoring comments, layout and line numbers.
"""

from __future__ import annotations

import linecache
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import Exercise

__all__: list[str] = []


def _fingerprint(obj: Any) -> Any:
    """What the code of a function or class does, ignoring comments, layout and line numbers."""
    if isinstance(obj, types.CodeType):
        consts = tuple(_fingerprint(c) if isinstance(c, types.CodeType) else repr(c) for c in obj.co_consts)
        return (obj.co_code, obj.co_names, obj.co_varnames, consts)
    if isinstance(obj, (staticmethod, classmethod)):
        return _fingerprint(obj.__func__)
    if isinstance(obj, types.FunctionType):
        return _fingerprint(obj.__code__)
    if isinstance(obj, type):
        return tuple((name, _fingerprint(value)) for name, value in sorted(vars(obj).items())
                     if isinstance(value, (types.FunctionType, staticmethod, classmethod)))
    return None


_STARTERS: dict[str, Any] = {}


def _starter_fingerprint(ex: Exercise) -> Any:
    if ex.key not in _STARTERS:
        namespace = _execute(ex, ex.starter, "starter")
        _STARTERS[ex.key] = _fingerprint(namespace.get(ex.answer))
    return _STARTERS[ex.key]


def _unattempted(ex: Exercise, answer: Any) -> bool:
    if answer is Ellipsis:
        return True
    if ex.kind == "predict":
        return False
    fingerprint = _fingerprint(answer)
    return fingerprint is not None and fingerprint == _starter_fingerprint(ex)


def _execute(ex: Exercise, src: str, label: str) -> dict[str, Any]:
    """Run the context, then ``src``, as a notebook would run two cells.

    Like IPython, each top-level statement is compiled on its own: Python 3.11 compiles
    ``torch.ones(...)`` inside a function differently when ``import torch`` is in the same
    compiled unit, and the fingerprint of an untouched fix starter must match the notebook's.
    """
    import ast

    namespace: dict[str, Any] = {"__name__": "__main__"}
    for part, text in (("context", ex.context), (label, src)):
        filename = f"<exercise {ex.key} {part}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
        for node in ast.parse(text, filename).body:
            code = compile(ast.Module([node], type_ignores=[]), filename, "exec")
            exec(code, namespace)  # noqa: S102 - the course's own sources
    return namespace
