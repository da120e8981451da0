"""Judges of the exercises of notebook 06 (DDP by hand); their content is in nb06.toml.

06.1 and 06.2 run the answer on real gloo ranks (2, 3 and 4) through ``run_on_ranks``. What ran is
counted where every collective ends, in the methods of the rank's ``ProcessGroup``
(:func:`all_reduces_watched`), whatever name the answer called it by, and so is every ``wait()`` on
the handles those all-reduces returned: the check sees whether a wait happened inside the backward
pass (communication serialised) or never happened at all.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from .core import load_bank, untimed
from .on_ranks import hint_from_ranks

__all__ = ["CASES", "EXERCISES", "all_reduces_watched"]

#: 06.3: the model whose buckets the learner counts (``comm_heavy_model(WIDTH)``) and the cap (MB)
BUCKET_WIDTH, BUCKET_CAP_MB = 512, 2
#: 06.1's and 06.2's world sizes; 06.2 trains this many SGD steps in each
WORLDS = (2, 3, 4)
HOOK_STEPS = 3

CASES: dict[str, list[str]] = {
    "06.1": [f"world_size={n}, lesson_model with a tied weight and a frozen one, each rank its own rows"
             for n in WORLDS],
    "06.2": [f"world_size={n}, ranks seeded differently, a tied weight and a frozen one, "
             f"{HOOK_STEPS} SGD steps against one process" for n in WORLDS],
    "06.3": [f"comm_heavy_model({BUCKET_WIDTH}), bucket_cap_mb={BUCKET_CAP_MB}"],
}


# ---------------------------------------------------------------- 06.3: how many buckets

def _judge_bucket_count(answer: Any) -> str | None:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or answer != int(answer):
        return "write the number of buckets, a whole number"
    from ..ddp_by_hand import assign_buckets
    from ..ddp_by_hand_runs import comm_heavy_model

    with untimed():  # the course's own reference
        params = list(comm_heavy_model(BUCKET_WIDTH).parameters())
    right = len(assign_buckets(params, BUCKET_CAP_MB))
    cap = BUCKET_CAP_MB * 2**20
    total = sum(p.numel() * p.element_size() for p in params)
    weights = [p for p in params if p.dim() == 2]
    if answer == right:
        return None
    if answer == len(params):
        return ("that is one bucket per parameter, what no cap at all gives: with a cap, gradients share "
                "a bucket as long as it stays within the cap")
    if answer == len(weights):
        return ("that is one bucket per layer: a bucket knows nothing of layers; it holds gradients, "
                "counted in bytes, as long as they fit under the cap")
    if answer in (math.floor(total / cap), math.ceil(total / cap)):
        return ("that divides the model's size by the cap, as if the buckets were filled to the brim: a "
                "parameter is never split, so one that would take its bucket past the cap opens the next "
                "bucket, and the bucket it did not fit in stays part empty")
    if answer <= 1:
        return "the model's gradients take more bytes than the cap: more than one bucket is needed"
    return ("walk the parameters from the last one registered to the first (the order backward produces "
            "their gradients), adding each one's bytes (four per float32 value, the biases too) to the "
            "current bucket while it stays within the cap")


# ---------------------------------------------------------------- what ran on a rank

@contextlib.contextmanager
def all_reduces_watched() -> Iterator[list[dict]]:
    """On a rank: one record per all-reduce the block runs on a process group, whatever name the
    code called it by: ``numel`` (the elements handed in), ``ptrs`` (where they are), ``work``
    (the handle the group returned) and ``waited`` (how many times ``wait()`` was called on that
    handle, updated as the block goes on)."""
    import torch.distributed as dist

    records: list[dict] = []
    by_work: dict[int, dict] = {}
    group_class = dist.ProcessGroup
    original_all_reduce = group_class.allreduce
    held = {(group_class, "allreduce"): group_class.__dict__.get("allreduce")}  # put back afterwards

    def counting_wait(cls: type) -> None:
        """Count the waits on the handles of class ``cls`` (the class a release's backend returns)."""
        original_wait = cls.wait

        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            record = by_work.get(id(self))
            if record is not None:
                record["waited"] += 1
            return original_wait(self, *args, **kwargs)

        held[cls, "wait"] = cls.__dict__.get("wait")
        cls.wait = wait

    def allreduce(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        work = original_all_reduce(self, tensors, *args, **kwargs)
        handed = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        record = {"numel": sum(t.numel() for t in handed), "ptrs": [t.data_ptr() for t in handed],
                  "work": work, "waited": 0}  # the record keeps the handle, so its id stays its own
        records.append(record)
        by_work[id(work)] = record
        if (type(work), "wait") not in held:
            counting_wait(type(work))
        return work

    group_class.allreduce = allreduce
    try:
        yield records
    finally:
        for (cls, name), descriptor in held.items():
            if descriptor is None:
                delattr(cls, name)
            else:
                setattr(cls, name, descriptor)


def _rank_batch(rank: int, world_size: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
    return x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


def _frozen_hint(err: Exception) -> str | None:
    text = str(err)
    if "NoneType" in text or "doesn't require gradient" in text or "does not require grad" in text:
        return ("a parameter with requires_grad=False has no gradient (its .grad stays None) and takes no "
                "part in the averaging: leave the parameters that do not train alone")
    return None


def _grad_hint(got: torch.Tensor, mean: torch.Tensor, own: torch.Tensor, world_size: int) -> str | None:
    """What is wrong with a gradient that should be ``mean`` (``own``: this rank's, before)."""
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6)  # noqa: E731
    if close(got, mean):
        return None
    if close(got, mean * world_size):
        return ("each gradient holds the sum over the ranks: DDP averages, so that N ranks train as one "
                "process on the whole batch")
    if close(got, mean / world_size):
        return "each gradient holds the mean divided once more: divide the sum by the world size once"
    if close(got, own):
        return ("each gradient is still this rank's own: nothing reached the other ranks; all_reduce "
                "writes the sum into the tensor it is handed, so reducing a temporary (a quotient, a "
                "copy) loses the sum")
    if close(got, own / world_size):
        return ("each gradient is this rank's own, divided: all_reduce writes the sum into the tensor it "
                "is handed, so reducing a temporary (a quotient, a copy) loses the sum")
    ratio = (mean * world_size @ got / (got @ got).clamp_min(1e-30)).item()
    if close(got * ratio, mean * world_size):
        return ("each gradient is the sum divided by a fixed number, not by the world size: this check "
                "runs on several world sizes")
    return "the gradients are not the mean of the ranks' gradients"


# ---------------------------------------------------------------- 06.1: average_gradients

def average_rank(rank: int, world_size: int, answer: Any) -> str | None:
    """One rank of exercise 06.1's check: ``answer(model)`` after one backward pass, against the
    mean of every rank's gradients (worked out here, on this rank, from their rows)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..ddp_by_hand_runs import lesson_batches, lesson_model

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
    try:
        with all_reduces_watched() as reduced:
            answer(model)
    except Exception as err:  # noqa: BLE001 - a frozen parameter's None gradient gets its hint
        hint = _frozen_hint(err)
        if hint is None:
            raise
        return hint
    dist.barrier()
    where = {p.data_ptr() for p in params}
    if any(ptr in where for r in reduced for ptr in r["ptrs"]) or any(
            not torch.equal(p.detach(), v) for p, v in zip(params, values, strict=True)):
        return ("the parameters themselves went through all-reduce or changed: average_gradients changes "
                "the gradients only; the optimizer's step changes the parameters afterwards")
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
        hint = _grad_hint(p.grad.flatten(), mean.flatten(), own.flatten(), world_size)
        if hint is not None:
            return hint
    if sent < expected:
        return "some gradients were averaged without going through all-reduce"  # never seen yet
    return None


def _judge_average_gradients(answer: Any) -> str | None:
    for world_size in WORLDS:
        hint = hint_from_ranks(average_rank, world_size, answer, hang_hint=(
            "the ranks hung: every rank must all-reduce the same gradients, in the same order"))
        if hint is not None:
            return hint
    return None


# ---------------------------------------------------------------- 06.2: the hook version

def hooks_rank(rank: int, world_size: int, answer: Any) -> str | None:
    """One rank of exercise 06.2's check: ``answer(model)`` trains ``HOOK_STEPS`` SGD steps, the
    ranks seeded differently, against one process on the whole batches; per step, the all-reduces
    started during the backward pass, the waits, and the gradients."""
    import torch.nn.functional as F
    from torch import nn

    from ..ddp_by_hand_runs import LR, lesson_batches, lesson_model

    model = lesson_model(tied=True, frozen=True, seed=rank)
    reference = lesson_model(tied=True, frozen=True, seed=0)  # rank 0's start, on the whole batch
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    numels = sorted(p.numel() for p in reference.parameters() if p.requires_grad)
    try:
        with all_reduces_watched() as reduced:
            ddp_model = answer(model)
    except RuntimeError as err:
        hint = _frozen_hint(err)
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
        optimizer.zero_grad()
        loss = F.mse_loss(ddp_model(xr), yr)
        with all_reduces_watched() as reduced:
            loss.backward()
            during = [r["numel"] for r in reduced]
            if any(r["waited"] for r in reduced):
                return ("the backward pass waited for an all-reduce: a hook that waits (or calls a blocking "
                        "all_reduce) holds the backward pass until every rank has sent that gradient, so "
                        "communication no longer overlaps computation; start it and wait later")
            try:
                ddp_model.finish_gradient_synchronization()
            except TypeError as err:
                hint = _frozen_hint(err)
                if hint is None:
                    raise
                return hint
        if not during:
            return ("no all-reduce started during the backward pass: each parameter's hook must start the "
                    "all-reduce of its gradient as soon as it is ready")
        if len(during) > len(numels):
            return ("more all-reduces started than there are parameters that train: a tied weight is one "
                    "parameter with one gradient (one hook), and a frozen one has none")
        if sorted(during) != numels:
            return "one all-reduce per parameter that trains, each of its whole gradient, started by its hook"
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
            hint = _grad_hint(p.grad.flatten(), q.grad.flatten(), q.grad.flatten() * math.nan, world_size)
            if hint is not None:
                return hint
        optimizer.step()
        ref_optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if not torch.allclose(p, q, rtol=1e-4, atol=1e-6):
            return "the gradients were right, but the parameters after the steps are not one process's"
    return None


def _judge_hooks(answer: Any) -> str | None:
    for world_size in WORLDS:
        hint = hint_from_ranks(hooks_rank, world_size, answer, hang_hint=(
            "the ranks hung: every rank must all-reduce the same gradients, in the same order"))
        if hint is not None:
            return hint
    return None


EXERCISES = load_bank(__name__)
