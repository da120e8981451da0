"""The four DataParallel primitives for whichever devices they are given (notebooks 03 and 04).

On CUDA devices they hand the work to ``torch.nn.parallel``; on simulated devices they run
``sim_primitives``' (notebook 03). Either way each notes the bytes it leaves on a device for
``record_memory`` (notebook 04), so that notebook 04 can compare the emulation with its
memory ledger: ``scatter_kwargs`` the inputs (the first device holds the whole input, of which its
chunk is a view), ``replicate`` the replicas' parameters, ``gather`` the outputs.
``by_hand.data_parallel``, ``DataParallelByHand`` and the parallel criterion compose these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel.scatter_gather import scatter_kwargs as _torch_scatter_kwargs

from . import sim_primitives
from .simulated import Device, SimDevice, note_memory, recording, tensors_in

__all__ = ["gather", "parallel_apply", "replicate", "scatter_kwargs"]


def _on_gpus(devices: Sequence[Device]) -> bool:
    return not isinstance(devices[0], SimDevice)


def scatter_kwargs(inputs: tuple, kwargs: dict | None, devices: Sequence[Device],
                   dim: int = 0) -> tuple[tuple, tuple]:
    """``(inputs_per_device, kwargs_per_device)``, noting each device's share of the inputs."""
    if _on_gpus(devices):
        scattered = _torch_scatter_kwargs(inputs, kwargs, [d.index for d in devices], dim)
        for device, args, kw in zip(devices, *scattered, strict=False):
            note_memory(device, "inputs", (args, kw), whole_storage=True)  # a view: its storage
        return scattered
    scattered = sim_primitives.scatter_kwargs(inputs, kwargs, devices, dim)
    note_memory(devices[0], "inputs", (inputs, kwargs))  # its chunk is a view of the whole input
    for device, args, kw in zip(devices[1:], scattered[0][1:], scattered[1][1:], strict=False):
        note_memory(device, "inputs", (args, kw))
    return scattered


def replicate(module: nn.Module, devices: Sequence[Device], detach: bool = False) -> list[nn.Module]:
    """One copy of ``module`` per device, noting each replica's parameters."""
    if _on_gpus(devices):
        replicas = torch.nn.parallel.replicate(module, [d.index for d in devices], detach)
    else:
        replicas = sim_primitives.replicate(module, devices, detach)
    if recording():
        for device, replica in zip(devices, replicas, strict=True):
            unique = {id(t): t for m in replica.modules() for t in m._former_parameters.values()
                      if t is not None}
            note_memory(device, "parameters", list(unique.values()))
    return replicas


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict] | None, devices: Sequence[Device]) -> list[Any]:
    """Each replica on its inputs, in a thread of its own."""
    if _on_gpus(devices):
        return torch.nn.parallel.parallel_apply(list(replicas), list(inputs), kwargs_tup,
                                                [d.index for d in devices])
    return sim_primitives.parallel_apply(replicas, inputs, kwargs_tup, devices)


def gather(outputs: Sequence[Any], output_device: Device, dim: int = 0) -> Any:
    """The outputs concatenated on ``output_device`` (a parsed device, or the CPU), noted there."""
    to_cpu = output_device.type == "cpu"
    if any(t.device.type == "cuda" for t in tensors_in(outputs)):
        result = torch.nn.parallel.gather(outputs, "cpu" if to_cpu else output_device.index, dim)
    else:
        result = sim_primitives.gather(outputs, output_device, dim)
    note_memory(output_device, "outputs", result)
    return result

