"""Judges of the exercises of notebook 01 (one device); their content is in nb01.toml."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .answers import reals, whole
from .core import changed, load_bank, snapshot, untimed

__all__ = ["CASES", "EXERCISES"]

#: 01.1's (index, gpu_count): no GPU at all, a GPU that exists, an index past the last GPU
_NO_GPU, _EXISTS = [(0, 0), (3, 0)], [(0, 1), (1, 2), (3, 4)]
_MISSING = [(2, 1), (1, 1), (4, 4), (-1, 2), (7, 3)]
#: 01.3's targets: two dtypes and a device (the meta device, which every machine has), twice named
_TARGETS = [("torch.float64", torch.float64), ("torch.bfloat16", torch.bfloat16),
            ("torch.device('meta')", torch.device("meta")), ("'meta' (a device named by a string)", "meta")]
#: 01.2's calls, numbered from 1 as in the question
_CALLS = ('x.to(torch.float32)', 'x.to("cpu", torch.float16)', 'x.to("cpu", torch.float32)',
          'x.to("cpu", copy=True)')

CASES: dict[str, list[str]] = {
    "01.1": [f"index={i}, gpu_count={n}" for i, n in _NO_GPU + _EXISTS + _MISSING],
    "01.2": [f"call {i}: {call}, x a float32 CPU tensor" for i, call in enumerate(_CALLS, start=1)],
    "01.3": [f"target={label}, a Linear(3, 1) and a batch of 4 rows" for label, _ in _TARGETS],
}


def _judge_device_name(answer: Any) -> str | None:
    def name(index: int, count: int) -> Any:
        got = answer(index, count)
        return str(got) if isinstance(got, torch.device) else got  # a torch.device is fine too

    for index, count in _NO_GPU:
        if name(index, count) != "cpu":
            return "with no GPU at all (gpu_count == 0), the only device there is is 'cpu'"
    for index, count in _EXISTS:
        got = name(index, count)
        if got != f"cuda:{index}":
            return f"device_name({index}, {count}) gave {got!r}: there are {count} GPUs, so that one exists"
    for index, count in _MISSING:
        try:
            got = name(index, count)
        except ValueError as err:
            if str(count) not in str(err):
                return (f"device_name({index}, {count}) raised a ValueError that does not say how many GPUs "
                        "there are: the reader needs that to pick one that exists")
            continue
        except Exception as err:  # noqa: BLE001 - the kind of error is what is judged
            return (f"device_name({index}, {count}) raised {type(err).__name__}; the exercise asks for a "
                    "ValueError, the error for a value out of range")
        if index == count:
            return (f"device_name({index}, {count}) gave {got!r}: with {count} GPU(s) numbered from 0, "
                    f"is there a cuda:{index}?")
        if index < 0:
            return f"device_name({index}, {count}) gave {got!r}: a negative index names no GPU"
        return (f"device_name({index}, {count}) gave {got!r}, but with {count} GPU(s) there is no "
                f"cuda:{index}: raise a ValueError that says how many GPUs there are")
    return None


def _returned_x() -> set[int]:
    """The numbers of the calls that hand back x itself, run here."""
    x = torch.zeros(3)
    calls = [x.to(torch.float32), x.to("cpu", torch.float16), x.to("cpu", torch.float32),
             x.to("cpu", copy=True)]
    return {i for i, out in enumerate(calls, start=1) if out is x}


def _judge_same_objects(answer: Any) -> str | None:
    if isinstance(answer, (set, frozenset)):
        answer = sorted(answer, key=str)
    if whole(answer) is not None:
        return ("write which calls return x itself, as a list of their numbers (there are only four "
                "calls, numbered 1 to 4), not how many do")
    numbers = reals(answer) if not isinstance(answer, (str, bytes)) else None
    if numbers is None:
        return ("write the numbers of the calls (1 to 4) that return x itself, as a list such as "
                "[2, 4] (an empty list if none does): whole numbers, not text or True/False")
    if any(not n.is_integer() or not 1 <= n <= len(_CALLS) for n in numbers):
        return f"number the calls as the question does, 1 to {len(_CALLS)}, each a whole number"
    got, right = {int(n) for n in numbers}, _returned_x()
    if got == right:
        return None
    if not got:
        return "when nothing has to change, .to() does no work at all: it hands back the tensor itself"
    if got == set(range(1, len(_CALLS) + 1)):
        return "some of the calls change something, or ask for a copy: those cannot hand back x itself"
    extra = got - right
    if any("copy=True" not in _CALLS[i - 1] for i in extra):
        return ("one of the calls you chose changes x's dtype: it returns a new tensor, even when it "
                "names the device x is already on")
    if extra:
        return "a call that asks for a copy (copy=True) never hands back x itself, even when nothing changes"
    return ("one of the calls you left out asks for nothing new: compare what each call asks for with "
            "what x already is (float32, on the CPU); naming a device or a dtype is not a change")


def _judge_to_target(answer: Any) -> str | None:
    with untimed():  # torch sets the meta device up on first use (seconds): not the answer's time
        nn.Linear(1, 1).to("meta")(torch.zeros(1, 1, device="meta"))
    for label, target in _TARGETS:
        hint = _to_target_case(answer, label, target)
        if hint:
            return hint
    return None


def _to_target_case(answer: Any, label: str, target: Any) -> str | None:
    g = torch.Generator().manual_seed(0)
    model = nn.Linear(3, 1)
    inputs, targets = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
    batch = [inputs, targets]
    given = snapshot(batch)
    is_dtype = isinstance(target, torch.dtype)
    goal = target if is_dtype else torch.device(target)

    def at(t: torch.Tensor) -> Any:
        return t.dtype if is_dtype else t.device

    was = "float32" if is_dtype else "on the CPU"
    try:
        returned = answer(model, inputs, targets, target)
    except (TypeError, RuntimeError) as err:
        if is_dtype:
            raise
        return (f"with target={label} your answer raised {type(err).__name__}: target may be a device as "
                "well as a dtype, and .to() takes either the same way")
    if not (isinstance(returned, (tuple, list)) and len(returned) == 3):
        return "return the three things, in order: (model, inputs, targets)"
    model_out, inputs_out, targets_out = returned
    if not (isinstance(model_out, nn.Module) and isinstance(inputs_out, torch.Tensor)
            and isinstance(targets_out, torch.Tensor)):
        return "return the three things, in order: (model, inputs, targets)"
    if changed(batch, given):
        return ("the tensors you were given changed in place; .to() is meant to leave them as they "
                "were and hand back converted tensors")
    if at(model.weight) != goal:
        if getattr(model_out, "weight", None) is not None and at(model_out.weight) == goal:
            return (f"the model you were given is still {was} (you converted a copy of it): an "
                    "optimizer built before the call would go on training the old parameters")
        if at(model.weight) == at(inputs) and at(inputs_out) == at(inputs):
            return (f"with target={label} nothing moved: .to() follows the same rule for a device as "
                    "for a dtype, and the target can be either")
        if at(model.weight) != at(inputs):
            return (f"with target={label} the model went elsewhere than the target: convert to the "
                    "target you are given, whatever it is")
        return f"the model is still {was}: it has to be converted too"
    if at(inputs_out) != goal:
        return (f"the inputs are still {was}: tensor.to() returns a new tensor and leaves the one "
                "you called it on as it was")
    if at(targets_out) != goal:
        return f"the inputs are right now, but the targets are still {was}: the same rule applies to them"
    if targets_out.shape != targets.shape:
        return (f"the targets that came back (shape {list(targets_out.shape)}) are not the targets you "
                "were given, converted: look for a copy-paste slip")
    if is_dtype and not torch.equal(inputs_out, inputs.to(target)):
        return "the inputs that came back are not the inputs you were given, converted"
    if is_dtype and not torch.equal(targets_out, targets.to(target)):
        return (f"the targets that came back (shape {list(targets_out.shape)}) are not the targets you "
                "were given, converted: look for a copy-paste slip")
    if at(model_out(inputs_out)) != goal:
        return "the model and the batch should end up on the same target"
    return None


EXERCISES = load_bank(__name__)
