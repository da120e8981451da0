"""Mixed precision with ``torch.amp``, the successor of NVIDIA Apex's ``amp`` (notebook 07).

``amp`` names used across the course: ``"off"`` (fp32), ``"bf16"`` (bfloat16 autocast: fp32's
range, no loss scaling needed; runs on CPUs and recent GPUs) and ``"fp16"`` (float16 autocast
with a ``GradScaler``, the classic GPU recipe, which PyTorch also runs on the CPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["AMP_MODES", "autocast", "grad_scaler", "output_dtypes", "train_step"]

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


def train_step(model: nn.Module, loss_fn: Callable, inputs: torch.Tensor, targets: torch.Tensor,
               optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, amp: str = "off",
               device_type: str = "cpu") -> torch.Tensor:
    """One optimizer step in ``amp`` mode, the course's one AMP step (notebooks 05, 07, 10); returns the loss.

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
