"""ZeRO by hand: data parallelism whose model state is split over the ranks (notebook 10).

``ZeroByHand(model, stage)`` trains ``model`` on the current process group at ZeRO stage 0 (plain
data parallelism: DDP's arithmetic, an all-reduce of the gradients and a divide), 1, 2 or 3. Every
module that owns parameters that train is one *unit*: those parameters become views of one flat
buffer, padded to a multiple of the world size N, and rank r owns the r-th of N equal slices of
each buffer (its *shard*). Stage 0 does not pad.

- stage 0: all-reduce the flat gradient; every rank runs the optimizer on everything.
- stage 1: the optimizer (and so its state) holds only the shards. The gradient is
  reduce-scattered (the first half of a ring all-reduce: each rank only needs its slice summed),
  the shard is updated, and the updated shards are all-gathered back into the flat buffer.
- stage 2: as 1, but each unit's gradient is reduce-scattered as soon as backward has produced it,
  and the full gradient is freed: only gradient shards persist.
- stage 3: the flat buffers are freed (their storage resized to 0) and all-gathered just in time:
  before the unit's forward and again before its backward; freed after each.

Every collective of a training step goes through ``CommLog``, which records the bytes this rank
sends in a ring implementation of that collective, counted from the tensors passed to it.

What it shares with DDP: when it is built, every rank takes rank 0's parameters and buffers; before
a forward that follows a forward run with gradients, rank 0's buffers again (BatchNorm's running
statistics; DDP's ``broadcast_buffers=True``; FSDP does neither); gradients from several backward
passes before a step add up; a parameter that trains and got no gradient by ``step()`` is an error
(DDP raises at the next forward), never a silent skip. A frozen parameter (``requires_grad=False``)
is in no unit: every rank keeps it whole. A parameter two modules share (a tied weight) belongs to
the unit of the first module that owns it; stage 3, which frees each unit after its own forward,
refuses one (FSDP wants a shared parameter in the unit of a module above both).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_int
from ..compat import all_gather_single, reduce_scatter_single
from ..ddp.collectives import ring_bytes_per_rank

__all__ = ["CommLog", "STAGES", "ZeroByHand", "shard_numel"]

STAGES = (0, 1, 2, 3)


def shard_numel(numel: int, world_size: int) -> int:
    """Elements in one rank's shard of a flat buffer of ``numel`` elements: ``ceil(numel / N)``."""
    numel, world_size = check_int("numel", numel), check_int("world_size", world_size)
    if numel < 0 or world_size < 1:
        raise ValueError(f"numel must be >= 0 and world_size >= 1, got {numel} and {world_size}")
    return -(-numel // world_size)


class CommLog:
    """What one rank sends in a ring implementation of each collective (notebook 10).

    A ring all-reduce of B bytes sends ``2 B (N-1)/N``; a reduce-scatter sends ``(N-1)`` output
    chunks, an all-gather ``(N-1)`` input chunks: ``B (N-1)/N`` each for a full size of B; a
    broadcast of B bytes, passed along the ring, is sent by N-1 ranks: ``B (N-1)/N`` on average.
    ``dtypes`` records the dtypes each kind of collective carried.
    """

    def __init__(self) -> None:
        self.sent: dict[str, float] = {"all_reduce": 0.0, "reduce_scatter": 0.0, "all_gather": 0.0,
                                       "broadcast": 0.0}
        self.calls: dict[str, int] = dict.fromkeys(self.sent, 0)
        self.dtypes: dict[str, set[str]] = {kind: set() for kind in self.sent}

    @property
    def total(self) -> float:
        return sum(self.sent.values())

    def count(self, kind: str, tensor: torch.Tensor) -> None:
        """Log one collective of ``kind``. ``tensor``: the whole tensor of an all-reduce or a
        broadcast, the output (a shard) of a reduce-scatter, the input (a shard) of an all-gather."""
        n, nbytes = dist.get_world_size(), tensor.nbytes
        if kind == "all_reduce":
            sent: float = ring_bytes_per_rank(nbytes, n)  # 2B(N-1)/N: a float, on average
        elif kind == "broadcast":
            sent = nbytes * (n - 1) / n
        else:  # reduce-scatter and all-gather: N-1 shards
            sent = (n - 1) * nbytes
        self.sent[kind] += sent
        self.calls[kind] += 1
        self.dtypes[kind].add(str(tensor.dtype))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.count("all_reduce", tensor)
        dist.all_reduce(tensor)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:  # noqa: A002
        self.count("reduce_scatter", output)
        reduce_scatter_single(output, input)  # its name differs between releases: see compat

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:  # noqa: A002
        self.count("all_gather", input)
        all_gather_single(output, input)


class _Unit:
    """One module's parameters as views of a flat, padded buffer, and this rank's shard of it."""

    def __init__(self, module: nn.Module, world_size: int, rank: int, stage: int,
                 taken: set[nn.Parameter]) -> None:
        self.module = module
        self.params = [p for p in module.parameters(recurse=False) if p.requires_grad and p not in taken]
        taken.update(self.params)
        self.numel = sum(p.numel() for p in self.params)
        self.size = shard_numel(self.numel, world_size)
        first = self.params[0]  # stage 0 shards nothing, so it pads nothing
        self.flat = torch.zeros(self.numel if stage == 0 else self.size * world_size,
                                dtype=first.dtype, device=first.device)
        self.nbytes = self.flat.untyped_storage().nbytes()
        offset = 0
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        lo = rank * self.size
        mine = self.flat[lo:lo + self.size]
        # stages 1-2: the shard is a view (the flat buffer stays); stage 3: its own copy
        self.shard = nn.Parameter(mine.clone() if stage == 3 else mine)
        self.lo, self.pending, self.reduced = lo, 0, False

    def flat_grad(self) -> torch.Tensor:
        """The unit's gradient as one padded buffer; its parameters' ``.grad`` become views of it."""
        grad = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            grad[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return grad


class ZeroByHand:
    """Train ``model`` with data parallelism at ZeRO ``stage`` (0-3) by hand (notebook 10).

    ``optimizer_cls(params, **optimizer_kwargs)`` is built over the shards (stages 1-3) or the
    whole model (stage 0). Call ``zero_grad()``, the forward and ``loss.backward()``, then
    ``step()``. The loss is the mean over this rank's rows: gradients are averaged over ranks.
    """

    def __init__(self, model: nn.Module, stage: int, optimizer_cls: type = torch.optim.AdamW,
                 comm: CommLog | None = None, **optimizer_kwargs: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroByHand needs a process group: run it inside launch(...)")
        self.model, self.stage = model, stage
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.comm = comm if comm is not None else CommLog()
        with torch.no_grad():  # every rank starts from rank 0's model, as under DDP
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        self._check_shared(model)
        taken: set[nn.Parameter] = set()
        self.units = [_Unit(m, self.world_size, self.rank, stage, taken) for m in model.modules()
                      if any(p.requires_grad and p not in taken for p in m.parameters(recurse=False))]
        params = [p for u in self.units for p in u.params] if stage == 0 else [u.shard for u in self.units]
        self.optimizer = optimizer_cls(params, **optimizer_kwargs)
        self.buffers_follow = True  # DDP's rule: rank 0's buffers before a forward after one with grads
        model.register_forward_pre_hook(lambda m, a: self._broadcast_buffers())
        model.register_forward_hook(lambda m, a, out: setattr(self, "buffers_follow",
                                                              torch.is_grad_enabled()))
        if stage >= 2:
            for unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))
        if stage == 3:
            for unit in self.units:
                unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._unshard(u))
                unit.module.register_forward_hook(lambda m, a, out, u=unit: self._after_forward(u, out))
                self._reshard(unit)

    def _check_shared(self, model: nn.Module) -> None:
        owners: dict[nn.Parameter, str] = {}
        for name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                if self.stage == 3 and p.requires_grad and p in owners:
                    raise ValueError(f"stage 3 by hand frees each module's parameters after its own "
                                     f"forward, and modules {owners[p]!r} and {name!r} share one (a "
                                     "tied weight): use stages 0-2, or FSDP with the shared parameter "
                                     "in the unit of a module above both")
                owners.setdefault(p, name)

    def _broadcast_buffers(self) -> None:
        for buffer in self.model.buffers() if self.buffers_follow else ():
            self.comm.count("broadcast", buffer)
            dist.broadcast(buffer.detach(), src=0)

    # region: stage3
    def _unshard(self, unit: _Unit) -> None:
        """Stage 3: bring the unit's full parameters back, just in time (all-gather)."""
        unit.flat.untyped_storage().resize_(unit.nbytes)
        with torch.no_grad():
            self.comm.all_gather(unit.flat, unit.shard.detach())

    def _reshard(self, unit: _Unit) -> None:
        """Stage 3: free the full parameters; autograd's saved views see them again at unshard."""
        unit.flat.untyped_storage().resize_(0)

    def _after_forward(self, unit: _Unit, out: torch.Tensor) -> None:
        """Stage 3: free after forward; gather again when backward reaches this unit's output."""
        self._reshard(unit)
        if out.requires_grad:
            out.register_hook(lambda grad: self._unshard(unit))
    # endregion

    # region: reduce
    def _reduce(self, unit: _Unit) -> None:
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
            unit.shard.grad = mine if unit.shard.grad is None else unit.shard.grad + mine
            for p in unit.params:
                p.grad = None
        unit.reduced = True
    # endregion

    def _grad_ready(self, unit: _Unit) -> None:
        """Stages 2-3: once backward has produced all of a unit's gradients, reduce-scatter them."""
        unit.pending += 1
        if unit.pending == len(unit.params):
            unit.pending = 0
            self._reduce(unit)
            if self.stage == 3:
                self._reshard(unit)

    # region: step
    def step(self) -> None:
        """Reduce the gradients (stages 0-1; 2-3 did during backward), step, gather the shards."""
        names = {p: n for n, p in self.model.named_parameters()}
        missing = [names[p] for u in self.units if self.stage <= 1 or not u.reduced or u.pending
                   for p in u.params if p.grad is None]  # stages 2-3: a unit reduced in backward
        if missing:
            raise RuntimeError(f"{missing} got no gradient before step() on this rank: every parameter "
                               "that trains must take part in the loss (DDP raises at the next forward)")
        if self.stage <= 1:
            for unit in self.units:
                self._reduce(unit)
        self.optimizer.step()
        for unit in self.units:
            unit.reduced = False
        if self.stage in (1, 2):
            for unit in self.units:
                with torch.no_grad():
                    self.comm.all_gather(unit.flat, unit.shard.detach().clone())
    # endregion

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.shard.grad, unit.pending = None, 0
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
        """Bytes of model state this rank holds now: parameters, gradients, optimizer state.

        Counted from the tensors: the flat buffers' storage (0 while freed), stage 3's shards,
        every ``.grad`` (a view of a flat gradient counts once), and the optimizer's state tensors
        of a parameter's size (Adam's ``step`` counters, one scalar each, are left out).
        """
        params = sum(u.flat.untyped_storage().nbytes() for u in self.units)
        if self.stage == 3:
            params += sum(u.shard.nbytes for u in self.units)
        storages = {}
        for t in [p.grad for u in self.units for p in u.params] + [u.shard.grad for u in self.units]:
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        state = sum(v.nbytes for p, s in self.optimizer.state.items()
                    for v in s.values() if torch.is_tensor(v) and v.shape == p.shape)
        return {"parameters": params, "gradients": sum(storages.values()), "optimizer state": state}
