"""Judges of the exercises of notebook 04 (output_device and the GPU-0 memory imbalance);
their content is in nb04.toml."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .core import load_bank, untimed

__all__ = ["EXERCISES"]

MiB = 2**20


@functools.cache
def _bert_extra_mib(optimizer: str) -> float:
    """How many MiB more device 0 holds than device 1: BERT-base-like, batch 32, 4 devices, plain DP."""
    from ..memory import ModelSpec, ledger

    spec = ModelSpec.bert_like(vocab=30522, hidden=768, layers=12, heads=12, intermediate=3072, seq_len=128)
    led = ledger(spec, "dp", batch_size=32, num_devices=4, optimizer=optimizer)
    return (led.total(0) - led.total(1)) / MiB


def _judge_sgd_extra(answer: Any) -> str | None:
    if not isinstance(answer, (int, float)) or isinstance(answer, bool):
        return f"write a number of MiB, not {type(answer).__name__}"
    with untimed():  # the course's ledger measures the model once (seconds), not the answer
        right, adam = _bert_extra_mib("sgd"), _bert_extra_mib("adam")
    logits = 32 * 128 * 30522 * 4 / MiB

    def near(value: float) -> bool:
        return math.isclose(answer, value, rel_tol=0.02)

    if near(right):
        return None
    if near(adam):
        return ("that is the Adam figure: plain SGD keeps no state per parameter, so the optimizer "
                "state line goes away")
    if near(right + 2 * 132.1e6 * 4 / MiB) or answer > right * 1.5:
        return "too much: without Adam's two moments, only the batch-sized tensors on device 0 are left"
    if near(logits):
        return ("you counted the gathered logits only; backward starts with a gradient of the same size, "
                "and cross-entropy keeps its log-probabilities for backward, both on device 0")
    if near(2 * logits):
        return "one more tensor of the logits' size: cross-entropy keeps its log-probabilities for backward"
    if answer <= 0:
        return "device 0 still gathers the outputs and computes the loss: those tensors are on it alone"
    return "add up the lines of the explanation that are batch-sized (batch × seq × vocabulary floats)"


def _judge_visible(answer: Any) -> str | None:
    if not isinstance(answer, int) or isinstance(answer, bool):
        return f"write a whole number of GPUs, not {type(answer).__name__}"
    if answer == 8:
        return None
    if answer == 2:
        return ("the variable was set after the tensor was put on a GPU: CUDA had already started and "
                "read the variable once, so changing it now changes nothing")
    if answer == 0:
        return "no GPU disappears: the script made no GPU invisible before CUDA started"
    if answer == 1:
        return "device_count() counts the GPUs CUDA can see, not the ones that hold a tensor"
    return "CUDA numbers the GPUs it saw when it started, and the script set nothing before that"


def _judge_combine(answer: Any) -> str | None:
    torch.manual_seed(0)
    outputs, targets = torch.randn(10, 3), torch.randint(0, 3, (10,))
    sizes = [4, 4, 2]
    for reduction in ("mean", "sum"):
        criterion = torch.nn.CrossEntropyLoss(reduction=reduction)
        losses = [criterion(o, t) for o, t in zip(outputs.split(sizes), targets.split(sizes), strict=True)]
        got = answer(losses, sizes, reduction)
        if not isinstance(got, torch.Tensor) or got.dim() != 0:
            return "return the loss as a 0-dim tensor (so that backward can start from it)"
        want = criterion(outputs, targets)
        if torch.allclose(got, want, atol=1e-6):
            continue
        if torch.allclose(got, torch.stack(losses).mean(), atol=1e-6):
            if reduction == "mean":
                return ("you averaged the chunk losses without weighting them by chunk size: the chunk "
                        "of 2 rows counts as much as a chunk of 4")
            return "with reduction='sum' each device's loss is already a sum: add them, do not average"
        if reduction == "sum":
            return ("with reduction='sum' each device's loss is already a sum over its rows: weighting "
                    "it again counts its rows twice")
        weighted = sum(loss * size for loss, size in zip(losses, sizes, strict=True))
        if torch.allclose(got, weighted, atol=1e-6):
            return ("weighted by the chunk sizes, that is the sum over rows; a mean divides it by the "
                    "batch size")
        return (f"with reduction={reduction!r} and chunks {sizes}, the result differs from the plain "
                "criterion's")
    return None


EXERCISES = load_bank(__name__)
