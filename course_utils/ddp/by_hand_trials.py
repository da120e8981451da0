"""Trials that try to make DDP by hand part from torch's DDP (notebook 06, and its tests).

Each trial trains the same model the same way under :class:`~course_utils.ddp.by_hand.DDPByHand`
and under torch's ``DistributedDataParallel`` on one process group, and returns both models'
parameters (and what each did with its buckets), so that a test or the notebook can assert them
equal. The models are built to break a wrapper that is only nearly right:

- :class:`Routed`: two layers of the same shape applied in an order that depends on the rank (as
  routing or layer drop make it), so the gradients arrive in a different order on each rank;
- :func:`defined_out_of_order`: layers registered in another order than forward uses them, so the
  gradients do not arrive in reverse registration order;
- ``lesson_model`` with a tied and a frozen weight (``by_hand_runs``).

and the ways of training are those of :data:`TRIALS`: plain steps, gradient accumulation with
``no_sync``, two backward passes without it (both synchronised, as DDP does), and a parameter
left out of the loss (an error, at the next forward for DDP).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..devices import rank_device, wrap_ddp
from ..faults.snapshots import state_copy
from ..models import seeded
from .by_hand import DDPByHand

__all__ = ["TRIALS", "Routed", "defined_out_of_order", "trial_model", "trial_rank"]

#: how each trial trains: plain steps; accumulation of 3 micro-batches with no_sync on the first 2;
#: two backward passes before each step without no_sync; a step in which one layer is left out
TRIALS = ("steps", "no_sync", "two_backward", "unused")
WIDTH = 8


class Routed(nn.Module):
    """``a`` then ``b`` on even ranks, ``b`` then ``a`` on odd ones: two layers of the same shape
    whose gradients arrive in an order that depends on the rank; then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.swap else (self.a, self.b)
        return self.head(torch.tanh(second(torch.tanh(first(x)))))


class _OutOfOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2 * WIDTH, 2)  # registered first, used last
        self.middle = nn.Linear(WIDTH, 2 * WIDTH)
        self.first = nn.Linear(WIDTH, WIDTH)  # registered last, used first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def defined_out_of_order() -> nn.Module:
    """Three layers registered head first: backward produces their gradients in registration
    order, the reverse of what bucket assignment assumes before it has seen a step."""
    return seeded(0, _OutOfOrder)


def trial_model(name: str, rank: int = 0) -> nn.Module:
    """``"routed"`` (swapped on odd ranks), ``"out_of_order"`` or ``"lesson"`` (tied and frozen)."""
    if name == "routed":
        model = seeded(0, Routed)
        model.swap = rank % 2 == 1
        return model
    if name == "out_of_order":
        return defined_out_of_order()
    if name == "lesson":
        from .by_hand_runs import lesson_model

        return lesson_model(tied=True, frozen=True)
    raise ValueError(f"model must be 'routed', 'out_of_order' or 'lesson', got {name!r}")


def _inputs(outputs: int, rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of one micro-batch: 4 rows of ``WIDTH`` inputs and ``outputs`` targets."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, outputs, generator=g)


def _train(wrapped: nn.Module, model: nn.Module, trial: str, rank: int, steps: int,
           by_hand: bool) -> str | None:
    """Train ``wrapped`` (whose module is ``model``) under ``trial``; returns the error, if any."""
    device = next(model.parameters()).device
    head = getattr(model, "head", None) or [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    try:
        for step in range(steps):
            optimizer.zero_grad()
            micros = 3 if trial == "no_sync" else 2 if trial == "two_backward" else 1
            for micro in range(micros):
                x, y = (t.to(device) for t in _inputs(head.out_features, rank, step, micro))
                quiet = trial == "no_sync" and micro < micros - 1
                with wrapped.no_sync() if quiet else _nothing():
                    out = wrapped(x)
                    if trial == "unused" and step == 0:  # the last layer alone: the others unused
                        out = head(torch.zeros(len(x), head.in_features, device=device))
                    F.mse_loss(out, y).backward()
                if trial == "two_backward" and by_hand and micro < micros - 1:
                    continue  # no finish between the two: the next forward finishes the first
                if not quiet:
                    finish()
            optimizer.step()
    except RuntimeError as err:
        return str(err)
    return None


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def trial_rank(rank: int, world_size: int, model_name: str, trial: str, bucket_cap_mb: float | None,
               steps: int = 3) -> dict[str, Any]:
    """One trial on this rank, by hand and then with torch's DDP: each one's parameters (on the
    CPU) and error; the buckets each ended with, as lists of indices into the parameters that
    train (DDP's from its logging data); and, by hand, the buckets in the order this rank issued
    their all-reduces."""
    device = rank_device()
    result: dict[str, Any] = {}
    for name in ("by_hand", "torch_ddp"):
        model = trial_model(model_name, rank).to(device)
        issued: list[int] = []
        if name == "by_hand":
            wrapped = DDPByHand(model, bucket_cap_mb)
            start = wrapped._start_all_reduce

            def counted(b: int, start: Any = start, issued: list[int] = issued) -> None:
                issued.append(b)
                start(b)

            wrapped._start_all_reduce = counted
        else:
            wrapped = wrap_ddp(model, device, bucket_cap_mb=25 if bucket_cap_mb is None else bucket_cap_mb)
        error = _train(wrapped, model, trial, rank, steps, by_hand=name == "by_hand")
        index = {p: i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
        if name == "by_hand":
            buckets = [[index[p] for p in bucket] for bucket in wrapped.buckets]
            result["issued"] = issued
        else:
            data = wrapped._get_ddp_logging_data()
            text = data.get("rebuilt_per_bucket_param_indices") or ""
            buckets = [[int(i) for i in part.split()] for part in text.split(",") if part.strip()]
        result[name] = {"params": state_copy(model), "error": error, "buckets": buckets}
        dist.barrier()
        wrapped = model = None  # DDP gone before the process group (gloo's clean exit)
        gc.collect()
    return result
