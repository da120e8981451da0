"""ZeRO by hand: data parallelism whose model state is split over the ranks (notebook 10).

``ZeroByHand(model, stage)`` trains ``model`` on the current process group at ZeRO stage 0 (plain
data parallelism: an all-reduce of the gradients, then a divide; DDP divides first), 1, 2 or 3. Every
module that owns parameters that train is one *unit*: those parameters become views of one flat
buffer, padded to a multiple of the world size N, and rank r owns the r-th of N equal slices of
each buffer (its *shard*). Stage 0 does not pad.

- stage 0: all-reduce the flat gradient; every rank runs the optimizer on everything.
- stage 1: the optimizer (and so its state) holds only the shards. The gradient is
  reduce-scattered (the first half of a ring all-reduce: each rank only needs its slice summed),
  the shard is updated, and the updated shards are all-gathered back into the flat buffer.
- stage 2: as 1, but each unit's gradient is reduce-scattered during backward, once backward has
  produced all of it, and the full gradient is freed: only gradient shards persist. The units are
  reduced in one fixed order on every rank (the last module first; a unit ready early waits for its
  turn), as DDP starts its buckets in order: collectives pair up by the order they are called in.
- stage 3: the flat buffers are freed (their storage resized to 0; each parameter then holds an
  empty tensor) and all-gathered just in time: before the unit's forward and again before its
  backward; freed after each. Every rank must run its modules in the same order (one int per rank,
  all-gathered before each gather and not counted, checks it; FSDP has the same rule), and a
  parameter read outside its own module's forward (``nn.MultiheadAttention``'s ``out_proj``, a
  weight tied through ``F.linear``) is empty there, and torch's error then names a shape, not
  this rule (FSDP would want the module that reads it as the unit; here every module that owns
  parameters is one). Between steps a parameter reads as empty and a write to it is lost: change
  the parameters through the optimizer, or read ``full_parameters()``.

Every collective of a training step goes through ``CommLog``, which records the bytes this rank
sends in a ring implementation of that collective, counted from the tensors passed to it.

What it shares with DDP: when it is built, every rank takes rank 0's parameters and buffers; before
a forward that follows a forward run with gradients, rank 0's buffers again (BatchNorm's running
statistics; DDP's ``broadcast_buffers=True``; FSDP does neither); gradients from several backward
passes before a step add up (stages 1-3 ask for this object's ``zero_grad()`` between steps: they
keep only slices of the averaged gradient, which ``model.zero_grad()`` does not reach). Every
backward pass is reduced: DDP leaves unsynchronised a backward pass that no forward with gradients
armed (a second backward pass of one graph, or the second of two backward passes run after two
forwards). A parameter that trains and gets no gradient is an error, never a silent skip: at stages
2-3 (each backward pass must reduce every unit) at the next forward with gradients, the next
backward pass that reaches the unit or ``step()``, whichever comes first; at stages 0-1 at
``step()``; DDP raises at the next forward. A frozen parameter (``requires_grad=False``) is in no
unit: every rank keeps it whole. A parameter two modules share (a tied weight) belongs to the unit
of the first module that owns it; stage 3, which frees each unit after its own forward, refuses one.
The parameters of one module share a dtype (one flat buffer). At stage 3, ``state_dict()`` raises:
take ``full_parameters()``. """

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import get_gradient_edge

from .._checks import check_dense
from ..compat import all_gather_single
from . import flat_units
from .flat_units import CommLog, FlatUnit, shard_numel

__all__ = ["CommLog", "STAGES", "ZeroByHand", "shard_numel"]

STAGES = (0, 1, 2, 3)


class ZeroByHand:
    """Train ``model`` with data parallelism at ZeRO ``stage`` (0-3) by hand (notebook 10).

    ``optimizer_cls(params, **optimizer_kwargs)`` is built over the shards (stages 1-3: one of
    ``flat_units.ELEMENTWISE``) or the whole model (stage 0). Call ``zero_grad()``, the forward,
    ``loss.backward()``, ``clip_grad_norm_(max_norm)`` to clip (``nn.utils.clip_grad_norm_`` would
    see this rank's own gradients at stages 0-1, none at 2-3), then ``step()``. The loss is the
    mean over this rank's rows: gradients are averaged over ranks."""

    def __init__(self, model: nn.Module, stage: int, optimizer_cls: type = torch.optim.AdamW,
                 comm: CommLog | None = None, **optimizer_kwargs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroByHand needs a process group: run it inside launch(...)")
        check_dense(model)
        flat_units.check_elementwise(optimizer_cls, stage)
        self.model, self.stage = model, stage
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.comm = comm if comm is not None else CommLog()
        with torch.no_grad():  # every rank starts from rank 0's model, as under DDP
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        if stage == 3:
            flat_units.refuse_shared(model)
        taken: set[nn.Parameter] = set()
        self.units: list[FlatUnit] = []
        for m in model.modules():
            if any(p.requires_grad and p not in taken for p in m.parameters(recurse=False)):
                self.units.append(FlatUnit(m, self.world_size, self.rank, stage, taken, len(self.units)))
        self.names = {p: n for n, p in model.named_parameters()}
        # stages 2-3 reduce the units in one fixed order on every rank, the last module first (as
        # backward usually reaches them), whatever order this rank's gradients arrive in
        self.order, self.next_unit, self.stepped = self.units[::-1], 0, False
        self.round: set[nn.Parameter] = set()  # every gradient ready since the last unit was reduced
        params = [p for u in self.units for p in u.params] if stage == 0 else [u.shard for u in self.units]
        self.optimizer = optimizer_cls(params, **optimizer_kwargs)
        self.buffers_follow = True  # DDP's rule: rank 0's buffers before a forward after one with grads
        model.register_forward_pre_hook(lambda m, a: self._before_forward())
        model.register_forward_hook(lambda m, a, out: setattr(self, "buffers_follow",
                                                              torch.is_grad_enabled()))
        # stages 2-3: a hook on each gradient's accumulator, which runs after every hook on the
        # parameter itself (a user's, before or after wrapping, sees the gradient), as in DDP
        self.accumulators = []  # held: autograd then uses them in every graph
        for unit, p in [(u, p) for u in self.units for p in u.params] if stage >= 2 else []:
            self.accumulators.append(get_gradient_edge(p).node)
            self.accumulators[-1].register_hook(lambda _, __, p=p, u=unit: self._grad_ready(u, p))
        if stage == 3:
            model.register_state_dict_pre_hook(self._no_state_dict)
            for unit in self.units:
                unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._unshard(u))
                unit.module.register_forward_hook(lambda m, a, out, u=unit: self._after_forward(u, out))
                self._reshard(unit)

    def _no_state_dict(self, *args: Any) -> None:
        raise RuntimeError("at stage 3 each rank holds only shards between steps: take "
                           "full_parameters() (under FSDP: torch.distributed.checkpoint)")

    def _before_forward(self) -> None:
        if torch.is_grad_enabled():  # as DDP: a forward with gradients after an incomplete backward
            self._complete("the last backward pass")
        for unit in self.units:
            flat_units.refuse_replaced(unit, self.stage)
        for buffer in self.model.buffers() if self.buffers_follow else ():
            self.comm.count("broadcast", buffer)
            dist.broadcast(buffer.detach(), src=0)

    # region: stage3
    def _unshard(self, unit: FlatUnit) -> None:
        """Stage 3: bring the unit's full parameters back, just in time (all-gather)."""
        if unit.flat.untyped_storage().nbytes():
            return  # already here (a second output of the unit reached backward)
        self._same_unit_everywhere(unit)
        unit.flat.untyped_storage().resize_(unit.nbytes)
        with torch.no_grad():
            self.comm.all_gather(unit.flat, unit.shard.detach())
        for p, view in zip(unit.params, unit.views, strict=True):
            p.data = view

    def _reshard(self, unit: FlatUnit) -> None:
        """Stage 3: free the full parameters; autograd's saved views see them again at unshard."""
        for p in unit.params:
            p.data = unit.placeholder  # read between uses, a parameter is empty, not freed memory
        unit.flat.untyped_storage().resize_(0)

    def _after_forward(self, unit: FlatUnit, out: Any) -> None:
        """Stage 3: free after forward; gather again when backward reaches this unit's output
        (any tensor of it: nn.LSTM returns tensors in nested tuples), unless this backward pass has
        already reduced the unit (an output that passes its input through reaches backward late)."""
        self._reshard(unit)
        unit.reduced_since_forward = False
        if torch.is_grad_enabled() and not flat_units.output_tensors(out):
            raise RuntimeError(f"stage 3 found no tensor in what {type(unit.module).__name__} returned "
                               f"({type(out).__name__}) to hook for its backward pass")
        for tensor in flat_units.output_tensors(out):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad: None if unit.reduced_since_forward else self._unshard(unit))
    # endregion

    # region: reduce
    def _reduce(self, unit: FlatUnit) -> None:
        """Sum the unit's gradient over the ranks; keep what this stage keeps."""
        grad = unit.flat_grad()
        if self.stage == 0:
            self.comm.all_reduce(grad)
            grad /= self.world_size
            unit.reduced = True
            return
        mine = torch.empty_like(unit.shard)
        self.comm.reduce_scatter(mine, grad)
        mine /= self.world_size
        if self.stage == 1:  # the full gradient stays (stage 1 frees nothing); our slice is summed
            grad[unit.lo:unit.lo + unit.size].copy_(mine)
            unit.shard.grad = grad[unit.lo:unit.lo + unit.size]
        else:  # stages 2 and 3: only the shard of the gradient lives on (and adds up over backwards)
            if self.stepped and unit.shard.grad is not None:
                raise RuntimeError("the gradient shards of the last step are still here: call this "
                                   "ZeroByHand's zero_grad() between steps (model.zero_grad() does not "
                                   "reach the shards, which only the wrapper holds)")
            unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
            for p in unit.params:
                p.grad = None
        unit.reduced = True
    # endregion

    def _grad_ready(self, unit: FlatUnit, param: nn.Parameter) -> None:
        """Stages 2-3: reduce-scatter each unit once backward has produced all its gradients, the
        units in one fixed order (a unit ready early waits for its turn), as DDP starts its buckets."""
        if param in self.round:  # as DDP's "mark a variable ready only once"
            self._complete("the backward pass before this one (or a reentrant checkpoint sent "
                           f"{self.names[param]} a second gradient in this one: use_reentrant=False)")
        self.round.add(param)
        unit.arrived.add(param)
        while self.next_unit < len(self.order) and \
                len(self.order[self.next_unit].arrived) == len(self.order[self.next_unit].params):
            done = self.order[self.next_unit]
            self._reduce(done)
            done.arrived.clear()
            done.reduced_since_forward = True
            if self.stage == 3:
                self._reshard(done)
            self.next_unit += 1
        if self.next_unit == len(self.order):
            self.next_unit = 0  # every unit reduced: this backward pass is done
            self.round.clear()
            for each in self.units:  # a second backward pass of the same graph gathers them again
                each.reduced_since_forward = False

    def _complete(self, which: str) -> None:
        """Stages 2-3: raise if a backward pass left a unit without all its gradients (DDP raises
        at the next forward; here also at the next backward that reaches it, and at ``step()``)."""
        if self.next_unit == 0 and not any(unit.arrived for unit in self.units):
            return
        missing = [self.names[p] for u in self.order[self.next_unit:] for p in u.params if p not in u.arrived]
        self.next_unit = 0
        self.round.clear()
        for unit in self.units:
            unit.arrived.clear()
        raise RuntimeError(f"{missing} got no gradient in {which} on this rank: stages 2-3 reduce each "
                           "backward pass's gradients, so every parameter that trains must take part in "
                           "each (DDP raises at the next forward)")

    def _same_unit_everywhere(self, unit: FlatUnit) -> None:
        """Stage 3: an all-gather pairs the ranks' shards by the order it is called in, so every rank
        must gather the same unit at once; one int per rank checks it (not counted in ``comm``)."""
        every = torch.empty(self.world_size, dtype=torch.int64, device=unit.flat.device)
        all_gather_single(every, torch.tensor([unit.index], device=unit.flat.device))
        if (every != unit.index).any():
            raise RuntimeError(f"stage 3: the ranks gather units {every.tolist()} at the same moment: "
                               "their modules run in different orders, which stage 3 (as FSDP) cannot "
                               "follow, since each all-gather pairs the shards by the order it is called in")

    # region: step
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradient to a norm of at most ``max_norm``, as ``clip_grad_norm_`` on DDP's."""
        return flat_units.clip_units(self, max_norm)

    def reduce_gradients(self) -> None:
        """Raise if a gradient is missing; stages 0-1: reduce them (once; 2-3 did in backward)."""
        if self.stage <= 1:
            missing = [self.names[p] for u in self.units for p in u.params if p.grad is None]
        else:  # each backward pass must have reduced every unit
            self._complete("the last backward pass")
            missing = [self.names[p] for u in self.units if not u.reduced for p in u.params]
        if missing:
            raise RuntimeError(f"{missing} got no gradient in the last backward pass on this rank: "
                               "every parameter that trains must take part in the loss (DDP raises at "
                               "the next forward)")
        if self.stage == 1 and self.stepped:
            raise RuntimeError("stage 1 keeps only this rank's slice of the averaged gradient after a "
                               "step, so gradients cannot add up across steps as under DDP: call "
                               "zero_grad() before each step's backward passes")
        for unit in self.units if self.stage <= 1 else ():
            if not unit.reduced:
                self._reduce(unit)

    def step(self) -> None:
        """Reduce the gradients (stages 0-1; 2-3 did during backward), step, gather the shards."""
        self.reduce_gradients()
        self.optimizer.step()
        self.stepped = True
        for unit in self.units:
            unit.reduced = False
            if self.stage == 3 and unit.flat.untyped_storage().nbytes():
                self._reshard(unit)  # gathered after its reduce: stale now that the shard moved
        if self.stage in (1, 2):
            for unit in self.units:
                with torch.no_grad():
                    self.comm.all_gather(unit.flat, unit.shard.detach().clone())
    # endregion

    def zero_grad(self) -> None:
        self.next_unit, self.stepped = 0, False  # also after a backward pass that raised
        self.round.clear()
        for unit in self.units:
            unit.shard.grad = None
            unit.arrived.clear()
            for p in unit.params:
                p.grad = None

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter of the model, whole, in its order, on every rank (stage 3 gathers them
        for the occasion)."""
        for unit in self.units if self.stage == 3 else ():
            self._unshard(unit)
        out = [p.detach().clone() for p in self.model.parameters()]
        for unit in self.units if self.stage == 3 else ():
            self._reshard(unit)
        return out

    def held_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds now: parameters, gradients, optimizer state
        (:func:`~.flat_units.held_bytes`)."""
        return flat_units.held_bytes(self)
