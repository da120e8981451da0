"""The parts ZeRO by hand is built from (notebook 10): :class:`CommLog`, which counts what a rank
sends in each collective; :func:`shard_numel`; and :class:`FlatUnit`, one module's parameters as
views of a flat, padded buffer with this rank's shard of it. :mod:`course_utils.sharding.zero`
trains with them."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_int
from ..compat import all_gather_single, reduce_scatter_single
from ..ddp.collectives import ring_bytes_per_rank

__all__ = ["ELEMENTWISE", "CommLog", "FlatUnit", "check_elementwise", "clip_units", "held_bytes",
           "output_tensors", "refuse_replaced", "refuse_shared", "shard_numel"]

#: optimizers that update each element from its own gradient and state: stages 1-3 hand the
#: optimizer 1-D slices of flat buffers, which changes nothing for these alone
ELEMENTWISE: tuple[type, ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                                 torch.optim.Adadelta, torch.optim.Adamax, torch.optim.ASGD,
                                 torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop)


def check_elementwise(optimizer_cls: Any, stage: int) -> None:
    """Stages 1-3: refuse an optimizer that does not update each element on its own (Adafactor
    factors 2-D weights, LBFGS uses the whole vector): on a 1-D slice it would compute something
    else, with no error."""
    if stage >= 1 and not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE)):
        raise ValueError(
            f"stages 1-3 give the optimizer 1-D slices of flat buffers, which is right only for one that "
            f"updates each element on its own ({', '.join(c.__name__ for c in ELEMENTWISE)}); "
            f"{getattr(optimizer_cls, '__name__', optimizer_cls)!s} is not one of them: use stage 0, or "
            "ZeroRedundancyOptimizer, which shards whole parameters")


def clip_units(zero: Any, max_norm: float) -> torch.Tensor:
    """``ZeroByHand.clip_grad_norm_``: the norm of the whole averaged gradient (stage 0: every rank
    holds it; stages 1-3: the sum of each rank's shards' squares, all-reduced), and every gradient
    scaled by ``min(1, max_norm / (norm + 1e-6))``, torch's ``clip_grad_norm_`` rule."""
    zero.reduce_gradients()
    grads = [u.flat_grad() if zero.stage == 0 else u.shard.grad for u in zero.units]
    squares = torch.stack([g.detach().double().square().sum() for g in grads]).sum()
    if zero.stage >= 1:
        zero.comm.all_reduce(squares)
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total.to(grads[0].dtype)


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


class FlatUnit:
    """One module's parameters as views of a flat, padded buffer, and this rank's shard of it."""

    def __init__(self, module: nn.Module, world_size: int, rank: int, stage: int,
                 taken: set[nn.Parameter], index: int) -> None:
        self.module, self.index = module, index
        self.params = [p for p in module.parameters(recurse=False) if p.requires_grad and p not in taken]
        taken.update(self.params)
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError(f"the parameters of {type(module).__name__} differ in dtype or device: one "
                             "flat buffer holds one dtype (FSDP1's flat parameters have the same rule)")
        self.numel = sum(p.numel() for p in self.params)
        self.size = shard_numel(self.numel, world_size)
        first = self.params[0]  # stage 0 shards nothing, so it pads nothing
        self.flat = torch.zeros(self.numel if stage == 0 else self.size * world_size,
                                dtype=first.dtype, device=first.device)
        self.nbytes = self.flat.untyped_storage().nbytes()
        offset, self.views = 0, []
        for p in self.params:
            self.flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            p.data = self.views[-1]
            offset += p.numel()
        # stage 3, between uses: each parameter holds this empty tensor, so reading it is harmless
        self.placeholder = torch.empty(0, dtype=first.dtype, device=first.device)
        lo = rank * self.size
        mine = self.flat[lo:lo + self.size]
        # stages 1-2: the shard is a view (the flat buffer stays); stage 3: its own copy
        self.shard = nn.Parameter(mine.clone() if stage == 3 else mine)
        self.lo, self.reduced, self.reduced_since_forward = lo, False, False
        self.arrived: set[nn.Parameter] = set()  # stages 2-3: gradients ready in this backward pass

    def flat_grad(self) -> torch.Tensor:
        """The unit's gradient as one padded buffer; its parameters' ``.grad`` become views of it."""
        grad = torch.zeros_like(self.flat)
        offset = 0
        for p in self.params:
            grad[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return grad


def output_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a module's output, through tuples, lists, dicts and dataclasses (stage 3
    hooks each)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        out = [getattr(out, field.name) for field in dataclasses.fields(out)]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [t for item in items for t in output_tensors(item)]


def refuse_shared(model: nn.Module) -> None:
    """Stage 3 frees each module's parameters after its own forward: a parameter two modules share
    (a tied weight) cannot follow both, so it is refused with the two modules' names."""
    owners: dict[nn.Parameter, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if p.requires_grad and p in owners:
                raise ValueError(f"stage 3 by hand frees each module's parameters after its own "
                                 f"forward, and modules {owners[p]!r} and {name!r} share one (a "
                                 "tied weight): use stages 0-2, or FSDP with the shared parameter "
                                 "in the unit of a module above both")
            owners.setdefault(p, name)


def held_bytes(zero: Any) -> dict[str, int]:
    """Bytes of model state the rank of ``zero`` (a ``ZeroByHand``) holds now: parameters,
    gradients, optimizer state. Counted from the tensors: the flat buffers' storage (0 while
    freed), stage 3's shards, every ``.grad`` (a view of a flat gradient counts once), and the
    optimizer's state tensors of a parameter's size (Adam's ``step`` counters, one scalar each, are
    left out)."""
    params = sum(u.flat.untyped_storage().nbytes() for u in zero.units)
    if zero.stage == 3:
        params += sum(u.shard.nbytes for u in zero.units)
    storages = {}
    for t in [p.grad for u in zero.units for p in u.params] + [u.shard.grad for u in zero.units]:
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    state = sum(v.nbytes for p, s in zero.optimizer.state.items()
                for v in s.values() if torch.is_tensor(v) and v.shape == p.shape)
    return {"parameters": params, "gradients": sum(storages.values()), "optimizer state": state}


def refuse_replaced(unit: FlatUnit, stage: int) -> None:
    """Stages 1-3, before a forward: raise if a parameter no longer holds its unit's view (``p.data
    = ...``, ``model.to(memory_format=...)`` after wrapping): the steps would update shards that no
    parameter reads. (Stage 3, between uses: each must hold the empty placeholder.)"""
    if stage == 3 and not unit.flat.untyped_storage().nbytes():
        moved = [p for p in unit.params if p.numel()]
    elif stage >= 1:
        moved = [p for p, view in zip(unit.params, unit.views, strict=True)
                 if p.data_ptr() != view.data_ptr() or p.stride() != view.stride()]
    else:
        moved = []
    if moved:
        raise RuntimeError(f"{len(moved)} parameter(s) of {type(unit.module).__name__} no longer hold the "
                           "view of the unit's flat buffer that ZeroByHand gave them (replaced after "
                           "wrapping: p.data = ..., model.to(...)): change the model before wrapping it")
