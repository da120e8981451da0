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

from ..compat import queue_backward_callback
from ..devices import rank_device, wrap_ddp
from ..faults.snapshots import state_copy
from ..models import seeded
from .by_hand import DDPByHand

__all__ = ["TRIALS", "FillOrderDDP", "Routed", "comm_hook_rank", "defined_out_of_order",
           "divide_then_all_reduce", "routed_orders_rank", "torch_bucket_counts_rank", "trial_model",
           "trial_rank", "trials_rank"]

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


def trials_rank(rank: int, world_size: int, cases: list[tuple[str, str, float | None]],
                steps: int = 3) -> dict[tuple[str, str, float | None], dict[str, Any]]:
    """:func:`trial_rank` for each ``(model, trial, bucket_cap_mb)`` of ``cases``, in this one group."""
    return {tuple(case): trial_rank(rank, world_size, *case, steps=steps) for case in cases}


class FillOrderDDP(DDPByHand):
    """The hazard, for the lesson: each bucket starts as soon as it is full, in the order its
    gradients arrived on this rank (what ``DDPByHand`` does not do)."""

    def _gradient_ready(self, param: nn.Parameter) -> None:
        self._copy_into_bucket(param)
        b = self.place[param][0]
        if self.arrived[b] == len(self.buckets[b]):
            self._start_all_reduce(b)
            self.next_bucket += 1  # here: how many have started
        if self.next_bucket == len(self.buckets):
            queue_backward_callback(self._backward_ended)  # finished as DDPByHand is


def routed_orders_rank(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """One backward pass of :class:`Routed` (its two layers in a rank-dependent order) under
    :class:`FillOrderDDP`, ``DDPByHand`` and torch's DDP, a bucket per parameter: for each, the
    parameters in the order this rank issued their all-reduces (torch's: not observable, None)
    and the averaged gradients."""
    found = {}
    for name, wrap in (("fill order", FillOrderDDP), ("by hand", DDPByHand), ("torch DDP", None)):
        model = trial_model("routed", rank).to(rank_device())
        wrapped = wrap(model, None, rebuild_buckets=False) if wrap else wrap_ddp(model, rank_device())
        issued: list[str] = []
        if wrap:
            start, names = wrapped._start_all_reduce, {p: n for n, p in model.named_parameters()}

            def counted(b: int, start: Any = start, w: Any = wrapped, issued: list[str] = issued,
                        names: dict = names) -> None:
                issued.append(names[w.buckets[b][0]])
                start(b)

            wrapped._start_all_reduce = counted
        x, y = _inputs(2, rank, 0, 0)
        F.mse_loss(wrapped(x.to(rank_device())), y.to(rank_device())).backward()
        getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
        found[name] = {"issued": issued if wrap else None,
                       "grads": {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}}
        dist.barrier()
        wrapped = model = None
        gc.collect()
    return found


def torch_bucket_counts_rank(rank: int, world_size: int, width: int, cap: float) -> dict[str, int]:
    """How many buckets torch's DDP reduces per step on ``comm_heavy_model(width)`` with
    ``bucket_cap_mb=cap``, after three steps: by default (rebuilt after the first step in the order
    the gradients arrived) and with ``find_unused_parameters=True`` (as built, never rebuilt)."""
    from .by_hand_timing import comm_heavy_model

    counts = {}
    for label, unused in (("default", False), ("find_unused_parameters=True", True)):
        model = wrap_ddp(comm_heavy_model(width).to(rank_device()), rank_device(), bucket_cap_mb=cap,
                         find_unused_parameters=unused)
        for _ in range(3):
            x = torch.randn(4, width, device=rank_device())
            F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long, device=rank_device())).backward()
        counts[label] = model._get_ddp_logging_data().get("num_buckets_reduced")
        model = None
        gc.collect()
    dist.barrier()
    return counts


def divide_then_all_reduce(state, bucket):  # no annotations: DDP checks them against its own types
    """A communication hook: DDP hands it a ``dist.GradBucket`` of this rank's gradients, flattened
    (``bucket.buffer()``); it returns a future of the bucket's new values (here, the mean)."""
    flat = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(flat, async_op=True).get_future().then(lambda fut: fut.value()[0])


def comm_hook_rank(rank: int, world_size: int, steps: int = 3) -> dict[str, dict[str, torch.Tensor]]:
    """``lesson_model`` trained under torch's DDP as it is and with :func:`divide_then_all_reduce`
    registered as its communication hook (``register_comm_hook``): both models' parameters."""
    from .by_hand_runs import LR, lesson_batches, lesson_model

    found = {}
    for label in ("default", "comm hook"):
        model = lesson_model(tied=True, frozen=True).to(rank_device())
        ddp_model = wrap_ddp(model, rank_device(), bucket_cap_mb=0.0003)
        if label == "comm hook":
            ddp_model.register_comm_hook(None, divide_then_all_reduce)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR, momentum=0.9)
        for x, y in lesson_batches(steps):
            xr, yr = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
            optimizer.zero_grad()
            F.mse_loss(ddp_model(xr.to(rank_device())), yr.to(rank_device())).backward()
            optimizer.step()
        found[label] = state_copy(model)
        ddp_model = optimizer = model = None
        gc.collect()
    dist.barrier()
    return found
