"""DataParallel's four primitives by hand, on simulated devices (notebook 03).

``torch.nn.parallel``'s primitives only accept GPUs ("Expected a non cpu device"). The four
functions here are the same steps over *simulated* devices (``course_utils.dataparallel.simulated``),
``"sim:0"``, ``"sim:1"``, ..., whose tensors live on the CPU. They keep what learners trip over:

- **scatter** cuts tensors with ``torch.chunk`` along ``dim``, walks tuples, lists, dicts and
  namedtuples, and hands non-tensors to every device. The first device's chunk is a view of the
  input (the input already lives there); every other device gets its own copy.
- **replicate** gives every device a copy of the module whose parameters are *not* leaves, so
  backward sums every replica's gradient into the original parameters. The first replica shares
  storage with the original, so in-place buffer updates there (BatchNorm's running statistics)
  reach the original module; the other replicas' updates are lost with them.
- **parallel_apply** runs each replica in its own thread, with the caller's grad mode and CPU
  autocast state, and re-raises a replica's exception in the caller, naming its device.
- **gather** concatenates along ``dim``; scalar outputs become a vector, with PyTorch's warning.

Nothing here knows about GPUs or memory records: ``course_utils.dataparallel.primitives`` dispatches to
these for simulated devices (and to ``torch.nn.parallel``'s for CUDA ones), and
``course_utils.dataparallel.by_hand`` composes the four steps into ``data_parallel``.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["gather", "parallel_apply", "replicate", "scatter", "scatter_kwargs"]


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(inputs: Any, devices: Sequence[Any], dim: int = 0) -> list:
    """Cut ``inputs`` along ``dim``: one entry per device that receives a chunk.

    As in PyTorch, the result is as long as the *shortest* split, so a tensor with fewer rows
    than devices leaves devices idle.
    """

    def scatter_map(obj: Any) -> list:
        if isinstance(obj, torch.Tensor):
            chunks = obj.chunk(len(devices), dim)
            return [chunks[0], *(chunk.clone() for chunk in chunks[1:])]  # device 0 holds obj
        if _is_namedtuple(obj):
            return [type(obj)(*args) for args in zip(*map(scatter_map, obj), strict=False)]
        if isinstance(obj, tuple) and obj:
            return list(zip(*map(scatter_map, obj), strict=False))
        if isinstance(obj, list) and obj:
            return [list(i) for i in zip(*map(scatter_map, obj), strict=False)]
        if isinstance(obj, dict) and obj:
            return [type(obj)(i) for i in zip(*map(scatter_map, obj.items()), strict=False)]
        return [obj for _ in devices]

    return scatter_map(inputs)


def scatter_kwargs(inputs: tuple, kwargs: dict | None, devices: Sequence[Any],
                   dim: int = 0) -> tuple[tuple, tuple]:
    """Scatter positional and keyword arguments together: ``(inputs_per_device, kwargs_per_device)``."""
    scattered_inputs = list(scatter(inputs, devices, dim)) if inputs else []
    scattered_kwargs = list(scatter(kwargs, devices, dim)) if kwargs else []
    n = max(len(scattered_inputs), len(scattered_kwargs))  # pad the shorter one
    scattered_inputs += [()] * (n - len(scattered_inputs))
    scattered_kwargs += [{}] * (n - len(scattered_kwargs))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def replicate(module: nn.Module, devices: Sequence[Any], detach: bool = False) -> list[nn.Module]:
    """One copy of ``module`` per device; backward through any copy reaches the original."""

    def copy(j: int, t: torch.Tensor) -> torch.Tensor:
        keep_grad = t.requires_grad and not detach
        source = t if keep_grad else t.detach()
        if j == 0:  # replica 0 shares storage with the original; the others get copies
            return source.view_as(source) if keep_grad else source
        return source.clone()

    return _replicate_structure(module, len(devices), copy)


def _replicate_structure(network: nn.Module, num_replicas: int,
                         copy: Callable[[int, torch.Tensor], torch.Tensor]) -> list[nn.Module]:
    """Rebuild ``network``'s module tree ``num_replicas`` times with copied tensors.

    Mirrors ``torch.nn.parallel.replicate``: every submodule is shallow-copied with
    ``_replicate_for_data_parallel``; shared submodules and tensors stay shared inside a replica;
    the parameter copies are plain tensors (not ``Parameter`` leaves), so gradients flow back.
    """
    modules = list(network.modules())
    index = {m: i for i, m in enumerate(modules)}
    copies = [[m._replicate_for_data_parallel() for m in modules] for _ in range(num_replicas)]
    copied: dict[int, list[torch.Tensor]] = {}  # each tensor copied once, shared where it recurs
    for j, replicas in enumerate(copies):
        for m, replica in zip(modules, replicas, strict=True):
            replica._former_parameters = OrderedDict()  # what DataParallel's replicas list
            for key, child in m._modules.items():
                replica._modules[key] = None if child is None else replicas[index[child]]
            for table in ("_parameters", "_buffers"):
                for key, tensor in getattr(m, table).items():
                    if tensor is None:
                        getattr(replica, table)[key] = None
                        continue
                    if id(tensor) not in copied:
                        copied[id(tensor)] = [copy(k, tensor) for k in range(num_replicas)]
                    setattr(replica, key, copied[id(tensor)][j])
                    if table == "_parameters":
                        replica._former_parameters[key] = copied[id(tensor)][j]
    return [replicas[0] for replicas in copies]


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict] | None = None,
                   devices: Sequence[Any] | None = None) -> list[Any]:
    """Run ``replicas[i](*inputs[i], **kwargs_tup[i])``, each in its own thread."""
    kwargs_tup = kwargs_tup or [{}] * len(replicas)
    names = [str(d) for d in devices] if devices else [f"replica {i}" for i in range(len(replicas))]
    grad_enabled, autocast = torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")
    autocast_dtype = torch.get_autocast_dtype("cpu")
    results: list[Any] = [None] * len(replicas)
    failures: dict[int, tuple[BaseException, str]] = {}

    def worker(i: int) -> None:  # a new thread has grad on and autocast off: take the caller's
        try:
            with torch.set_grad_enabled(grad_enabled), \
                    torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast):
                args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
                results[i] = replicas[i](*args, **kwargs_tup[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
            failures[i] = exc, traceback.format_exc()

    threads = [threading.Thread(target=worker, args=(i,), name=f"replica-{i}-{names[i]}")
               for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _reraise_first(failures, names)
    return results


def _reraise_first(failures: dict[int, tuple[BaseException, str]], names: list[str]) -> None:
    """Raise the first replica's exception in the caller, naming its device, as PyTorch does."""
    if not failures:
        return
    i = min(failures)
    exc, tb = failures[i]
    message = f"Caught {type(exc).__name__} in replica {i} on device {names[i]}.\nOriginal traceback:\n{tb}"
    try:
        new = type(exc)(message)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        new = RuntimeError(message)
    raise new from None


def gather(outputs: Sequence[Any], output_device: Any, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs along ``dim`` on ``output_device``.

    Simulated devices keep their tensors on the CPU, so the result is already there. When every
    output is a 0-dim tensor and ``dim == 0`` the scalars become a vector, with PyTorch's warning:
    the "loss" you get back is one value per replica, not one number.
    """

    def gather_map(outs: Sequence[Any]) -> Any:
        out = outs[0]
        if isinstance(out, torch.Tensor):
            if dim == 0 and all(t.dim() == 0 for t in outs):
                warnings.warn("Was asked to gather along dimension 0, but all input tensors were "
                              "scalars; will instead unsqueeze and return a vector.", stacklevel=3)
                outs = [t.view(1) for t in outs]
            return torch.cat(list(outs), dim)
        if out is None:
            return None
        if isinstance(out, dict):
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs, strict=True)))
        return type(out)(map(gather_map, zip(*outs, strict=True)))

    return gather_map(outputs)
