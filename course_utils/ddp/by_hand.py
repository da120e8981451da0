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

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_dense
from ..compat import queue_backward_callback
from .buckets import assign_buckets, fill_buckets
from .by_hand_guard import guard_steps, refuse_changed_parameters, refuse_unfinished, take_over
from .timeline import Event, Timeline

__all__ = ["DDPByHand", "Event", "Timeline", "assign_buckets", "average_gradients",
           "broadcast_from_rank_0"]


def broadcast_from_rank_0(module: nn.Module, buffers: bool = True) -> None:
    """Every rank takes rank 0's parameters and (unless ``buffers=False``, as DDP with
    ``broadcast_buffers=False``) buffers, as DDP does when it is built: ranks that were seeded
    differently start equal."""
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers() if buffers else ()):
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


class DDPByHand(nn.Module):
    """Data parallelism on the current process group, written by hand (steps 2 and 3).

    ``DDPByHand(module, bucket_cap_mb=None)`` keeps ``module`` as ``.module`` (so the state dict's
    keys start with ``module.``, as under DDP), and its forward is the module's. Use it as DDP::

        ddp_model = DDPByHand(model, bucket_cap_mb=1)
        loss_fn(ddp_model(x), y).backward()   # the hooks start the all-reduces; at its end, the means
        optimizer.step()

    When it is built, every rank takes rank 0's parameters and buffers. Each parameter that trains
    gets a hook on its gradient accumulator (autograd's ``AccumulateGrad`` node, from
    ``torch.autograd.graph.get_gradient_edge``), as DDP's reducer does: it runs once the gradient is
    complete in ``.grad``, after every hook registered on the parameter itself, before or after
    wrapping (so what such a hook writes is what is sent, as under DDP); a tied weight appears once
    in ``module.parameters()`` and its hook runs once, after both contributions are summed. A
    parameter with ``requires_grad=False`` gets no hook.

    **Buckets, launched in sequence.** :func:`assign_buckets` groups the parameters (``None``: a
    bucket each). All-reduces pair up across ranks in the order they are issued, so every rank must
    issue the same buckets in the same order, whatever order its gradients arrive in (a layer that
    runs in a rank-dependent order, as routing or layer drop make it): a hook marks its bucket
    ready, and the wrapper then starts, in bucket order, every bucket whose turn has come (DDP's
    reducer does the same: bucket i starts after buckets 0 to i-1). Each gradient is copied into
    its place in its bucket's flat tensor (made once, with the buckets) the moment it is ready, as
    DDP's reducer copies it (a hook that runs later changes nothing that is sent); a complete
    bucket is all-reduced, and ``finish_gradient_synchronization`` waits, divides by the world
    size and copies the mean back into each ``.grad``.

    **Finished when backward ends, as DDP.** When the last bucket starts, its hook queues
    ``finish_gradient_synchronization`` on autograd's engine (as DDP's reducer queues its end),
    which runs it once every gradient is computed, before ``backward()`` returns: each ``.grad``
    then holds the mean, and a later call does nothing. If that backward pass raises before its
    end, the next forward with gradients raises, as DDP's does. ``backward(create_graph=True)``
    raises, as in DDP, and so does a forward after the parameters changed dtype or device
    (``model.double()`` after wrapping), where DDP stops synchronising them without a word.

    **Rebuilt once, in the order the gradients arrived.** The first buckets assume that backward
    produces the gradients in reverse registration order. The first synchronised step records the
    order in which they really arrived; at the next forward run with gradients (``no_sync()`` or
    not, as in DDP), the wrapper takes rank 0's order (a broadcast) and fills the buckets again in
    that order, as DDP rebuilds its buckets after its first iteration (``rebuild_buckets=False``
    keeps the first ones).

    **When the hooks act** (DDP's rules, from its reducer). A forward run with gradients outside
    ``no_sync()`` *arms* the hooks; the backward pass that then reaches every parameter that trains
    starts every bucket and *disarms* them. A hook that is not armed does nothing: under
    ``with ddp_model.no_sync():`` a forward arms nothing and the gradients add up in ``.grad`` on
    each rank; a forward under ``no_sync()`` after an armed one leaves it armed (its backward is
    synchronised, as in DDP); a second backward pass of one graph (``retain_graph=True``) finds the
    hooks disarmed and adds this rank's gradients to the mean, unsynchronised, as in DDP. A wrapper
    built on parameters that an earlier one hooked takes their hooks (it raises if the earlier one
    has all-reduces unfinished), and the earlier one's forward raises from then on.

    **Missing gradients.** A parameter that trains and gets no gradient in an armed backward pass
    (unused) leaves its bucket incomplete, and the buckets after it are never started, so nothing
    is finished when that backward ends: the next forward run with gradients raises
    ``RuntimeError`` on that rank (where DDP raises), and so do an optimizer's ``step()`` over its
    parameters, ``finish_gradient_synchronization()`` and a backward pass that reaches a parameter
    twice (as DDP's "mark a variable ready only once"); a rank that did get every gradient waits
    in its all-reduce until the one that raised has gone, and then fails too. DDP's
    ``find_unused_parameters=True``, which marks such parameters ready, is not written here.

    ``broadcast_buffers`` (default True, as DDP): rank 0's buffers are sent to every rank when the
    wrapper is built and before a forward that follows a synchronised forward run with gradients
    (BatchNorm's running statistics); with False, never. A forward under ``torch.no_grad()`` arms
    nothing, and the forward after it broadcasts nothing (DDP's ``require_forward_param_sync``).
    ``timeline`` (a :class:`Timeline`) records when each all-reduce starts, finishes and is waited
    for. Parameters of different dtypes or devices go in different buckets; sparse gradients are
    refused.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None,
                 timeline: Timeline | None = None, *, rebuild_buckets: bool = True,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.module = module
        self.timeline = timeline or Timeline(record=False)
        self.world_size = dist.get_world_size()
        self.bucket_cap_mb = bucket_cap_mb
        self.broadcast_buffers = broadcast_buffers
        broadcast_from_rank_0(module, buffers=broadcast_buffers)  # as DDP
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self.index_of = {param: i for i, param in enumerate(self.trainable)}
        self.layout = [(p.dtype, p.device) for p in self.trainable]  # the buckets are made for these
        self.require_sync = True  # False under no_sync()
        self.armed = False  # the hooks act: set by a synchronised forward, cleared by its backward
        self.buffers_follow = True  # whether the next forward starts with rank 0's buffers
        self.arrival: list[int] | None = [] if rebuild_buckets else None  # the first step's order
        self._set_buckets(assign_buckets(self.trainable, bucket_cap_mb))
        self.accumulators: list[Any] = []  # held, as DDP holds them: autograd's AccumulateGrad nodes
        for param in self.trainable:
            # a hook on param's gradient accumulator: it runs once param.grad is complete, after
            # every hook on param itself (DDP's reducer too); take_over removes an earlier wrapper's
            take_over(param, self, lambda _, __, p=param: self._gradient_ready(p))
        guard_steps(self)  # an optimizer's step while all-reduces are unfinished raises

    def _set_buckets(self, buckets: list[list[nn.Parameter]]) -> None:
        check_dense(self.module)  # a bucket is one flat tensor: no sparse gradient fits
        self.buckets = buckets
        # where each gradient goes: its bucket, and its offset in the bucket's flat tensor (one per
        # bucket, made once and reused every step)
        self.place = {p: (b, sum(q.numel() for q in bucket[:i]))
                      for b, bucket in enumerate(buckets) for i, p in enumerate(bucket)}
        self.flat = [torch.empty(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                                 device=bucket[0].device) for bucket in buckets]
        self._reset()

    def _reset(self) -> None:
        self.arrived = [0] * len(self.buckets)  # gradients ready in each bucket, this step
        self.next_bucket = 0  # the next bucket to start: buckets start in order
        self.ready: set[nn.Parameter] = set()  # marked ready since the last finish
        self.in_flight: list[tuple[int, torch.Tensor, Any]] = []  # (bucket, tensor, handle)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "replaced", False):
            raise RuntimeError("a newer DDPByHand wraps these parameters and took their hooks: train "
                               "with that one (this one would no longer synchronise anything)")
        refuse_changed_parameters(self)
        grad = torch.is_grad_enabled()
        synced = grad and self.require_sync  # a forward under no_grad or no_sync arms nothing
        if self.ready and grad:  # the last synchronised backward did not finish: raise, as DDP's forward
            refuse_unfinished(self)
        if grad and self.arrival and len(self.arrival) == len(self.trainable):
            self._rebuild_buckets()  # as DDP: at the first forward with gradients after a full step
        if self.broadcast_buffers and self.buffers_follow:
            with torch.no_grad():
                for buffer in self.module.buffers():
                    dist.broadcast(buffer, src=0)
        output = self.module(*args, **kwargs)
        if synced:
            self.armed = True  # the next backward pass synchronises (DDP's prepare_for_backward)
        # as DDP: the buffers are broadcast before a forward only if the one before it was a
        # synchronised forward with gradients (under no_sync, each rank's buffers stay its own)
        self.buffers_follow = synced
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A forward run inside arms no hook: unless a synchronised forward armed them before, its
        backward pass all-reduces nothing and the gradients add up in ``.grad`` (DDP's ``no_sync``:
        the forwards decide, wherever the backward runs)."""
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def _gradient_ready(self, param: nn.Parameter) -> None:
        """The hook: ``param.grad`` is complete. Start every bucket whose turn has come."""
        if param in self.ready:
            raise RuntimeError(f"{self._name(param)} was marked ready twice in one synchronisation: "
                               "a backward pass left a parameter out and the next reached one again, "
                               "or a reentrant checkpoint (use_reentrant=True) sent it a second "
                               "gradient in one backward pass (DDP: 'Expected to mark a variable "
                               "ready only once')")
        if not self.armed:
            return  # under no_sync(), or a second backward pass of one graph: as in DDP
        if param.grad.requires_grad:
            raise RuntimeError("backward(create_graph=True) reached a parameter: the all-reduce is not "
                               "part of the gradient's graph, so a second backward would differentiate "
                               "this rank's gradient alone (torch's DDP raises here too)")
        self._copy_into_bucket(param)
        if self.arrival is not None:
            self.arrival.append(self.index_of[param])
        while self.next_bucket < len(self.buckets) and \
                self.arrived[self.next_bucket] == len(self.buckets[self.next_bucket]):
            self._start_all_reduce(self.next_bucket)
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets):
            self.armed = False  # every bucket started: this backward's work is done (DDP's finalize)
            queue_backward_callback(self._backward_ended)  # autograd runs it when backward ends

    def _backward_ended(self) -> None:
        """Run by autograd's engine once the backward pass has computed every gradient, before
        ``backward()`` returns, as DDP's reducer finishes: wait for the all-reduces and leave the
        means in ``.grad``."""
        self.timeline.mark("backward_end")
        self.finish_gradient_synchronization()

    def _copy_into_bucket(self, param: nn.Parameter) -> None:
        """Mark ``param`` ready and copy its gradient into its place in its bucket, at once, as DDP's
        reducer does: what is sent is the gradient as it was when it became ready."""
        self.ready.add(param)
        b, start = self.place[param]
        self.flat[b][start:start + param.numel()].copy_(param.grad.reshape(-1))
        self.arrived[b] += 1

    def _name(self, param: nn.Parameter) -> str:
        return next((n for n, p in self.module.named_parameters() if p is param), "a replaced parameter")

    def _start_all_reduce(self, b: int) -> None:
        handle = dist.all_reduce(self.flat[b], async_op=True)  # returns at once; the backend sends it
        self.timeline.started(handle, b)
        self.in_flight.append((b, self.flat[b], handle))

    def _rebuild_buckets(self) -> None:
        """The buckets again, filled in the order rank 0's gradients arrived in its first step."""
        order = torch.tensor(self.arrival, dtype=torch.int64, device=self.trainable[0].device)
        self.arrival = None  # once
        if len(order) != len(self.trainable):
            return  # the first step was incomplete (and raised): keep the buckets
        dist.broadcast(order, src=0)
        self._set_buckets(fill_buckets([self.trainable[i] for i in order.tolist()], self.bucket_cap_mb))

    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce, in the order they started, and leave each ``.grad`` holding
        the mean over the ranks. Autograd's engine calls it when the backward pass that started the
        last bucket ends; a later call finds nothing to do, unless a bucket never started (a
        parameter got no gradient): then it raises, and says which."""
        if not self.ready:
            return  # no synchronised backward since the last call
        missing = list(range(self.next_bucket, len(self.buckets)))  # never started
        for b, flat, handle in self.in_flight:
            self.timeline.mark("wait_start", b)
            handle.wait()
            self.timeline.mark("wait_end", b)
            flat /= self.world_size
            bucket = self.buckets[b]
            for param, mean in zip(bucket, flat.split([p.numel() for p in bucket]), strict=True):
                if param.grad is None:  # set to None after its hook: DDP gives it the mean too
                    param.grad = torch.empty_like(param)
                param.grad.copy_(mean.view_as(param))
        self._reset()
        if missing:
            self.armed = False
            if self.arrival is not None and len(self.arrival) < len(self.trainable):
                self.arrival = []  # record the order again in the next complete step
            raise RuntimeError(
                f"bucket {missing[0]} did not get each of its gradients exactly once in this backward "
                f"pass (it holds {[self._name(p) for p in self.buckets[missing[0]]]}), so buckets "
                f"{missing} were never all-reduced and the ranks would drift apart: every parameter "
                "that trains must take part in the loss (DDP's find_unused_parameters=True, which "
                "marks the others ready, is not written here)")
