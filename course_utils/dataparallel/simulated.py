"""Simulated devices, and the bytes the emulation puts on each (notebooks 03 and 04).

``torch.nn.parallel``'s primitives only accept GPUs. The course's primitives (``by_hand``) take a
list of devices that are either real CUDA devices or *simulated* ones, ``"sim:0"``, ``"sim:1"``...,
whose tensors live on the CPU: this module names and checks them, and records the bytes that
scatter, replicate and gather leave on each (``record_memory``), which notebook 04 compares with
its memory ledger.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import check_positive_int

__all__ = [
    "Device",
    "MemoryRecord",
    "SimDevice",
    "check_scatter_sizes",
    "course_devices",
    "note_memory",
    "parse_device",
    "parse_devices",
    "parse_output_device",
    "record_memory",
    "recording",
    "sim_devices",
    "tensors_in",
]


@dataclass(frozen=True, order=True)
class SimDevice:
    """A simulated device: its tensors live on the CPU, its identity is its index."""

    index: int

    type = "sim"

    def __str__(self) -> str:
        return f"sim:{self.index}"

    def __repr__(self) -> str:
        return f"SimDevice({self.index})"


Device = SimDevice | torch.device


@dataclass
class MemoryRecord:
    """Bytes each device holds, by category, as the primitives create them (``record_memory``).

    ``inputs``: what ``scatter`` leaves on each device (the first device holds the whole source
    tensor, of which its chunk is a view; the others hold their copies). ``parameters``: the
    replicas' parameter tensors (the first replica shares the original's storage).
    ``outputs``: what ``gather`` creates on the output device.
    """

    held: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))

    def add(self, device: Any, category: str, nbytes: int) -> None:
        row = self.held[str(device)]
        row[category] = row.get(category, 0) + int(nbytes)

    def bytes(self, device: Any, category: str) -> int:
        return self.held.get(str(device), {}).get(category, 0)


_RECORD: ContextVar[MemoryRecord | None] = ContextVar("course_utils_memory_record", default=None)


@contextmanager
def record_memory() -> Iterator[MemoryRecord]:
    """Record what scatter, replicate and gather put on each device inside the ``with`` block."""
    record = MemoryRecord()
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def recording() -> bool:
    """Whether a ``record_memory()`` block is active (so noting bytes is worth the work)."""
    return _RECORD.get() is not None


def note_memory(device: Any, category: str, tensors: Any, *, whole_storage: bool = False) -> None:
    """Record ``tensors`` on ``device``; with ``whole_storage``, the memory they view, once each.

    A chunk that ``torch.nn.parallel.scatter`` leaves on the source's own device is a view of the
    whole source tensor, so that device holds the whole input: counting storages makes the real
    path count what the simulated one counts.
    """
    record = _RECORD.get()
    if record is None:
        return
    if whole_storage:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors_in(tensors)}
        record.add(device, category, sum(storages.values()))
    else:
        record.add(device, category, sum(t.nbytes for t in tensors_in(tensors)))


def sim_devices(n: int) -> list[SimDevice]:
    """``n`` simulated devices, ``sim:0`` to ``sim:{n-1}``."""
    return [SimDevice(i) for i in range(check_positive_int("n", n))]


def course_devices(n: int) -> list[Device]:
    """``n`` real GPUs when this machine has that many, else ``n`` simulated devices."""
    n = check_positive_int("n", n)
    if torch.cuda.is_available() and torch.cuda.device_count() >= n:
        return [torch.device("cuda", i) for i in range(n)]
    return sim_devices(n)


def parse_device(spec: Any) -> Device:
    """One device: an int or 'cuda:N' (a GPU that exists here), 'sim:N', or a CUDA torch.device."""
    if isinstance(spec, SimDevice):
        return spec
    if isinstance(spec, bool):
        raise TypeError(f"a device must be an int, 'cuda:N', 'sim:N' or a torch.device, got {spec!r}")
    if isinstance(spec, int):
        return _cuda(spec)
    if isinstance(spec, torch.device):
        if spec.type != "cuda":
            raise ValueError(f"expected a CUDA or simulated device, got {spec}: the primitives "
                             "need separate devices; use sim_devices(n) to simulate them")
        return _cuda(0 if spec.index is None else spec.index)
    if isinstance(spec, str):
        kind, _, index = spec.partition(":")
        if kind == "sim" and index.isdigit():
            return SimDevice(int(index))
        if kind == "cuda" and (index.isdigit() or not index):
            return _cuda(int(index or 0))
        if kind == "cpu":
            raise ValueError("expected a CUDA or simulated device, got 'cpu': the primitives "
                             "need separate devices; use sim_devices(n) to simulate them")
        raise ValueError(f"unknown device {spec!r}: expected an int, 'cuda:N' or 'sim:N'")
    raise TypeError(f"a device must be an int, 'cuda:N', 'sim:N' or a torch.device, "
                    f"got {type(spec).__name__}")


def _cuda(index: int) -> torch.device:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= index < count:
        raise ValueError(f"cuda:{index} is not available (this machine has {count} GPU(s)); "
                         f"use simulated devices such as 'sim:{index}' instead")
    return torch.device("cuda", index)


def parse_devices(device_ids: Sequence[Any]) -> list[Device]:
    """Check and normalise a device list: all CUDA or all simulated, no repeats, not empty."""
    if isinstance(device_ids, (str, bytes)) or not isinstance(device_ids, Sequence):
        raise TypeError(f"device_ids must be a list of devices, got {type(device_ids).__name__}")
    if len(device_ids) == 0:
        raise ValueError("device_ids is empty: give at least one device, e.g. sim_devices(2)")
    devices = [parse_device(d) for d in device_ids]
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"device_ids mixes CUDA and simulated devices: {[str(d) for d in devices]}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"device_ids repeats a device: {[str(d) for d in devices]}")
    return devices


def parse_output_device(output_device: Any, devices: list[Device]) -> Device:
    """Where gathered outputs go: the first device by default, the CPU for -1 or 'cpu'."""
    if output_device is None:
        return devices[0]
    if output_device == -1 or output_device == "cpu":
        return torch.device("cpu")
    out = parse_device(output_device)
    if out.type != devices[0].type:
        raise ValueError(f"output_device {out} is not of the same kind as device_ids "
                         f"({devices[0].type})")
    return out



def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, through nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def check_scatter_sizes(inputs: Any, n: int, dim: int, strict: bool) -> None:
    """Refuse a scatter of ``inputs`` over ``n`` devices along ``dim`` that cannot be done (or,
    with ``strict``, that would leave devices idle)."""
    for t in tensors_in(inputs):
        if t.dim() == 0:
            raise ValueError("cannot scatter a 0-dim tensor: it has no dimension to split")
        if not -t.dim() <= dim < t.dim():
            raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(t.shape)}")
        if strict and t.size(dim) < n:
            raise ValueError(
                f"a tensor of shape {tuple(t.shape)} has {t.size(dim)} entries along dim={dim}, "
                f"fewer than the {n} devices: nn.DataParallel would silently run on only "
                f"{t.size(dim)} of them. Use a bigger batch, fewer devices, or strict=False"
            )
