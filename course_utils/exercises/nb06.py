"""Judges of the exercises of notebook 06 (DDP by hand); their content is in nb06.toml.

06.1 and 06.2 run the answer on real gloo ranks (2, 3 and 4) through ``run_on_ranks``. What ran is
counted where every collective ends, in the methods of the rank's ``ProcessGroup``
(:func:`all_reduces_watched`), whatever name the answer called it by, and so is every way of waiting
for the handles those all-reduces returned (``wait()``, a wait on their futures, ``torch.futures.wait_all``,
polling ``is_completed()`` until it is true): the check sees whether a wait happened inside the
backward pass (communication serialised) or never happened at all. A blocking all-reduce waits
inside the call, so it counts as waited for.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator
from typing import Any

import torch

from .core import load_bank, untimed
from .on_ranks import hint_from_ranks

__all__ = ["CASES", "EXERCISES", "all_reduces_watched"]

#: 06.3: the model whose buckets the learner counts (``comm_heavy_model(WIDTH)``) and the cap (MB)
BUCKET_WIDTH, BUCKET_CAP_MB = 512, 0.75
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

def _whole_number(answer: Any) -> int | None:
    """``answer`` as a whole number (an int, a numpy integer, a float or a one-value tensor holding a
    whole number), or None."""
    if isinstance(answer, torch.Tensor):
        if answer.numel() != 1 or answer.dtype == torch.bool or answer.is_complex():
            return None
        answer = answer.item()
    if isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Integral):
        return int(answer)
    if isinstance(answer, numbers.Real):
        try:
            value = float(answer)
        except (OverflowError, ValueError):  # a fraction too large for a float: no count of buckets
            return None
        return int(value) if math.isfinite(value) and value.is_integer() else None
    return None


def _old_rule_count(params: list, cap: float) -> int:
    """The buckets when a bucket never passes the cap (a parameter that would take it past opens the
    next one): the rule this course used before it took DDP's."""
    count, size = 0, 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if count == 0 or size + nbytes > cap:
            count, size = count + 1, 0
        size += nbytes
    return count


def _judge_bucket_count(answer: Any) -> str | None:
    count = _whole_number(answer)
    if count is None:
        return "write the number of buckets, a whole number"
    from ..ddp_by_hand import assign_buckets
    from ..ddp_by_hand_runs import comm_heavy_model

    with untimed():  # the course's own reference
        params = list(comm_heavy_model(BUCKET_WIDTH).parameters())
    right = len(assign_buckets(params, BUCKET_CAP_MB))
    cap = BUCKET_CAP_MB * 2**20
    total = sum(p.numel() * p.element_size() for p in params)
    weights = [p for p in params if p.dim() == 2]
    if count == right:
        return None
    if count == len(params):
        return ("that is one bucket per parameter, what no cap at all gives: with a cap, gradients share "
                "a bucket until it has reached the cap")
    if count == len(weights):
        return ("that is one bucket per layer (or the parameters walked in the order they were "
                "registered): a bucket knows nothing of layers; it holds gradients, counted in bytes, "
                "taken from the last parameter registered to the first, until they reach the cap")
    if count == _old_rule_count(params, cap):
        return ("that keeps every bucket within the cap: a bucket closes only once it has reached the "
                "cap, so its last parameter may take it past the cap, and a parameter larger than the "
                "cap shares its bucket with the ones before it")
    if count in (math.floor(total / cap), math.ceil(total / cap)):
        return ("that divides the model's size by the cap, as if the buckets were filled exactly to the "
                "cap: a parameter is never split, so a bucket holds whole gradients and usually ends "
                "past the cap")
    if count <= 1:
        return "the model's gradients take more bytes than the cap: more than one bucket is needed"
    return ("walk the parameters from the last one registered to the first (the order backward produces "
            "their gradients), adding each one's bytes (four per float32 value, the biases too) to the "
            "current bucket, and close the bucket as soon as it has reached the cap")


# ---------------------------------------------------------------- what ran on a rank

@contextlib.contextmanager
def all_reduces_watched() -> Iterator[list[dict]]:
    """On a rank: one record per all-reduce the block runs on a process group, whatever name the
    code called it by: ``numel`` (the elements handed in), ``ptrs`` (where they are), ``sent`` (a
    copy of their values, flattened, when the all-reduce started), ``work`` (the handle the group
    returned) and ``waited`` (how many times the block waited for it, updated as the block goes on).

    Every way of waiting counts: ``wait()`` on the handle (a blocking all-reduce calls it itself),
    ``wait()`` on one of its futures (``get_future()``, or a future chained to one with ``then()``),
    on the future ``torch.futures.wait_all`` or ``collect_all`` makes of them, and ``is_completed()``
    or ``done()`` once they answer True (polling until the all-reduce is over is waiting for it)."""
    import torch.distributed as dist

    records: list[dict] = []
    by_work: dict[int, dict] = {}
    by_future: dict[int, list[dict]] = {}
    kept: list[Any] = []  # the futures seen, kept alive so that their ids stay their own
    group_class = dist.ProcessGroup
    future_class = torch._C.Future
    held: dict[tuple[Any, str], Any] = {}  # what each patched class or module held, put back afterwards

    def patch(owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name, None)
        if original is None:  # not in this release
            return
        held[owner, name] = owner.__dict__.get(name)
        setattr(owner, name, make(original))

    def waited(found: list[dict] | None) -> None:
        for record in found or ():
            record["waited"] += 1

    def on_futures(futures: list[Any], found: list[dict]) -> None:
        for future in futures:
            kept.append(future)
            by_future.setdefault(id(future), []).extend(found)

    def watch_work_class(cls: type) -> None:
        """Patch the methods of the handles of class ``cls`` (the class a release's backend returns)."""
        def wait(original: Any) -> Any:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                if id(self) in by_work:
                    waited([by_work[id(self)]])
                return original(self, *args, **kwargs)
            return call
        patch(cls, "wait", wait)

        def is_completed(original: Any) -> Any:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                done = original(self, *args, **kwargs)
                if done and id(self) in by_work:
                    waited([by_work[id(self)]])
                return done
            return call
        patch(cls, "is_completed", is_completed)

        def get_future(original: Any) -> Any:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                future = original(self, *args, **kwargs)
                if id(self) in by_work:
                    on_futures([future], [by_work[id(self)]])
                return future
            return call
        patch(cls, "get_future", get_future)

    def future_wait(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            waited(by_future.get(id(self)))
            return original(self, *args, **kwargs)
        return call

    def future_done(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            done = original(self, *args, **kwargs)
            if done:
                waited(by_future.get(id(self)))
            return done
        return call

    def future_then(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            chained = original(self, *args, **kwargs)
            if id(self) in by_future:
                on_futures([chained], by_future[id(self)])
            return chained
        return call

    def collect_all(original: Any) -> Any:
        def call(futures: Any, *args: Any, **kwargs: Any) -> Any:
            collected = original(futures, *args, **kwargs)
            found = [r for f in futures for r in by_future.get(id(f), [])]
            if found:
                on_futures([collected], found)
            return collected
        return call

    def allreduce(original: Any) -> Any:
        def call(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            handed = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            sent = torch.cat([t.detach().flatten() for t in handed]).clone() if handed else torch.zeros(0)
            work = original(self, tensors, *args, **kwargs)
            record = {"numel": sum(t.numel() for t in handed), "ptrs": [t.data_ptr() for t in handed],
                      "sent": sent, "work": work, "waited": 0}  # the record keeps the handle: its id stays
            records.append(record)
            by_work[id(work)] = record
            if (type(work), "wait") not in held:
                watch_work_class(type(work))
            return work
        return call

    try:
        patch(group_class, "allreduce", allreduce)
        patch(future_class, "wait", future_wait)
        patch(future_class, "done", future_done)
        patch(future_class, "then", future_then)
        patch(torch._C, "_collect_all", collect_all)
        yield records
    finally:
        for (owner, name), descriptor in held.items():
            if descriptor is None:
                delattr(owner, name)
            else:
                setattr(owner, name, descriptor)


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
    unwaited = any(not r["waited"] for r in reduced)  # before the barrier, which finishes earlier work
    dist.barrier()
    if unwaited:
        return ("average_gradients returned before waiting for an all-reduce it started: until its "
                "handle is waited for, an asynchronous all-reduce may not have finished, and the gradient "
                "may not hold the sum yet when the optimizer reads it")
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


def _on_every_world_size(rank_fn: Any, answer: Any) -> str | None:
    """The first hint ``rank_fn`` gives on ``answer``, trying each of ``WORLDS`` in turn."""
    for world_size in WORLDS:
        hint = hint_from_ranks(rank_fn, world_size, answer, hang_hint=(
            "the ranks hung: every rank must all-reduce the same gradients, in the same order"))
        if hint is not None:
            return hint
    return None


def _judge_average_gradients(answer: Any) -> str | None:
    return _on_every_world_size(average_rank, answer)


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
        local = lesson_model(tied=True, frozen=True)  # this rank's own gradients, before any all-reduce
        local.load_state_dict(model.state_dict())
        F.mse_loss(local(xr), yr).backward()
        own = [p.grad.flatten() for p in local.parameters() if p.grad is not None]
        optimizer.zero_grad()
        loss = F.mse_loss(ddp_model(xr), yr)
        with all_reduces_watched() as reduced:
            loss.backward()
            during = [r["numel"] for r in reduced]
            if any(r["waited"] for r in reduced):
                return ("the backward pass waited for an all-reduce: a hook that waits in any way (wait() on "
                        "the handle or on its future, polling is_completed() until it is true, a blocking "
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
        grads = {p.grad.data_ptr() for p in model.parameters() if p.grad is not None}
        if not all(_is_gradient(r, grads, own, world_size) for r in reduced[:len(during)]):
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


def _is_gradient(record: dict, grads: set[int], own: list[torch.Tensor], world_size: int) -> bool:
    """Whether an all-reduce (a record of :func:`all_reduces_watched`) reduced a gradient: a tensor that
    is a parameter's ``.grad``, or whose values were this rank's gradient of a parameter (or that
    divided by the world size) when it started."""
    if any(ptr in grads for ptr in record["ptrs"]):
        return True
    sent = record["sent"]
    return any(g.numel() == sent.numel() and (torch.allclose(sent, g, rtol=1e-4, atol=1e-7) or torch.allclose(
        sent, g / world_size, rtol=1e-4, atol=1e-7)) for g in own)


def _judge_hooks(answer: Any) -> str | None:
    return _on_every_world_size(hooks_rank, answer)


EXERCISES = load_bank(__name__)
