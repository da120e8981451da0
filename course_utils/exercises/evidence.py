"""What a judge looks at besides an answer's result: whether the answer changed its inputs in place
(:func:`snapshot`, then :func:`changed`), and what really ran inside it (:func:`calls_recorded`),
however the answer reached it (an alias, an attribute, a name imported under another name)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["calls_recorded", "changed", "snapshot"]


def snapshot(value: Any) -> Any:
    """A copy of ``value`` (tensors cloned, lists, tuples and dicts rebuilt, each with the identity of
    what it copies) for :func:`changed` to tell, after an answer ran, whether it changed in place."""
    import torch

    if isinstance(value, torch.Tensor):
        return id(value), value.detach().clone()
    if isinstance(value, dict):
        return id(value), {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return id(value), [snapshot(v) for v in value]
    return id(value), value


def changed(value: Any, before: Any) -> bool:
    """Whether ``value`` is no longer what :func:`snapshot` saw: a tensor with other values, dtype,
    shape or device, a container with other keys or items (a new object in place of one counts)."""
    import torch

    ident, saved = before
    if id(value) != ident:
        return True
    if isinstance(value, torch.Tensor):
        if (value.dtype, value.shape, value.device) != (saved.dtype, saved.shape, saved.device):
            return True
        if value.device.type == "meta" or torch.equal(value.detach(), saved):
            return False
        return not (value.is_floating_point() and torch.equal(value.detach().isnan(), saved.isnan())
                    and torch.equal(value.detach().nan_to_num(), saved.nan_to_num()))
    if isinstance(value, dict):
        return list(value) != list(saved) or any(changed(value[k], saved[k]) for k in saved)
    if isinstance(value, (list, tuple)):
        return len(value) != len(saved) or any(changed(v, s) for v, s in zip(value, saved, strict=True))
    return False


@contextlib.contextmanager
def calls_recorded() -> Iterator[set]:
    """What ran inside the block, in this thread: the code object of every Python function called
    and the name of every built-in, however the caller reached it (an alias or an attribute)."""
    ran: set = set()
    previous = sys.getprofile()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            ran.add(frame.f_code)
        elif event == "c_call":
            ran.add(getattr(arg, "__name__", ""))

    sys.setprofile(profile)
    try:
        yield ran
    finally:
        sys.setprofile(previous)
