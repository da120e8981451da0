"""Judges of the exercises of notebook 01 (one device); their content is in nb01.toml."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .core import load_bank

__all__ = ["EXERCISES"]


def _judge_same_objects(answer: Any) -> str | None:
    if not isinstance(answer, int) or isinstance(answer, bool):
        return f"write a whole number of calls (0 to 4), not {type(answer).__name__}"
    x = torch.zeros(3)
    calls = [x.to("cpu"), x.to(torch.float32), x.to("cpu", torch.float16), x.to("cpu", copy=True)]
    right = sum(out is x for out in calls)
    if answer == right:
        return None
    if answer == 0:
        return "when nothing has to change, .to() does no work at all: it hands back the tensor itself"
    if answer == 1:
        return ("asking for the dtype a tensor already has is no change either: count "
                "x.to(torch.float32) with x.to('cpu')")
    if answer == 3:
        return ("one of the three you counted makes a new tensor: copy=True copies even when nothing "
                "changes, and float16 is a change")
    if answer == 4:
        return "a dtype change (float16) needs new storage, and copy=True always copies"
    return "there are only four calls; count those that return the very object x"


def _judge_to_target(answer: Any) -> str | None:
    model = nn.Linear(3, 1)
    inputs, targets = torch.ones(4, 3), torch.zeros(4, 1)
    returned = answer(model, inputs, targets, torch.float64)
    if not (isinstance(returned, tuple) and len(returned) == 3):
        return "return the three things, in order: (model, inputs, targets)"
    model_out, inputs_out, targets_out = returned
    if model_out.weight.dtype != torch.float64:
        return "the model did not change: call .to(target) on it"
    if inputs_out.dtype != torch.float64:
        return ("the inputs are still float32: tensor.to() returns a new tensor and leaves the one "
                "you called it on as it was, so keep what it returns")
    if targets_out.dtype != torch.float64:
        return "the inputs are right now, but the targets are still float32: the same rule applies to them"
    if model_out(inputs_out).dtype != torch.float64:
        return "the model and the batch should end up on the same target"
    return None


def _judge_device_name(answer: Any) -> str | None:
    if answer(0, 0) != "cpu" or answer(3, 0) != "cpu":
        return "with no GPU at all (gpu_count == 0), the only device there is is 'cpu'"
    for index, count in [(0, 1), (1, 2), (2, 4)]:
        got = answer(index, count)
        if got != f"cuda:{index}":
            return f"device_name({index}, {count}) gave {got!r}: there are {count} GPUs, index {index} exists"
    try:
        got = answer(2, 1)
    except ValueError as err:
        if "1" not in str(err):
            return "the ValueError should say how many GPUs there are, so the reader can pick one that exists"
        return None
    return (f"device_name(2, 1) gave {got!r}, but with one GPU there is no cuda:2: "
            "raise a ValueError that says how many GPUs there are")


EXERCISES = load_bank(__name__)
