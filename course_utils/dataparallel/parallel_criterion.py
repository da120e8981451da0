"""A parallel criterion: compute the loss where the outputs are (notebook 04).

The fix of the Korean article "PyTorch Multi-GPU 학습 제대로 하기" for DataParallel's GPU-0
imbalance: a model wrapper that does *not* gather its outputs (``DataParallelModel``), and a
criterion that scatters the targets to the devices that hold the outputs, computes each
device's part of the loss there, in parallel, and brings back only the scalars
(``DataParallelCriterion``). The vocabulary-sized logits never meet on one device.

The reduction must be done with care. With ``reduction="mean"``, each device's loss is a mean
over *its* elements; averaging those means counts the rows of a small last chunk more than the
others. This criterion weights each device's mean by its share of the target elements, so the
loss and the gradients equal the plain criterion's for uneven chunks too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .by_hand import DataParallelByHand
from .primitives import parallel_apply, replicate, scatter_kwargs
from .simulated import SimDevice, parse_devices

__all__ = ["DataParallelCriterion", "DataParallelModel"]


class DataParallelModel(DataParallelByHand):
    """``DataParallelByHand`` without the gather: ``forward`` returns one output per device."""

    def forward(self, *inputs: Any, **kwargs: Any) -> list[Any]:
        scattered, kw = scatter_kwargs(inputs, kwargs, self.device_ids, self.dim)
        if len(self.device_ids) == 1:
            return [self.module(*scattered[0], **kw[0])]
        used = self.device_ids[: len(scattered)]
        replicas = replicate(self.module, used, detach=not torch.is_grad_enabled())
        return parallel_apply(replicas, scattered, kw, used)


class DataParallelCriterion(nn.Module):
    """Apply ``criterion`` on every device to its outputs and its share of the targets.

    ``forward(outputs, targets)`` takes the list that ``DataParallelModel`` returns. The targets
    are cut to the same sizes as the outputs along ``dim``. The per-device losses are reduced on
    ``output_device`` (the first device by default): summed for ``reduction="sum"``, weighted
    by each device's share of the target elements for ``"mean"``.

    ``reduction`` defaults to ``criterion.reduction``; pass it for a plain function. A mean that
    does not count every target element once (class weights, ``ignore_index`` hits) cannot be
    reassembled from per-device means: use ``reduction="sum"`` and divide yourself.
    """

    def __init__(self, criterion: Callable[..., torch.Tensor], device_ids: Sequence[Any],
                 dim: int = 0, reduction: str | None = None, output_device: Any = None) -> None:
        super().__init__()
        if not callable(criterion):
            raise TypeError(f"criterion must be callable, got {type(criterion).__name__}")
        reduction = reduction or getattr(criterion, "reduction", None)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum' (from the criterion or given), "
                             f"got {reduction!r}")
        if reduction == "mean" and getattr(criterion, "weight", None) is not None:
            raise ValueError("a class-weighted mean cannot be rebuilt from per-device means: "
                             "use reduction='sum' and divide by the total weight yourself")
        self.criterion = criterion
        self.device_ids = parse_devices(device_ids)
        self.output_device = self.device_ids[0] if output_device is None else parse_devices(
            [output_device])[0]
        self.dim = dim
        self.reduction = reduction

    def forward(self, outputs: Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        if not isinstance(outputs, (list, tuple)) or not outputs:
            raise TypeError("outputs must be the non-empty list that DataParallelModel returns")
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a tensor, got {type(targets).__name__}")
        sizes = [o.shape[self.dim] for o in outputs]
        if sum(sizes) != targets.shape[self.dim]:
            raise ValueError(f"the outputs hold {sum(sizes)} rows along dim={self.dim} but the "
                             f"targets hold {targets.shape[self.dim]}")
        ignore = getattr(self.criterion, "ignore_index", None)
        if self.reduction == "mean" and ignore is not None and bool((targets == ignore).any()):
            raise ValueError(f"targets contain ignore_index={ignore}: a mean over the remaining "
                             "elements cannot be rebuilt from per-device means; use "
                             "reduction='sum' and divide by the count yourself")
        devices = self.device_ids[: len(outputs)]
        pieces = self._scatter_targets(targets, sizes, devices)
        criterion = self.criterion
        if isinstance(criterion, nn.Module) and any(True for _ in criterion.parameters()):
            criteria = replicate(criterion, devices)
        else:
            criteria = [criterion] * len(outputs)
        losses = parallel_apply(criteria, list(zip(outputs, pieces, strict=True)), None, devices)
        total_elements = targets.numel()
        reduced = None
        for loss, piece in zip(losses, pieces, strict=True):
            part = loss.to(self._torch_device(self.output_device))
            if self.reduction == "mean":
                part = part * (piece.numel() / total_elements)
            reduced = part if reduced is None else reduced + part
        return reduced

    def _scatter_targets(self, targets: torch.Tensor, sizes: list[int], devices: list) -> list:
        if isinstance(devices[0], SimDevice):
            chunks = torch.split(targets, sizes, dim=self.dim)
            return [c if i == 0 else c.clone() for i, c in enumerate(chunks)]
        from torch.nn.parallel import comm

        return list(comm.scatter(targets, [d.index for d in devices], chunk_sizes=sizes,
                                 dim=self.dim))

    @staticmethod
    def _torch_device(device: Any) -> torch.device:
        return torch.device("cpu") if isinstance(device, SimDevice) else device
