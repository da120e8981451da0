"""DataParallel by hand (notebook 03): the four primitives composed into one forward.

``data_parallel`` and ``DataParallelByHand`` scatter, replicate, apply in parallel and gather,
on simulated devices (``"sim:0"``, ``"sim:1"``, ...) and on real GPUs alike:
``course_utils.dataparallel.primitives`` hands CUDA devices to ``torch.nn.parallel``'s primitives and
simulated ones to ``course_utils.dataparallel.sim_primitives``' (the four steps written out, which this module
re-exports for notebook 03), and notes the bytes each step leaves on a device (notebook 04's
``record_memory``). The primitives do not import this module or the dispatcher, so the imports
run one way: ``by_hand`` -> ``primitives`` -> ``sim_primitives``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._checks import check_int
from . import primitives
from .sim_primitives import gather, parallel_apply, replicate, scatter, scatter_kwargs
from .simulated import check_scatter_sizes, parse_devices, parse_output_device

__all__ = [
    "DataParallelByHand",
    "data_parallel",
    "gather",
    "parallel_apply",
    "replicate",
    "scatter",
    "scatter_kwargs",
]


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
    # these names, here, are primitives': torch.nn.parallel's primitives on GPUs, sim_primitives'
    # on simulated devices; both note memory
    from .primitives import gather, parallel_apply, replicate, scatter_kwargs

    devices = parse_devices(device_ids)
    output = parse_output_device(output_device, devices)
    check_scatter_sizes((inputs, module_kwargs), len(devices), check_int("dim", dim), strict)
    # region: body
    if not isinstance(inputs, tuple):
        inputs = (inputs,)
    scattered, kwargs = scatter_kwargs(inputs, module_kwargs, devices, dim)
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
            scattered, kw = primitives.scatter_kwargs(inputs, kwargs, self.device_ids, self.dim)
            return self.module(*scattered[0], **kw[0])
        return data_parallel(self.module, inputs, self.device_ids, self.output_device, self.dim,
                             kwargs or None, strict=False)

    def extra_repr(self) -> str:
        return f"device_ids={[str(d) for d in self.device_ids]}, output_device={self.output_device}"
