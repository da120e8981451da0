"""What ``DistributedDataParallel`` does between ``backward()`` and ``step()``, written by hand
(notebook 06, DDP by hand).

Three versions, each a step of the lesson, each equal to torch's DDP (``tests/test_ddp_by_hand.py``):

1. :func:`average_gradients`: once ``backward()`` has finished, all-reduce every gradient and divide
   by the world size. One collective per parameter, all of them after the backward pass.
2. :class:`DDPByHand` without a cap: a hook on every parameter starts an asynchronous all-reduce of
   its gradient the moment that gradient is ready, while the backward pass goes on with the layers
   before it; ``finish_gradient_synchronization()`` waits for them all and divides.
3. :class:`DDPByHand` with ``bucket_cap_mb``: the gradients travel in buckets (fewer, larger
   messages), one all-reduce per bucket, started when the bucket's last gradient arrives.

A :class:`Timeline` records when each of these happens on a rank (the notebook draws it).
:func:`assign_buckets` says which parameters share a bucket before anything runs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DDPByHand", "Event", "Timeline", "assign_buckets", "average_gradients",
           "broadcast_from_rank_0"]


class Event(NamedTuple):
    """One moment on a rank's timeline: ``what`` happened to bucket ``index`` at ``t`` seconds."""

    what: str  # backward_start, backward_end, all_reduce_start, all_reduce_done, wait_start, wait_end
    index: int | None
    t: float  # time.perf_counter(): one clock for every process of this machine


class Timeline:
    """The events of one rank, in the order they happened (with ``record=False``, none are kept).

    The training loop marks ``backward_start`` and ``backward_end``; the versions mark, per
    all-reduce, when it was started, when the backend finished it (``all_reduce_done``: on gloo the
    moment its thread is done; on NCCL, when the work was queued on the GPU's stream, not when the
    GPU ended it) and when the training loop waited for it (``wait_start``, ``wait_end``).
    """

    def __init__(self, record: bool = True) -> None:
        self.record = record
        self.events: list[Event] = []

    def mark(self, what: str, index: int | None = None) -> None:
        if self.record:
            self.events.append(Event(what, index, time.perf_counter()))

    def started(self, handle: Any, index: int) -> None:
        """An asynchronous all-reduce of bucket ``index`` was just started: mark it, and mark it
        done when the backend completes it."""
        self.mark("all_reduce_start", index)
        if self.record:
            handle.get_future().then(lambda _: self.mark("all_reduce_done", index))


def broadcast_from_rank_0(module: nn.Module) -> None:
    """Every rank takes rank 0's parameters and buffers, as DDP does when it is built: ranks that
    were seeded differently start equal."""
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor, src=0)


def average_gradients(model: nn.Module, timeline: Timeline | None = None) -> None:
    """Step 1: after ``backward()``, replace every gradient by its mean over the ranks.

    One all-reduce per parameter that trains (``requires_grad``), in registration order, each a
    blocking call (on gloo it returns when the sum has arrived; on NCCL when it is queued on the
    GPU's stream, which runs them in order): the backward pass is over by then, so nothing
    overlaps. ``timeline`` numbers them by that order.
    """
    timeline = timeline or Timeline(record=False)
    world_size = dist.get_world_size()
    trainable = [p for p in model.parameters() if p.requires_grad]
    for i, param in enumerate(trainable):
        timeline.mark("all_reduce_start", i)
        dist.all_reduce(param.grad)  # the sum over the ranks, in place
        timeline.mark("all_reduce_done", i)
        param.grad /= world_size


def assign_buckets(parameters: Iterable[nn.Parameter],
                   bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """The buckets of step 3: ``parameters`` in reverse order (the order in which backward
    produces their gradients), each bucket filled until it reaches ``bucket_cap_mb`` MiB (2**20
    bytes), DDP's rule.

    A parameter always joins the current bucket; the bucket closes as soon as its size has reached
    the cap, so a bucket can pass the cap by its last parameter, and a parameter larger than the cap
    closes the bucket it lands in. A parameter is never split. ``None``: every parameter in a bucket
    of its own (step 2). Torch's DDP applies the same rule (an explicit ``bucket_cap_mb`` caps its
    first bucket too, in torch 2.13), but by default it sends its first step's gradients in one
    bucket and then rebuilds its buckets in the order the gradients arrived, and it keeps buckets of
    different dtypes or devices apart.
    """
    cap_bytes = 0 if bucket_cap_mb is None else bucket_cap_mb * 2**20
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for param in reversed(list(parameters)):
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class DDPByHand(nn.Module):
    """Data parallelism on the current process group, written by hand (steps 2 and 3).

    ``DDPByHand(module, bucket_cap_mb=None)`` keeps ``module`` as ``.module`` (so the state dict's
    keys start with ``module.``, as under DDP), and its forward is the module's. Use it as DDP,
    with one call more::

        ddp_model = DDPByHand(model, bucket_cap_mb=1)
        loss_fn(ddp_model(x), y).backward()   # the hooks start the all-reduces
        ddp_model.finish_gradient_synchronization()   # wait for them, divide
        optimizer.step()

    When it is built, every rank takes rank 0's parameters and buffers. Each parameter that trains
    gets a hook (``register_post_accumulate_grad_hook``) that runs once its gradient is complete in
    ``.grad``; a parameter used twice (tied weights) appears once in ``module.parameters()`` and its
    hook runs once, after both contributions are summed, so it is reduced once. A parameter with
    ``requires_grad=False`` gets no hook and no collective.

    ``bucket_cap_mb=None`` (step 2): one asynchronous all-reduce per parameter, of ``.grad`` itself.
    With a cap (step 3), :func:`assign_buckets` groups the parameters; when a bucket's last gradient
    arrives, its gradients are copied into the bucket's flat tensor (``torch.cat``; the tensor is
    made once, when the wrapper is built, so that no step pays for a fresh allocation), that tensor
    is all-reduced, and ``finish_gradient_synchronization`` copies the averaged values back into
    each ``.grad``. The other design, DDP's ``gradient_as_bucket_view=True``, makes every ``.grad`` a
    view of one flat buffer and saves that copy; it is not used here because
    ``optimizer.zero_grad()`` sets gradients to ``None`` by default, and the next backward pass
    then creates fresh ones that are no longer views of the buffer. A bucket holding a single
    parameter is reduced in place, without a copy.

    Every rank must produce the same gradients in the same order (the same model and graph), every
    parameter that trains must get a gradient in each backward pass, as DDP's default
    (``find_unused_parameters=False``) also assumes, and ``finish_gradient_synchronization`` must
    follow every ``backward()`` (there is no ``no_sync`` for gradient accumulation): a bucket whose
    gradients did not all arrive exactly once is never sent, and ``finish_gradient_synchronization``
    raises ``RuntimeError`` instead of letting the ranks drift apart (DDP raises too). Buckets
    start in the order they fill, not strictly one after the other as DDP's reducer launches
    them; buffers are broadcast once, when the wrapper is built (DDP also re-broadcasts them before
    every forward by default: it matters for BatchNorm's running statistics). ``timeline`` (a
    :class:`Timeline`) records when each all-reduce starts, finishes and is waited for. The
    parameters should share one dtype and device (DDP also separates buckets by dtype and device).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 timeline: Timeline | None = None) -> None:
        super().__init__()
        self.module = module
        self.timeline = timeline or Timeline(record=False)
        self.world_size = dist.get_world_size()
        broadcast_from_rank_0(module)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(trainable, bucket_cap_mb)
        self.bucket_of = {param: b for b, bucket in enumerate(self.buckets) for param in bucket}
        # a flat tensor for each bucket of several parameters, made once and reused every step
        self.flat = [torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                                 device=bucket[0].device) if len(bucket) > 1 else None
                     for bucket in self.buckets]
        self.arrived = [0] * len(self.buckets)  # gradients ready in each bucket, this step
        self.in_flight: list[tuple[int, torch.Tensor, Any]] = []  # (bucket, tensor, handle)
        for param in trainable:
            param.register_post_accumulate_grad_hook(self._gradient_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _gradient_ready(self, param: nn.Parameter) -> None:
        """The hook: ``param.grad`` is complete. Start its bucket's all-reduce if it was the last."""
        b = self.bucket_of[param]
        self.arrived[b] += 1
        if self.arrived[b] == len(self.buckets[b]):
            self._start_all_reduce(b)

    def _start_all_reduce(self, b: int) -> None:
        bucket = self.buckets[b]
        if len(bucket) == 1:
            flat = bucket[0].grad  # reduced in place
        else:
            flat = torch.cat([p.grad.flatten() for p in bucket], out=self.flat[b])
        handle = dist.all_reduce(flat, async_op=True)  # returns at once; the backend sends it
        self.timeline.started(handle, b)
        self.in_flight.append((b, flat, handle))

    def finish_gradient_synchronization(self) -> None:
        """After ``backward()``, before ``optimizer.step()``: wait for every all-reduce, in the
        order they started, and leave each ``.grad`` holding the mean over the ranks."""
        missing = [b for b, bucket in enumerate(self.buckets) if self.arrived[b] != len(bucket)]
        for b, flat, handle in self.in_flight:
            self.timeline.mark("wait_start", b)
            handle.wait()
            self.timeline.mark("wait_end", b)
            flat /= self.world_size
            bucket = self.buckets[b]
            if len(bucket) > 1:
                for param, mean in zip(bucket, flat.split([p.numel() for p in bucket]), strict=True):
                    param.grad.copy_(mean.view_as(param))
        self.in_flight = []
        self.arrived = [0] * len(self.buckets)
        if missing:
            names = {p: n for n, p in self.module.named_parameters()}
            raise RuntimeError(
                f"buckets {missing} did not get each of their gradients exactly once in this backward "
                f"pass (first: {[names[p] for p in self.buckets[missing[0]]]}), so they were not "
                "all-reduced and the ranks would drift apart: every parameter that trains must take "
                "part in the loss, and finish_gradient_synchronization() must follow every backward()")
