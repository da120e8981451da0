"""Judges of the exercises of notebook 04 (output_device and the GPU-0 memory imbalance);
their content is in nb04.toml."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .answers import NOT_A_NUMBER, reals, whole
from .core import changed, load_bank, snapshot, untimed

__all__ = ["CASES", "EXERCISES"]

#: 04.3's (chunk sizes, reduction): uneven chunks, several of them, one device alone
_COMBINE = [([4, 4, 2], "mean"), ([4, 4, 2], "sum"), ([3, 3, 3, 3, 1], "mean"), ([3, 3, 3, 3, 1], "sum"),
            ([7], "mean"), ([2, 5], "mean")]

#: 04.1's device counts: a rule that grows or shrinks with them agrees with the right one at 4
_DEVICES = (4, 8)

CASES: dict[str, list[str]] = {
    "04.1": [f"BERT-base-like, batch 32, {n} devices, plain SGD" for n in _DEVICES],
    "04.2": ["CUDA_VISIBLE_DEVICES set after CUDA started, 8 GPUs",
             "CUDA_VISIBLE_DEVICES set before CUDA started, 8 GPUs"],
    "04.3": [f"chunks of {sizes} rows, reduction={reduction!r}" for sizes, reduction in _COMBINE],
}

MiB = 2**20


@functools.cache
def _bert_spec() -> Any:
    """The BERT-base-like model's spec, measured once (a quarter of a second) for every ledger below."""
    from ..dataparallel.memory import ModelSpec

    return ModelSpec.bert_like(vocab=30522, hidden=768, layers=12, heads=12, intermediate=3072, seq_len=128)


@functools.cache
def _bert_extra_mib(optimizer: str, devices: int = 4) -> float:
    """How many MiB more device 0 holds than device 1: BERT-base-like, batch 32, plain DP."""
    from ..dataparallel.memory import ledger

    led = ledger(_bert_spec(), "dp", batch_size=32, num_devices=devices, optimizer=optimizer)
    return (led.total(0) - led.total(1)) / MiB


def _judge_sgd_extra(answer: Any) -> str | None:
    values = reals(answer, 2)
    if values is None:
        return ("write a pair of numbers of MiB: (device 0's extra with 4 devices, with 8 devices); "
                + NOT_A_NUMBER)
    with untimed():  # the course's ledger measures the model once (seconds), not the answer
        right = [_bert_extra_mib("sgd", n) for n in _DEVICES]
        adam = [_bert_extra_mib("adam", n) for n in _DEVICES]
        momentum = [_bert_extra_mib("sgd_momentum", n) for n in _DEVICES]
    logits = 32 * 128 * 30522 * 4 / MiB
    for value, good, with_adam, with_momentum, n in zip(values, right, adam, momentum, _DEVICES,
                                                        strict=True):
        hint = _sgd_extra_hint(value, good, with_adam, with_momentum, logits)
        if hint:
            return hint if n == _DEVICES[0] else f"with {n} devices: {hint}"
    return None


def _sgd_extra_hint(answer: float, right: float, adam: float, momentum: float, logits: float) -> str | None:
    def near(value: float) -> bool:
        return math.isclose(answer, value, rel_tol=0.02)

    if near(right):
        return None
    if near(adam):
        return ("that is the Adam figure: plain SGD keeps no state per parameter, so the optimizer "
                "state line goes away")
    if near(momentum):
        return ("that would be SGD with momentum, which keeps one buffer per parameter; plain SGD "
                "keeps none")
    if near(right * MiB) or near(right * 1.048576):
        return "write it in MiB (2**20 bytes), the unit of the ledger's lines"
    if near(right / 1024):
        return "that is in GiB: the question asks for MiB"
    if answer > right * 1.5:
        return ("too much: without Adam's two moments, only the batch-sized tensors on device 0 are "
                "left, and gathering the whole batch on device 0 does not grow with the devices")
    if near(logits):
        return ("you counted the gathered logits only: steps 4 and 5 of the explanation leave more "
                "batch-sized tensors than the outputs on device 0")
    if near(2 * logits):
        return "one batch-sized tensor is missing: re-read what the loss keeps for backward"
    if answer <= 0:
        return "device 0 still gathers the outputs and computes the loss: those tensors are on it alone"
    if answer < right:
        return ("too little: device 1 holds none of the batch-sized tensors of the loss (the outputs "
                "are gathered, and the loss computed, on device 0), whatever share of the batch it ran")
    return ("add up the lines of the explanation that only device 0 holds and that a plain SGD step "
            "still needs")


def _judge_visible(answer: Any) -> str | None:
    wrong = "write a pair of whole numbers of GPUs: (the script as shown, with its middle lines swapped)"
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        return wrong
    after, before = (whole(a) for a in answer)
    if after is None or before is None:
        return wrong
    if after != 8:
        if after == 2:
            return ("look at the order of the lines: when does CUDA read CUDA_VISIBLE_DEVICES, and "
                    "what has happened by the time the script sets it?")
        if after == 0:
            return "no GPU disappears: the script made no GPU invisible before CUDA started"
        if after == 1:
            return "device_count() counts the GPUs CUDA can see, not the ones that hold a tensor"
        return "CUDA numbers the GPUs it saw when it started, and the script set nothing before that"
    if before != 2:
        if before == 8:
            return ("with the lines swapped, the variable is set before the tensor starts CUDA: a "
                    "variable set in time does decide which GPUs CUDA sees")
        if before == 1:
            return "device_count() counts the GPUs CUDA can see, not the ones that hold a tensor"
        return ("with the lines swapped, CUDA starts after the variable is set: count the GPUs "
                "the variable leaves visible")
    return None


def _criterion_case(sizes: list[int], reduction: str, seed: int) -> tuple[list, torch.Tensor, list]:
    """Per-device losses of CrossEntropyLoss over ``sizes`` chunks, and the plain loss with its gradient."""
    g = torch.Generator().manual_seed(seed)
    outputs = torch.randn(sum(sizes), 3, generator=g, requires_grad=True)
    targets = torch.randint(0, 3, (sum(sizes),), generator=g)
    criterion = torch.nn.CrossEntropyLoss(reduction=reduction)
    want = criterion(outputs, targets)
    (want_grad,) = torch.autograd.grad(want, outputs)
    losses = [criterion(o, t) for o, t in zip(outputs.split(sizes), targets.split(sizes), strict=True)]
    return losses, want.detach(), [outputs, want_grad]


def _judge_combine(answer: Any) -> str | None:
    for sizes, reduction in _COMBINE:
        with untimed():  # the course's reference: only the answer's own time counts
            losses, want, (outputs, want_grad) = _criterion_case(sizes, reduction, seed=len(sizes))
            given = [losses, list(sizes)]
            before = snapshot(given)
        got = answer(*given, reduction)
        if changed(given, before):
            return ("the losses or chunk sizes you were given changed in place: the caller still holds "
                    "them, so build the result from new values and leave them as they were")
        if not isinstance(got, torch.Tensor) or got.dim() != 0:
            return "return the loss as a 0-dim tensor (so that backward can start from it)"
        if torch.allclose(got, want, atol=1e-6):
            if not got.requires_grad:
                return ("the value is right, but backward cannot start from it: the result lost its "
                        "link to the per-device losses (a Python number, or .item(), breaks it)")
            (grad,) = torch.autograd.grad(got, outputs)  # the answer's graph: its time is the answer's
            if not torch.allclose(grad, want_grad, atol=1e-6):
                return "the value is right, but its gradient is not the plain criterion's"
            continue
        if torch.allclose(got, torch.stack(losses).mean(), atol=1e-6):
            if reduction == "mean":
                return ("you averaged the chunk losses without weighting them by chunk size: a short "
                        "chunk counts as much as a full one")
            return "with reduction='sum' each device's loss is already a sum: add them, do not average"
        if reduction == "sum":
            return ("with reduction='sum' each device's loss is already a sum over its rows: weighting "
                    "it again counts its rows twice")
        weighted = sum(loss * size for loss, size in zip(losses, sizes, strict=True))
        if torch.allclose(got, weighted, atol=1e-6):
            return ("weighted by the chunk sizes, that is the sum over rows; a mean divides it by the "
                    "rows of the whole batch")
        if torch.allclose(got * 10, weighted, atol=1e-5):
            return (f"right for a batch of 10, wrong for chunks {sizes}: the batch's size comes from "
                    "the chunk sizes you are given")
        return (f"with reduction={reduction!r} and chunks {sizes}, the result differs from the plain "
                "criterion's")
    return None


EXERCISES = load_bank(__name__)
