"""The rank side of the judges of notebook 06's exercises 06.1 and 06.2: each runs the answer on one
gloo rank, watches every all-reduce it starts and every wait (:mod:`.all_reduces`), and returns
the first hint, or None when the rank saw nothing wrong. ``nb06`` runs them on every world size.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .all_reduces import all_reduces_watched
from .core import untimed
from .nb06_hints import (
    FILL_ORDER,
    NO_OVERLAP,
    TOUCHED,
    carries_gradients,
    frozen_hint,
    grad_hint,
    written_in_flight,
)

__all__ = ["HOOK_STEPS", "average_rank", "hooks_rank"]

#: 06.2 trains this many SGD steps on each world size
HOOK_STEPS = 3


def _rank_batch(rank: int, world_size: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
    return x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


# ---------------------------------------------------------------- 06.1: average_gradients

def average_rank(rank: int, world_size: int, answer: Any) -> str | None:
    """One rank of exercise 06.1's check: ``answer(model)`` after one backward pass, against the
    mean of every rank's gradients (worked out here, on this rank, from their rows)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..ddp.by_hand_runs import lesson_batches, lesson_model

    x, y = lesson_batches(1, seed=world_size)[0]

    def grads(r: int) -> list[torch.Tensor | None]:
        model = lesson_model(tied=True, frozen=True)
        F.mse_loss(model(_rank_batch(r, world_size, x, y)[0]), _rank_batch(r, world_size, x, y)[1]).backward()
        return [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    with untimed():
        every = [grads(r) for r in range(world_size)]
    means = [None if g is None else sum(e[i] for e in every) / world_size for i, g in enumerate(every[0])]
    model = lesson_model(tied=True, frozen=True)
    xr, yr = _rank_batch(rank, world_size, x, y)
    F.mse_loss(model(xr), yr).backward()
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    grad_ptrs = {p.grad.data_ptr() for p in params if p.grad is not None}
    try:
        with all_reduces_watched() as reduced:
            answer(model)
    except Exception as err:  # noqa: BLE001 - a frozen parameter's None gradient gets its hint
        hint = frozen_hint(err)
        if hint is None:
            raise
        return hint
    unwaited = any(not r["waited"] for r in reduced)  # before the barrier, which finishes earlier work
    dist.barrier()
    if unwaited:
        return ("average_gradients returned before waiting for an all-reduce it started: until its "
                "handle is waited for, an asynchronous all-reduce may not have finished, and the gradient "
                "may not hold the sum yet when the optimizer reads it")
    if written_in_flight(reduced, world_size):
        return TOUCHED
    where = {p.data_ptr() for p in params}
    if any(ptr in where for r in reduced for ptr in r["ptrs"]) or any(
            not torch.equal(p.detach(), v) for p, v in zip(params, values, strict=True)):
        return ("the parameters themselves went through all-reduce or changed: average_gradients changes "
                "the gradients only; the optimizer's step changes the parameters afterwards")
    own = [g for g in every[rank] if g is not None]
    if not all(carries_gradients(r, grad_ptrs, own, world_size) for r in reduced):
        return ("something other than the gradients went through all-reduce: the mean the optimizer "
                "needs comes from all-reducing the gradients themselves (each .grad, or this rank's "
                "gradients copied into one flat tensor)")
    trainable = [p for p in params if p.requires_grad]
    expected = sum(p.numel() for p in trainable)
    sent = sum(r["numel"] for r in reduced)
    tied = model[2].weight.numel()
    if sent > expected:
        if sent == expected + tied:
            return ("the tied weight went through all-reduce twice: a parameter used by two layers is one "
                    "tensor with one gradient, listed once by model.parameters()")
        return "more values went through all-reduce than the gradients hold: reduce each gradient once"
    if any(p.grad is not None for p in params if not p.requires_grad):
        return ("the frozen parameter was given a gradient: a parameter with requires_grad=False takes no "
                "part in the averaging")
    for p, mean, own in zip(params, means, every[rank], strict=True):
        if mean is None:
            continue
        hint = grad_hint(p.grad.flatten(), mean.flatten(), own.flatten(), world_size)
        if hint is not None:
            return hint
    if sent < expected:
        return ("the check saw fewer values go through all-reduce than the gradients hold: it watches "
                "torch.distributed.all_reduce (and all_reduce_coalesced), blocking or not; average every "
                "gradient that trains with it")
    return None


# ---------------------------------------------------------------- 06.2: the hook version

def hooks_rank(rank: int, world_size: int, answer: Any) -> str | None:
    """One rank of exercise 06.2's check: ``answer(model)`` trains ``HOOK_STEPS`` SGD steps, the
    ranks seeded differently, against one process on the whole batches; per step, the all-reduces
    started during the backward pass, the waits, and the gradients."""
    import torch.nn.functional as F
    from torch import nn

    from ..ddp.by_hand_runs import LR, lesson_batches, lesson_model

    model = lesson_model(tied=True, frozen=True, seed=rank)
    reference = lesson_model(tied=True, frozen=True, seed=0)  # rank 0's start, on the whole batch
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    numels = sorted(p.numel() for p in reference.parameters() if p.requires_grad)
    try:
        with all_reduces_watched() as reduced:
            ddp_model = answer(model)
    except RuntimeError as err:
        hint = frozen_hint(err)
        if hint is None:
            raise
        return hint
    finish = getattr(ddp_model, "finish_gradient_synchronization", None)
    if not (isinstance(ddp_model, nn.Module) and callable(finish)):
        return ("PerParameterDDP(model) must build a module, whose forward is the model's, with a method "
                "finish_gradient_synchronization()")
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR, momentum=0.9)
    for step, (x, y) in enumerate(lesson_batches(HOOK_STEPS)):
        if step == 0 and any(not torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(),
                                                                    strict=True)):
            return ("the ranks, seeded differently, do not start from rank 0's parameters: keep the "
                    "broadcast when the wrapper is built")
        xr, yr = _rank_batch(rank, world_size, x, y)
        ref_optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        local = lesson_model(tied=True, frozen=True)  # this rank's own gradients, before any all-reduce
        local.load_state_dict(model.state_dict())
        F.mse_loss(local(xr), yr).backward()
        own = [p.grad.flatten() for p in local.parameters() if p.grad is not None]
        optimizer.zero_grad()
        loss = F.mse_loss(ddp_model(xr), yr)
        ready = [0]  # gradients made ready so far in this backward pass (counted by hooks of our own)

        def count(_: Any, ready: list[int] = ready) -> None:
            ready[0] += 1

        with all_reduces_watched(clock=lambda ready=ready: ready[0]) as reduced:
            handles = [p.register_post_accumulate_grad_hook(count)
                       for p in model.parameters() if p.requires_grad]
            loss.backward()
            for handle in handles:
                handle.remove()
            during = [r["numel"] for r in reduced]
            others = list(reduced.others)
            waited = any(r["waited"] for r in reduced)
            if not waited:
                try:
                    ddp_model.finish_gradient_synchronization()
                except TypeError as err:
                    hint = frozen_hint(err)
                    if hint is None:
                        raise
                    return hint
        raced = written_in_flight(reduced, world_size)  # a collective: every rank runs it here
        if waited or others:
            return ("the backward pass waited for an all-reduce: a hook that waits in any way (wait() on "
                    "the handle or on its future, polling is_completed() until it is true, a blocking "
                    "all_reduce, a barrier or another collective) holds the backward pass until every rank "
                    "has sent that gradient, so communication no longer overlaps computation; start it "
                    "and wait later")
        if not during:
            return ("no all-reduce started during the backward pass: each parameter's hook must start the "
                    "all-reduce of its gradient as soon as it is ready")
        grads = {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
        if not all(carries_gradients(r, grads, own, world_size) for r in reduced[:len(during)]):
            return ("the hooks all-reduced something other than the gradients during the backward pass: "
                    "each hook must all-reduce its parameter's gradient itself, the tensor in .grad, which "
                    "all_reduce overwrites with the sum")
        if len(reduced) > len(during):
            return ("an all-reduce started after the backward pass: it cannot overlap the backward pass, "
                    "which is over; every gradient's all-reduce is started by its hook, during backward, and "
                    "finish_gradient_synchronization only waits for them")
        if len(during) > len(numels):
            return ("more all-reduces started than there are parameters that train: a tied weight is one "
                    "parameter with one gradient (one hook), and a frozen one has none")
        if sorted(during) != numels:
            return "one all-reduce per parameter that trains, each of its whole gradient, started by its hook"
        if raced:
            return TOUCHED
        if len(numels) > 1 and min(r["at"] for r in reduced[:len(during)]) >= len(numels) - 1:
            return NO_OVERLAP
        if any(not r["waited"] for r in reduced[:len(during)]):
            return ("finish_gradient_synchronization returned before waiting for every all-reduce the hooks "
                    "started: until its handle is waited for, an asynchronous all-reduce may not have "
                    "finished, and the gradient may not hold the sum yet")
        for p, q in zip(ddp_model.module.parameters(), reference.parameters(), strict=True):
            if q.grad is None:
                if p.grad is not None:
                    return ("the frozen parameter was given a gradient: leave the parameters that do "
                            "not train alone")
                continue
            hint = grad_hint(p.grad.flatten(), q.grad.flatten(), q.grad.flatten() * math.nan, world_size)
            if hint is not None:
                return hint
        optimizer.step()
        ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=1e-4, atol=1e-6):
            return "the gradients were right, but the parameters after the steps are not one process's"
    return _routed(rank, world_size, answer)


def _routed(rank: int, world_size: int, answer: Any) -> str | None:
    """06.2 on a model whose two layers of one shape run in a rank-dependent order (``Routed``): the
    gradients arrive in another order on odd ranks, and every rank must still start the same
    all-reduces in the same order, step after step; ``HOOK_STEPS`` SGD steps, the first against the
    mean of every rank's gradients, every one checked for the same order and the same gradients on
    every rank."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..ddp.by_hand_trials import trial_model

    def batch(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + 10 * step + r)
        return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)

    def grads(r: int) -> dict[str, torch.Tensor]:
        model = trial_model("routed", r)
        F.mse_loss(model(batch(r, 0)[0]), batch(r, 0)[1]).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    with untimed():
        every = [grads(r) for r in range(world_size)]
    model = trial_model("routed", rank)
    ddp_model = answer(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(HOOK_STEPS):
        optimizer.zero_grad()
        own = {}
        if step:  # this rank's own gradients at the current parameters, before any all-reduce
            local = trial_model("routed", rank)
            local.load_state_dict(model.state_dict())
            F.mse_loss(local(batch(rank, step)[0]), batch(rank, step)[1]).backward()
            own = {n: p.grad.clone() for n, p in local.named_parameters()}
        with all_reduces_watched() as reduced:
            F.mse_loss(ddp_model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
            ddp_model.finish_gradient_synchronization()
        carried = []  # which parameter each all-reduce carried, in the order they started
        for record in reduced:
            found = [n for n, g in (own or every[rank]).items()
                     if carries_gradients(record, set(), [g], world_size)]
            carried.append(found[0] if len(found) == 1 else "?")
        seen: list[Any] = [None] * world_size
        dist.all_gather_object(seen, (carried, {n: p.grad.clone() for n, p in model.named_parameters()}))
        if any(order != seen[0][0] for order, _ in seen) or any(
                not torch.allclose(g[n], seen[0][1][n], rtol=1e-5, atol=1e-7) for _, g in seen for n in g):
            return FILL_ORDER
        if step == 0:
            for name, param in model.named_parameters():
                mean = sum(e[name] for e in every) / world_size
                own_grad = every[rank][name].flatten()
                hint = grad_hint(param.grad.flatten(), mean.flatten(), own_grad, world_size)
                if hint is not None:
                    return hint
        optimizer.step()
    return None
