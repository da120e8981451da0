"""Evidence that DataParallel by hand is right and what it costs (notebook 03).

``compare_training`` trains a copy of a model on one device and another copy data-parallel, side
by side, and asserts outputs, gradients and parameters equal; ``time_steps`` measures each of the
four primitives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._checks import check_positive_int
from .by_hand import data_parallel
from .primitives import gather, parallel_apply, replicate, scatter_kwargs
from .simulated import parse_devices, tensors_in

__all__ = ["Equivalence", "compare_training", "time_steps"]



@dataclass(frozen=True)
class Equivalence:
    """How far data-parallel training drifted from single-device training (``compare_training``)."""

    steps: int
    devices: int
    max_output_diff: float
    max_grad_diff: float
    max_param_diff: float

    def __str__(self) -> str:
        return (f"{self.steps} steps on {self.devices} devices: max |Δ| output "
                f"{self.max_output_diff:.1e}, gradient {self.max_grad_diff:.1e}, "
                f"parameters {self.max_param_diff:.1e}")


def _max_diff(a: Any, b: Any) -> float:
    ta, tb = list(tensors_in(a)), list(tensors_in(b))
    if len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb, strict=True)):
        return float("inf")
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(ta, tb, strict=True))


def compare_training(
    model: nn.Module,
    batches: Sequence[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device_ids: Sequence[Any],
    *,
    dim: int = 0,
    lr: float = 0.1,
    check: bool = True,
) -> Equivalence:
    """Train a copy of ``model`` on one device and another copy data-parallel, side by side.

    For each ``(inputs, target)`` batch both copies run forward, ``loss_fn(output, target)``,
    backward and an SGD step with ``lr``. With ``check=True`` the outputs and every gradient are
    compared with ``torch.testing.assert_close`` at each step (an ``AssertionError`` names the
    step), and the parameters after the last step too. ``model`` itself is left untouched.
    """
    import copy

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if len(batches) == 0:
        raise ValueError("batches is empty: give at least one (inputs, target) pair")
    devices = parse_devices(device_ids)
    single, parallel = copy.deepcopy(model), copy.deepcopy(model)
    worst = {"output": 0.0, "grad": 0.0, "param": 0.0}
    for step, (inputs, target) in enumerate(batches):
        out_s = single(inputs)
        out_p = data_parallel(parallel, inputs, devices, dim=dim)
        loss_fn(out_s, target).backward()
        loss_fn(out_p, target).backward()
        grads_s = [p.grad for p in single.parameters()]
        grads_p = [p.grad for p in parallel.parameters()]
        worst["output"] = max(worst["output"], _max_diff(out_s, out_p))
        worst["grad"] = max(worst["grad"], _max_diff(grads_s, grads_p))
        if check:
            torch.testing.assert_close(out_p, out_s, msg=lambda m, s=step: f"step {s} outputs: {m}")
            torch.testing.assert_close(grads_p, grads_s, msg=lambda m, s=step: f"step {s} grads: {m}")
        with torch.no_grad():
            for p in list(single.parameters()) + list(parallel.parameters()):
                p -= lr * p.grad
                p.grad = None
    worst["param"] = _max_diff(list(single.parameters()), list(parallel.parameters()))
    if check:
        torch.testing.assert_close(list(parallel.parameters()), list(single.parameters()))
    return Equivalence(len(batches), len(devices), worst["output"], worst["grad"], worst["param"])


def time_steps(model: nn.Module, inputs: torch.Tensor, device_ids: Sequence[Any], *,
               repeats: int = 5) -> dict[str, float]:
    """Median seconds of each step of one data-parallel forward, and of the plain forward.

    Keys: ``scatter``, ``replicate``, ``parallel_apply``, ``gather`` and ``single`` (the
    unsplit forward on one device). Gradients are on, as in training.
    """
    import statistics
    import time

    devices = parse_devices(device_ids)
    repeats = check_positive_int("repeats", repeats)
    cuda_devices = [d for d in devices if d.type == "cuda"]
    keys = ("scatter", "replicate", "parallel_apply", "gather", "single")
    samples: dict[str, list[float]] = {k: [] for k in keys}

    def tick() -> float:
        for d in cuda_devices:  # every device's queued work, not only the current device's
            torch.cuda.synchronize(d)
        return time.perf_counter()

    for _ in range(repeats + 1):  # the first round warms up and is dropped
        t0 = tick()
        chunks, kwargs = scatter_kwargs((inputs,), None, devices)
        t1 = tick()
        replicas = replicate(model, devices[: len(chunks)])
        t2 = tick()
        outs = parallel_apply(replicas, chunks, kwargs, devices[: len(chunks)])
        t3 = tick()
        gather(outs, devices[0])
        t4 = tick()
        model(inputs)
        t5 = tick()
        for key, seconds in zip(keys, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            samples[key].append(seconds)
    return {k: statistics.median(v[1:]) for k, v in samples.items()}
