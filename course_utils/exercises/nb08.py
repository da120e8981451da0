"""Judges of the exercises of notebook 08 (mixed precision); their content is in nb08.toml."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .answers import real, whole
from .core import changed, load_bank, reference, snapshot

__all__ = ["CASES", "EXERCISES"]


#: 08.1's values, each stored in its format: a normal fp16 number's neighbour, one between half of
#: fp16's smallest subnormal and that subnormal (the look-alike rule "below the smallest subnormal
#: is zero" says it dies), and one far below bf16's normals that bf16's range still holds
_SURVIVES = ((1e-5, torch.float16), (4e-8, torch.float16), (1e-9, torch.bfloat16))


def _flag(value: Any) -> bool | None:
    """``value`` as a bool when it is one: True/False, NumPy's bool or a 0-d bool tensor."""
    if isinstance(value, bool):
        return value
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if numpy_bool or (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool):
        return bool(value)
    return None


def _judge_survives(answer: Any) -> str | None:
    flags = [_flag(a) for a in answer] if isinstance(answer, (tuple, list)) else []
    if len(flags) != len(_SURVIVES) or None in flags:
        return ("write three True/False: (1e-5 survives in fp16, 4e-8 survives in fp16, 1e-9 "
                "survives in bf16)")
    normal, subnormal, bf16 = ((torch.tensor(v).to(d).item() != 0) for v, d in _SURVIVES)
    if flags[0] != normal:
        return ("1e-5 is below fp16's smallest *normal* number, but that is not the smallest number "
                "fp16 holds: look at the table's subnormal column")
    if flags[1] != subnormal:
        return ("4e-8 is below fp16's smallest subnormal, but a value is rounded to the nearest "
                "number fp16 holds: when is zero the nearest?")
    if flags[2] != bf16:
        return ("bf16's few mantissa bits limit its precision, not its range: compare 1e-9 with "
                "bf16's smallest numbers in the table")
    return None


def _scaled_step_setup() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(8, 4), torch.randn(16, 8), torch.zeros(16, 4)


def _tiny_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) * 1e-8).sum()  # gradients of about 1e-8: below fp16's range


def _huge_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target) * 1e4).sum()  # scaled by 2**16, its gradients overflow fp16


def _fp16_first_steps(answer: Any) -> str | None:
    """Two steps with gradients of about 1e-8 (below fp16's range), at the scale 2**16 and then at
    the scale the first step grew it to."""
    from ..ddp.amp import autocast

    reference_model, inputs, targets = _scaled_step_setup()
    reference_optimizer = torch.optim.SGD(reference_model.parameters(), lr=1e6)
    expected = []
    for _ in range(2):  # two plain fp32 steps
        reference_optimizer.zero_grad()
        with autocast("off"):
            _tiny_loss(reference_model(inputs), targets).backward()
        expected.append(reference_model.weight.grad.clone())
        reference_optimizer.step()

    model, inputs, targets = _scaled_step_setup()
    batch = [inputs, targets]
    given = snapshot(batch)
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e6)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    seen: list[torch.dtype] = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(output.dtype)
        return _tiny_loss(output, target)

    try:
        answer(model, optimizer, scaler, inputs, targets, loss_fn)
    except AssertionError as err:
        if "_scale is None" in str(err):
            return ("the scaler was asked to step, but it never scaled the loss, so it has nothing to "
                    "undo: the gradients must come from the loss the scaler multiplied")
        if "inf checks" not in str(err):
            raise
        return ("the optimizer stepped with gradients still multiplied by the scale, and the scaler "
                "never saw them (update found no inf check): let the scaler step the optimizer")
    if changed(batch, given):
        return "the batch you were given changed in place: a training step only reads it"
    if seen and seen[0] != torch.float16:
        return (f"the forward ran in {str(seen[0]).replace('torch.', '')}: the step is meant to compute "
                "in fp16 under autocast, with the loss scaled so that fp16's gradients survive")
    if model.weight.grad is None:
        return "no gradient reached the weights: the step must run backward"
    grad = model.weight.grad
    scale = 2.0**16  # the scale the step ran with
    if torch.count_nonzero(grad) == 0 or grad.abs().max() < expected[0].abs().max() / 100:
        return ("the gradients came out (almost) zero: in fp16 gradients of about 1e-8 underflow. "
                "Run backward on the loss the scaler has multiplied, not on the loss itself")
    if torch.allclose(grad, expected[0] * scale, rtol=1e-2):
        return ("the step used gradients that are still multiplied by the scale: let the scaler "
                "step the optimizer (it divides the gradients by the scale first, and skips a step "
                "whose gradients overflowed)")
    if not torch.allclose(grad, expected[0], rtol=1e-2, atol=1e-9):
        return "the gradients differ from fp32's: autocast the forward and the loss, nothing else"
    if torch.equal(before, model.weight.detach()):
        return "the gradients are right but the weights did not move: the optimizer must step"
    if not torch.allclose(model.weight.detach(), before - 1e6 * expected[0], rtol=1e-3, atol=1e-5):
        return "the weights moved, but not by one SGD step with the unscaled gradients"
    if scaler.get_scale() != 2 * scale:  # growth_interval=1: a good step, once recorded, doubles it
        return "the step is right, but the scaler was not told about it: update it after the step"

    after_first = model.weight.detach().clone()
    answer(model, optimizer, scaler, inputs, targets, loss_fn)  # a second step, at the doubled scale
    second = model.weight.detach() - after_first
    if not torch.allclose(second, -1e6 * expected[1], rtol=2e-2, atol=1e-5):
        return ("the first step is right, the second is not: the scale changed in between (it grows "
                "after good steps), so a scale written into the code goes stale")
    return None


def _fp16_overflow(answer: Any) -> str | None:
    """A step whose gradients, multiplied by the scale, overflow fp16: skipped, the scale halved."""
    model, inputs, targets = _scaled_step_setup()
    before = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    answer(model, optimizer, scaler, inputs, targets, _huge_loss)
    if not torch.equal(before, model.weight.detach()):
        return ("with gradients that overflowed fp16, your step still changed the weights (to inf or "
                "nan): a step whose gradients overflowed must be skipped, and the scaler knows when")
    if scaler.get_scale() != 2.0**16 / 2:
        return "a step whose gradients overflowed must also lower the scale for the next one"
    return None


_FP16_RUNS = [
    ("two steps with gradients of about 1e-8, from the scale 2**16 (growth_interval=1)", _fp16_first_steps),
    ("one step whose scaled gradients overflow fp16, at the scale 2**16", _fp16_overflow),
]


def _judge_fp16_step(answer: Any) -> str | None:
    for _, run in _FP16_RUNS:
        hint = run(answer)
        if hint:
            return hint
    return None


_ALWAYS = "an overflow changes the scale and the count the same way, whatever the count was"
_GIVEN = "with growth_interval=5 your rule acted as if it were another number: use the one you are given"
#: (scale, good steps so far, found_inf, growth_interval), the right (scale, count), and the hint
#: for a wrong scale and for a wrong count
_SCALE_CASES = [
    ((65536.0, 1, True, 2), (32768.0, 0),
     ("after a step whose gradients overflowed, what must happen to the scale that made them overflow?",
      "after an overflow your count of good steps went on: does a run of good steps survive an overflow?")),
    ((4096.0, 1, True, 2), (2048.0, 0), (_ALWAYS, _ALWAYS)),
    ((4096.0, 0, False, 2), (4096.0, 1),
     ("after one good step (growth_interval=2) your scale changed: re-read what growth_interval counts",
      "a good step that leaves the scale as it is must still show in the count of good steps")),
    ((4096.0, 1, False, 2), (8192.0, 0),
     ("after growth_interval good steps in a row your scale did not change: what does the scaler try then?",
      "after the scale grew, your count of good steps kept counting: what does a new scale start from?")),
    ((4096.0, 3, False, 5), (4096.0, 4), (_GIVEN, _GIVEN)),
    ((4096.0, 1, False, 5), (4096.0, 2), (_GIVEN, _GIVEN)),
    ((4096.0, 4, False, 5), (8192.0, 0), (_GIVEN, _GIVEN)),
]
_SMALL = ("after an overflow at a small scale (or one that is not a power of two) your scale is not half "
          "of what it was: the scale is a float that keeps halving, with no rounding and no floor")
#: the edges, whose right answers come from the reference solution: scales of 1 and less, scales
#: that are not powers of two, growth_interval=1 (every good step grows the scale) and 3
_EDGES = [((1.0, 0, True, 2), (_SMALL, _ALWAYS)), ((3.0, 1, True, 2), (_SMALL, _ALWAYS)),
          ((0.5, 0, True, 3), (_SMALL, _ALWAYS)), ((0.75, 0, False, 1), (_GIVEN, _GIVEN)),
          ((1.0, 2, False, 3), (_GIVEN, _GIVEN)), ((1.0, 1, False, 3), (_GIVEN, _GIVEN))]
#: runs of steps through torch's own GradScaler: (init_scale, growth_interval, found_inf per step)
_SCALER_RUNS = [(2.0**16, 2, (True, True, False, False, True, False, False, False, True, False)),
                (1.0, 3, (True, True, False, False, False, True, False, False, False, False))]

CASES: dict[str, list[str]] = {
    "08.1": [f"{value:g} in {str(dtype).removeprefix('torch.')}" for value, dtype in _SURVIVES],
    "08.2": [label for label, _ in _FP16_RUNS],
    "08.3": [f"scale={a[0]:g}, good_steps={a[1]}, found_inf={a[2]}, growth_interval={a[3]}"
             for a, *_ in _SCALE_CASES + _EDGES]
    + [f"{len(steps)} steps of GradScaler(init_scale={init:g}, growth_interval={interval})"
       for init, interval, steps in _SCALER_RUNS],
}


_NOT_A_SCALE = ("return a pair: (the new scale, a number; the new count of good steps, a whole "
                "number)")


def _scale_and_count(got: Any) -> tuple[float, int] | None:
    """A rule's (scale, good_steps), read as numbers however written (answers.py), else None."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return None
    scale, count = real(got[0]), whole(got[1])
    return None if scale is None or count is None else (scale, count)


def _judge_next_scale(answer: Any) -> str | None:
    rule = reference("08.3")
    for args, right, hints in _SCALE_CASES + [(args, tuple(rule(*args)), hints) for args, hints in _EDGES]:
        got = _scale_and_count(answer(*args))
        if got is None:
            return _NOT_A_SCALE
        for value, expected, hint in zip(got, right, hints, strict=True):
            if value != expected:
                return hint
    # the same runs of steps through torch's own GradScaler: the scales must agree step by step
    for init, interval, steps in _SCALER_RUNS:
        weight = nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([weight], lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
        scaler.scale(torch.ones(1))  # the scaler starts its scale on first use
        scale, good = init, 0
        for found_inf in steps:
            weight.grad = torch.tensor([float("inf") if found_inf else 1.0])
            scaler.step(optimizer)
            scaler.update()
            got = _scale_and_count(answer(scale, good, found_inf, interval))
            if got is None:
                return _NOT_A_SCALE
            scale, good = got
            if scale != scaler.get_scale():
                return "over a longer run of steps your scale drifts from GradScaler's: check each rule again"
    return None


EXERCISES = load_bank(__name__)
