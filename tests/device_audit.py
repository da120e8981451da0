"""The device audit: checks a rank function against ``course_utils.devices``' rules on any machine.

It marks every tensor created on the default device without being asked for, follows it through
torch's operations, and records each one that reaches a collective or a module without passing
through ``.to(rank_device())`` (or a factory called with ``device=rank_device()``). On the CPU such
a rank function runs anyway; under NCCL it would fail. tests/test_devices.py runs every rank
function of the course under it. Test-only code: the course itself never imports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from course_utils.devices import rank_device

__all__ = ["DeviceAudit", "audited"]

# ----------------------------------------------------------------------------- the audit

#: Collectives whose tensor arguments must be on the rank's device; the flat all-gather and
#: reduce-scatter under both releases' names (2.13's ``*_single``, see compat), since the
#: course's ZeRO by hand calls whichever this torch has.
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single",
                "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend",
                "irecv", "gather", "scatter")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> Any:
    try:
        storage = t.untyped_storage()
        return storage if storage.data_ptr() else None  # empty tensors hold no memory
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (sparse, meta, DTensor...)
        return None


class DeviceAudit(torch.overrides.TorchFunctionMode):
    """Record tensors that reach a collective or a module without being put on the rank's device.

    While active, a factory call (``torch.tensor``, ``torch.randn``, a layer's parameters...)
    without ``device=`` marks the memory it creates as *unplaced*, and so does any operation that
    reads unplaced memory. ``.to(device)``, ``.cuda()`` and factories given the rank's device
    make placed tensors (on the CPU, ``.to`` returns its input unchanged, so the audit hands back
    a copy). Each unplaced tensor that reaches a collective (its tensor arguments) or a module
    (its inputs, parameters and buffers) is a violation, listed in ``violations``.

    The audit keeps unplaced memory alive until it ends, so that an address freed and reused by a
    placed tensor cannot be mistaken for it: use it on small jobs. It sees only values: a factory
    called with a hard-coded ``device="cpu"`` passes on a CPU rank, so review those by eye.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device
        self.violations: list[str] = []
        self._unplaced: dict[int, Any] = {}  # data pointer -> storage (kept alive on purpose)
        self._undo: list[Callable[[], None]] = []

    def is_unplaced(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        return storage is not None and storage.data_ptr() in self._unplaced

    def _mark(self, out: Any) -> None:
        for t in _tensors(out):
            storage = _storage(t)
            if storage is not None:
                self._unplaced[storage.data_ptr()] = storage

    @staticmethod
    def _placing(name: str, args: tuple, kwargs: dict) -> bool:
        """Whether a call puts its result on a device on purpose (``.to(device)``, ``.cuda()``)."""
        if name == "cuda":
            return True
        return name == "to" and ("device" in kwargs or any(
            isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args[1:]))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(args) + _tensors(kwargs)
        out = func(*args, **kwargs)
        if self._placing(name, args, kwargs):
            if any(o is i or _storage(o) is not None and o.data_ptr() == i.data_ptr()
                   for o in _tensors(out) for i in inputs):
                out = out.clone()  # already on that device: a placed copy, so the audit can tell
        elif not inputs:  # a factory: placed only when asked for the rank's device
            asked = kwargs.get("device")
            if asked is None or torch.device(asked) != self.device:
                self._mark(out)
        elif not name.endswith("_") and any(self.is_unplaced(t) for t in inputs):
            self._mark(out)  # computed from unplaced memory (in-place writes keep their target's)
        return out

    def _check(self, where: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if self.is_unplaced(t):
                self.violations.append(f"{where}: a {tuple(t.shape)} {t.dtype} tensor was never "
                                       "put on the rank's device")
                del self._unplaced[t.untyped_storage().data_ptr()]  # report each tensor once

    def __enter__(self) -> DeviceAudit:
        import torch.distributed as dist

        if self.device is None:
            self.device = rank_device()

        def forward_hook(module: torch.nn.Module, args: tuple) -> None:
            name = type(module).__name__
            self._check(f"{name} input", _tensors(args))
            self._check(f"{name} parameter or buffer",
                        list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))

        handle = torch.nn.modules.module.register_module_forward_pre_hook(forward_hook)
        self._undo.append(handle.remove)
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def checked(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                self._check(f"dist.{_name}", _tensors(args) + _tensors(kwargs))
                return _original(*args, **kwargs)

            setattr(dist, name, checked)
            self._undo.append(functools.partial(setattr, dist, name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        while self._undo:
            self._undo.pop()()
        self._unplaced.clear()


def audited(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> dict:
    """A rank function for ``launch``: run ``fn(rank, world_size, *args)`` under a :class:`DeviceAudit`.

    Returns ``{"device": the rank's device, "violations": [...], "result": type of fn's result}``.
    """
    with DeviceAudit() as audit:
        result = fn(rank, world_size, *args)
    return {"device": str(audit.device), "violations": audit.violations,
            "result": type(result).__name__}
