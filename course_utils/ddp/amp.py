"""Mixed precision with ``torch.amp``, the successor of NVIDIA Apex's ``amp`` (notebook 08).

``amp`` names used across the course: ``"off"`` (fp32), ``"bf16"`` (bfloat16 autocast: fp32's
range, no loss scaling needed; runs on CPUs and recent GPUs) and ``"fp16"`` (float16 autocast
with a ``GradScaler``, the classic GPU recipe, which PyTorch also runs on the CPU).
``scaler_steps`` records what every ``GradScaler`` decides, step by step, inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["AMP_MODES", "ScalerStep", "autocast", "grad_scaler", "output_dtypes", "scaler_steps",
           "train_step"]

AMP_MODES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check(amp: str) -> torch.dtype | None:
    if amp not in AMP_MODES:
        raise ValueError(f"amp must be one of {sorted(AMP_MODES)}, got {amp!r}")
    return AMP_MODES[amp]


def autocast(amp: str, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``amp`` on ``device_type``; a no-op context for ``"off"``."""
    dtype = _check(amp)
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def grad_scaler(amp: str, device_type: str = "cpu") -> torch.amp.GradScaler:
    """A ``GradScaler`` that scales only for ``"fp16"`` (bf16 and fp32 do not underflow)."""
    dtype = _check(amp)
    return torch.amp.GradScaler(device_type, enabled=dtype is torch.float16)


class ScalerStep(NamedTuple):
    """One ``GradScaler.update()``: the scale the step ran with and the one the next step gets."""

    step: int
    scale: float
    next_scale: float

    @property
    def skipped(self) -> bool:
        """The scaler found inf or nan in the scaled gradients, skipped the optimizer step and
        lowered the scale (an update lowers it for nothing else)."""
        return self.next_scale < self.scale


@contextlib.contextmanager
def scaler_steps(init_scale: float | None = None) -> Iterator[list[ScalerStep]]:
    """Record every enabled ``torch.amp.GradScaler``'s updates while the block runs, in order.

    With ``init_scale``, every scaler created in the block starts from that scale instead of the
    one it asks for (2**16 by default): a run of the same training whose first step does not
    overflow. Counted per scaler from 0; a disabled scaler (bf16, fp32) records nothing.
    """
    if init_scale is not None and not (isinstance(init_scale, (int, float)) and init_scale > 0):
        raise ValueError(f"init_scale must be a positive number or None, got {init_scale!r}")
    steps: list[ScalerStep] = []
    counts: dict[int, int] = {}
    cls = torch.amp.GradScaler
    real_init, real_update = cls.__init__, cls.update

    def init(self, *args, **kwargs):
        if init_scale is not None:  # as if the caller had asked for it
            bound = inspect.signature(real_init).bind(self, *args, **kwargs)
            bound.arguments["init_scale"] = float(init_scale)
            args, kwargs = bound.args[1:], bound.kwargs
        real_init(self, *args, **kwargs)

    def update(self, new_scale=None):
        if not self.is_enabled():
            return real_update(self, new_scale)
        before = self.get_scale()
        real_update(self, new_scale)
        step = counts[id(self)] = counts.get(id(self), -1) + 1
        steps.append(ScalerStep(step, before, self.get_scale()))

    cls.__init__, cls.update = init, update
    try:
        yield steps
    finally:
        cls.__init__, cls.update = real_init, real_update


def train_step(model: nn.Module, loss_fn: Callable, inputs: torch.Tensor, targets: torch.Tensor,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, amp: str = "off",
               device_type: str = "cpu") -> torch.Tensor:
    """One optimizer step in ``amp`` mode, the course's one AMP step (notebooks 05, 08, 11); returns the loss.

    The forward and the loss run under autocast, the backward outside it; ``scaler`` scales the
    loss for fp16 and is a pass-through otherwise (``grad_scaler``), so the same four lines train
    in fp32, bf16 and fp16. Under DDP the gradients are all-reduced during ``backward``.
    """
    # region: step
    with autocast(amp, device_type):
        loss = loss_fn(model(inputs), targets)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # skipped if fp16 gradients overflowed
    scaler.update()
    # endregion
    return loss


def output_dtypes(model: nn.Module, inputs: torch.Tensor, amp: str, device_type: str = "cpu",
                  loss_fn: Callable | None = None, target: torch.Tensor | None = None
                  ) -> list[tuple[str, str, torch.dtype]]:
    """Run ``model`` under autocast and report each leaf module's output dtype (and the loss's).

    Returns ``(name, type, dtype)`` rows in the order the modules ran.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"inputs must be a tensor, got {type(inputs).__name__}")
    rows: list[tuple[str, str, torch.dtype]] = []
    hooks = []
    for name, module in model.named_modules():
        if not list(module.children()):
            hooks.append(module.register_forward_hook(
                lambda m, i, o, name=name: rows.append((name, type(m).__name__, o.dtype))))
    try:
        with autocast(amp, device_type):
            out = model(inputs)
            if loss_fn is not None:
                loss = loss_fn(out, target)
                rows.append(("loss", getattr(loss_fn, "__name__", type(loss_fn).__name__),
                             loss.dtype))
    finally:
        for h in hooks:
            h.remove()
    return rows
