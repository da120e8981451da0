"""How ``launch`` sends a function and its arguments to the ranks, and back (notebook 05).

``fn`` and ``args`` travel with ``cloudpickle``: a function defined in a notebook cell, a script's
``__main__`` or inside another function is sent *by value*, with the globals and closure variables
it uses; an importable function goes by reference. What cannot travel (an open file, a lock, a
socket, a generator, a GPU tensor) is named in a ``TypeError`` before any rank starts, following
the function's helpers and globals down to the culprit.
"""

from __future__ import annotations

import functools
import inspect
import io
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

from .._checks import type_name

__all__ = ["serialise_call"]


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, refusing open files (cloudpickle would send a copy of what a file opened for
    reading holds) and tensors that live on a device (a rank cannot use this process's)."""

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, io.IOBase) and not isinstance(obj, (io.StringIO, io.BytesIO))
                and obj not in (sys.stdout, sys.stderr, sys.stdin)):
            name = getattr(obj, "name", None)
            raise TypeError(f"an open file{f' ({name!r})' if name is not None else ''} cannot be "
                            f"sent to other processes: pass its path and open it in fn")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            raise TypeError(f"a tensor on {obj.device} cannot be sent to other processes: pass it "
                            f"on the CPU (.cpu()) and let each rank move it to its own device")
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _pickle_error(obj: Any) -> Exception | None:
    try:
        _dumps(obj)
    except Exception as err:  # noqa: BLE001 - any failure means it cannot travel
        return err
    return None


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The global names ``code`` may read, nested code (lambdas, comprehensions) included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _parts(obj: Any) -> list[tuple[str, Any]]:
    """What a function sent by value carries along, each with a name a reader can find."""
    if isinstance(obj, functools.partial):
        return [("wrapped function", obj.func),
                *((f"bound argument {i}", a) for i, a in enumerate(obj.args)),
                *((f"bound keyword {k!r}", v) for k, v in obj.keywords.items())]
    if inspect.ismethod(obj):
        return [("object (self)", obj.__self__), ("function", obj.__func__)]
    if not inspect.isfunction(obj):
        return []
    parts = []
    for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
        try:
            parts.append((f"closure variable {name!r}", cell.cell_contents))
        except ValueError:  # an empty cell: a variable not yet assigned
            pass
    seen = set()
    for name in _global_names(obj.__code__):
        if name in obj.__globals__ and name not in seen:
            seen.add(name)
            parts.append((f"global {name!r}", obj.__globals__[name]))
    defaults = inspect.signature(obj).parameters.values() if obj.__defaults__ or obj.__kwdefaults__ else ()
    for parameter in defaults:
        if parameter.default is not inspect.Parameter.empty:
            parts.append((f"default of parameter {parameter.name!r}", parameter.default))
    return parts


def _culprit(obj: Any, err: Exception, depth: int = 0) -> tuple[list[str], Any, Exception]:
    """Follow what ``obj`` carries down to the innermost piece that cannot be pickled."""
    if depth < 5:
        for name, part in _parts(obj):
            part_err = _pickle_error(part)
            if part_err is not None:
                path, found, found_err = _culprit(part, part_err, depth + 1)
                return [name, *path], found, found_err
    return [], obj, err


def serialise_call(fn: Callable, args: tuple) -> bytes:
    """``(fn, args)`` as cloudpickle bytes, or a TypeError that names what cannot travel."""
    if not callable(fn):
        raise TypeError(f"fn must be a function (or another callable), got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    try:
        return _dumps((fn, args))
    except Exception as err:  # noqa: BLE001 - explained below
        first_err = err
    hint = ("Each rank is a separate process: create open files, locks, sockets, generators and "
            "GPU tensors inside fn, and pass plain data (paths, numbers, CPU tensors) instead.")
    fn_err = _pickle_error(fn)
    if fn_err is not None:
        what = f"fn {getattr(fn, '__qualname__', None) or type_name(fn)!r}"
        path, found, found_err = _culprit(fn, fn_err)
        where = ("its " + ", whose ".join(path)) if path else what
    else:
        what = "the arguments for fn"
        for i, arg in enumerate(args):
            arg_err = _pickle_error(arg)
            if arg_err is not None:
                path, found, found_err = _culprit(arg, arg_err)
                where = ", whose ".join([f"args[{i}]", *path])
                break
        else:  # each piece travels, the whole does not (pickle's own limits): say what it said
            found, found_err, where = (fn, args), first_err, "the call"
    raise TypeError(f"cannot send {what} to the ranks: {where} is a {type_name(found)}, which "
                    f"cannot be pickled ({found_err}). {hint}") from None
