"""DataParallel by hand: replicate, scatter, parallel_apply, gather on any machine (notebook 03).

``torch.nn.parallel``'s primitives only accept GPUs ("Expected a non cpu device"). This module
gives the same four steps over devices that are either real CUDA devices (the work is then handed
to ``torch.nn.parallel``) or *simulated* devices (``course_utils.simulated``), ``"sim:0"``,
``"sim:1"``, ..., whose tensors live on the CPU. The simulation keeps what learners trip over:

- **scatter** cuts tensors with ``torch.chunk`` along ``dim``, recurses into tuples, lists, dicts
  and namedtuples, copies non-tensors to every device, and scatters keyword arguments too. The
  chunk for the first device is a view of the input (the input already lives there); every other
  device gets its own copy, as a host-to-device copy would make.
- **replicate** gives every device a copy of the module whose parameters are *not* leaves: they
  are differentiable copies of the originals, so backward sums every replica's gradient into the
  original parameters. The first device's replica shares storage with the original (parameters
  and buffers), so in-place buffer updates there (BatchNorm's running statistics) reach the
  original module; the other replicas' updates are lost when they are dropped.
- **parallel_apply** runs each replica in its own thread, with the caller's grad mode and CPU
  autocast state, and re-raises a replica's exception in the caller, naming its device.
- **gather** concatenates along ``dim`` on ``output_device``; scalar outputs are unsqueezed into
  a vector with a warning, as PyTorch does.
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

from ._checks import check_int
from .simulated import (
    Device,
    SimDevice,
    check_scatter_sizes,
    note_memory,
    parse_device,
    parse_devices,
    parse_output_device,
    recording,
    tensors_in,
)

__all__ = [
    "DataParallelByHand",
    "data_parallel",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
    "scatter_kwargs",
]


def _is_sim(devices: list[Device]) -> bool:
    return isinstance(devices[0], SimDevice)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


# --------------------------------------------------------------------------- scatter


def scatter(inputs: Any, device_ids: Sequence[Any], dim: int = 0, *, strict: bool = True) -> list:
    """Split ``inputs`` over the devices: one entry per device that receives a chunk.

    Tensors are cut with ``torch.chunk`` along ``dim``; tuples, lists, dicts and namedtuples are
    walked; anything else is handed to every device unchanged. As in PyTorch, the result is as
    long as the *shortest* split, so a tensor with fewer rows than devices leaves devices idle.
    With ``strict=True`` (the default here) that raises instead; ``strict=False`` does what
    ``nn.DataParallel`` silently does.
    """
    devices = parse_devices(device_ids)
    dim = check_int("dim", dim)
    check_scatter_sizes(inputs, len(devices), dim, strict)
    if not _is_sim(devices):
        result = torch.nn.parallel.scatter(inputs, [d.index for d in devices], dim)
        for device, part in zip(devices, result, strict=False):
            note_memory(device, "inputs", part, whole_storage=True)
        return result

    def scatter_map(obj: Any) -> list:
        if isinstance(obj, torch.Tensor):
            chunks = obj.chunk(len(devices), dim)
            # the first device holds the input already: a view; the others get copies
            note_memory(devices[0], "inputs", obj)
            for device, chunk in zip(devices[1:], chunks[1:], strict=False):
                note_memory(device, "inputs", chunk)
            return [c if i == 0 else c.clone() for i, c in enumerate(chunks)]
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


def scatter_kwargs(
    inputs: tuple, kwargs: dict | None, device_ids: Sequence[Any], dim: int = 0, *,
    strict: bool = True,
) -> tuple[tuple, tuple]:
    """Scatter positional and keyword arguments together: ``(inputs_per_device, kwargs_per_device)``."""
    if not isinstance(inputs, tuple):
        raise TypeError(f"inputs must be a tuple of positional arguments, got {type(inputs).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    scattered_inputs = list(scatter(inputs, device_ids, dim, strict=strict)) if inputs else []
    scattered_kwargs = list(scatter(kwargs, device_ids, dim, strict=strict)) if kwargs else []
    n = max(len(scattered_inputs), len(scattered_kwargs))  # pad the shorter one
    scattered_inputs += [()] * (n - len(scattered_inputs))
    scattered_kwargs += [{}] * (n - len(scattered_kwargs))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


# --------------------------------------------------------------------------- replicate


def replicate(module: nn.Module, device_ids: Sequence[Any], detach: bool = False) -> list[nn.Module]:
    """One copy of ``module`` per device; backward through any copy reaches the original."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    devices = parse_devices(device_ids)
    if not _is_sim(devices):
        replicas = torch.nn.parallel.replicate(module, [d.index for d in devices], detach)
        _note_replica_parameters(devices, replicas)
        return replicas
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type != "cpu":
            raise ValueError(f"simulated devices need the module on the CPU, found a tensor on "
                             f"{t.device}")

    def copy_param(j: int, p: torch.Tensor) -> torch.Tensor:
        source = p.detach() if detach else p
        # replica 0 shares storage with the original; the others hold copies of their own
        return source.view_as(source) if j == 0 else source.clone()

    def copy_buffer(j: int, b: torch.Tensor) -> torch.Tensor:
        keep_grad = b.requires_grad and not detach
        source = b if keep_grad else b.detach()
        if j == 0:
            return source.view_as(source) if keep_grad else source
        return source.clone()

    replicas = _replicate_structure(module, len(devices), copy_param, copy_buffer)
    _note_replica_parameters(devices, replicas)
    return replicas


def _note_replica_parameters(devices: list[Device], replicas: list[nn.Module]) -> None:
    if not recording():
        return
    for device, replica in zip(devices, replicas, strict=True):
        unique = {id(t): t for m in replica.modules() for t in m._former_parameters.values()
                  if t is not None}
        note_memory(device, "parameters", list(unique.values()))


def _replicate_structure(
    network: nn.Module,
    num_replicas: int,
    copy_param: Callable[[int, torch.Tensor], torch.Tensor],
    copy_buffer: Callable[[int, torch.Tensor], torch.Tensor],
) -> list[nn.Module]:
    """Rebuild ``network``'s module tree ``num_replicas`` times with copied tensors.

    Mirrors ``torch.nn.parallel.replicate``: every submodule is shallow-copied with
    ``_replicate_for_data_parallel``; shared submodules stay shared inside a replica; the
    parameter copies are plain tensors (not ``Parameter`` leaves), so gradients flow back.
    """
    modules = list(network.modules())
    index = {m: i for i, m in enumerate(modules)}
    copies: list[list[nn.Module]] = [[] for _ in range(num_replicas)]
    for m in modules:
        for j in range(num_replicas):
            replica = m._replicate_for_data_parallel()
            replica._former_parameters = OrderedDict()
            copies[j].append(replica)
    copied: dict[int, list[torch.Tensor]] = {}  # each tensor copied once, shared where it recurs
    for i, m in enumerate(modules):
        for key, child in m._modules.items():
            for j in range(num_replicas):
                if child is None:
                    copies[j][i]._modules[key] = None
                else:
                    setattr(copies[j][i], key, copies[j][index[child]])
        for table, copy in (("_parameters", copy_param), ("_buffers", copy_buffer)):
            for key, tensor in getattr(m, table).items():
                for j in range(num_replicas):
                    replica = copies[j][i]
                    if tensor is None:
                        getattr(replica, table)[key] = None
                        continue
                    if id(tensor) not in copied:
                        copied[id(tensor)] = [copy(k, tensor) for k in range(num_replicas)]
                    setattr(replica, key, copied[id(tensor)][j])
                    if table == "_parameters":  # what DataParallel's replicas list as parameters
                        replica._former_parameters[key] = copied[id(tensor)][j]
    return [copies[j][0] for j in range(num_replicas)]


# --------------------------------------------------------------------------- parallel_apply


def parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[Any],
    kwargs_tup: Sequence[dict] | None = None,
    devices: Sequence[Any] | None = None,
) -> list[Any]:
    """Run ``replicas[i](*inputs[i], **kwargs_tup[i])``, each in its own thread.

    If a replica raises, the exception is raised here, with the device it came from and the
    replica's own traceback in its message.
    """
    if len(replicas) != len(inputs):
        raise ValueError(f"{len(replicas)} replicas but {len(inputs)} inputs: they must match")
    if kwargs_tup is None:
        kwargs_tup = ({},) * len(replicas)
    if len(kwargs_tup) != len(replicas):
        raise ValueError(f"{len(replicas)} replicas but {len(kwargs_tup)} kwargs dicts")
    names = [str(d) for d in parse_devices(devices)] if devices is not None else None
    if names is not None and len(names) != len(replicas):
        raise ValueError(f"{len(replicas)} replicas but {len(names)} devices")
    if names is not None and not names[0].startswith("sim"):
        return torch.nn.parallel.parallel_apply(
            list(replicas), list(inputs), list(kwargs_tup), [int(n.split(":")[1]) for n in names])
    names = names or [f"replica {i}" for i in range(len(replicas))]

    grad_enabled = torch.is_grad_enabled()
    autocast = torch.is_autocast_enabled("cpu")
    autocast_dtype = torch.get_autocast_dtype("cpu")
    results: list[Any] = [None] * len(replicas)
    errors: list[tuple[BaseException, str] | None] = [None] * len(replicas)

    def worker(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled), torch.autocast(
                "cpu", dtype=autocast_dtype, enabled=autocast
            ):
                args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)
                results[i] = replicas[i](*args, **kwargs_tup[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
            errors[i] = (exc, traceback.format_exc())

    if len(replicas) == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(i,), name=f"replica-{i}-{names[i]}")
                   for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, err in enumerate(errors):
        if err is not None:
            exc, tb = err
            message = (f"Caught {type(exc).__name__} in replica {i} on device {names[i]}.\n"
                       f"Original traceback:\n{tb}")
            try:
                new = type(exc)(message)
            except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                new = RuntimeError(message)
            raise new from None
    return results


# --------------------------------------------------------------------------- gather


def gather(outputs: Sequence[Any], output_device: Any, dim: int = 0) -> Any:
    """Concatenate the replicas' outputs along ``dim`` on ``output_device``.

    Walks tuples, lists, dicts and namedtuples; ``None`` stays ``None``. When every output is a
    0-dim tensor and ``dim == 0`` the scalars become a vector, with the same warning PyTorch
    gives: the "loss" you get back is one value per replica, not one number.
    """
    if not isinstance(outputs, Sequence) or len(outputs) == 0:
        raise ValueError("outputs must be a non-empty list, one entry per replica")
    dim = check_int("dim", dim)
    on_cpu = all(t.device.type == "cpu" for t in tensors_in(list(outputs)))
    to_cpu = output_device in (-1, "cpu") or (
        isinstance(output_device, torch.device) and output_device.type == "cpu")
    if not on_cpu:
        target = "cpu" if to_cpu else parse_device(output_device).index
        result = torch.nn.parallel.gather(outputs, target, dim)
        note_memory("cpu" if to_cpu else parse_device(output_device), "outputs", result)
        return result
    if output_device is not None and not to_cpu:
        output_device = parse_device(output_device)  # validates 'sim:N' and friends

    def gather_map(outs: Sequence[Any]) -> Any:
        out = outs[0]
        if isinstance(out, torch.Tensor):
            if all(t.dim() == 0 for t in outs) and dim == 0:
                warnings.warn(
                    "Was asked to gather along dimension 0, but all input tensors were "
                    "scalars; will instead unsqueeze and return a vector.",
                    stacklevel=3,
                )
                outs = [t.view(1) for t in outs]
            ndim = max(out.dim(), 1)
            if not -ndim <= dim < ndim:
                raise ValueError(f"dim={dim} is out of range for outputs with {out.dim()} "
                                 f"dimension(s): expected a dim in [{-ndim}, {ndim - 1}]")
            return torch.cat(list(outs), dim)
        if out is None:
            return None
        if isinstance(out, dict):
            if not all(len(out) == len(d) for d in outs):
                raise ValueError("All dicts must have the same number of keys")
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs, strict=True)))
        if isinstance(out, (list, tuple)):
            return type(out)(map(gather_map, zip(*outs, strict=True)))
        raise TypeError(f"cannot gather outputs of type {type(out).__name__}")

    result = gather_map(outputs)
    note_memory("cpu" if to_cpu else (output_device or "sim:0"), "outputs", result)
    return result


# --------------------------------------------------------------------------- the whole step


def data_parallel(
    module: nn.Module,
    inputs: Any,
    device_ids: Sequence[Any],
    output_device: Any = None,
    dim: int = 0,
    module_kwargs: dict | None = None,
    *,
    strict: bool = True,
) -> Any:
    """One data-parallel forward: scatter, replicate, parallel_apply, gather.

    The function that the tutorial's Chinese edition and the Korean article write from
    ``torch.nn.parallel``'s primitives, runnable on simulated devices too. Unlike PyTorch's, an
    empty ``device_ids`` is an error rather than "run on one device", and (with ``strict=True``)
    so is a batch with fewer rows than devices.
    """
    devices = parse_devices(device_ids)
    output = parse_output_device(output_device, devices)
    # region: body
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    scattered, kwargs = scatter_kwargs(inputs, module_kwargs, devices, dim, strict=strict)
    if not scattered:
        scattered, kwargs = ((),), ({},)
    used = devices[: len(scattered)]
    replicas = replicate(module, used, detach=not torch.is_grad_enabled())
    outputs = parallel_apply(replicas, scattered, kwargs, used)
    return gather(outputs, output, dim)
    # endregion


class DataParallelByHand(nn.Module):
    """``nn.DataParallel`` rebuilt from the four primitives, on real or simulated devices.

    Same constructor, same ``module.`` prefix in its ``state_dict``, same forward. Like
    ``nn.DataParallel`` it tolerates a batch smaller than the device count (``strict=False``).
    """

    def __init__(self, module: nn.Module, device_ids: Sequence[Any], output_device: Any = None,
                 dim: int = 0) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.module = module
        self.device_ids = parse_devices(device_ids)
        self.output_device = parse_output_device(output_device, self.device_ids)
        self.dim = check_int("dim", dim)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if len(self.device_ids) == 1:
            scattered, kw = scatter_kwargs(inputs, kwargs, self.device_ids, self.dim, strict=False)
            return self.module(*scattered[0], **kw[0])
        return data_parallel(self.module, inputs, self.device_ids, self.output_device, self.dim,
                             kwargs or None, strict=False)

    def extra_repr(self) -> str:
        return f"device_ids={[str(d) for d in self.device_ids]}, output_device={self.output_device}"
