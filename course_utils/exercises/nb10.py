"""Judges of the exercises of notebook 10 (sharded data parallelism); their content is in nb10.toml."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..compat import COLLECTIVE_NAMES
from .answers import NOT_A_NUMBER, real, reals
from .core import load_bank
from .nb10_between import CLUSTERS as _CLUSTERS
from .nb10_between import hsdp_between as _hsdp_between  # noqa: F401 - the reference, for the tests
from .nb10_between import judge_between_nodes as _judge_between_nodes  # noqa: F401 - 10.4's judge
from .together import by_plan, case_by_case

__all__ = ["CASES", "EXERCISES"]

_PSI, _N = 1_000_000_000, 8


#: bytes per parameter of (parameters, gradients, optimizer state) under mixed-precision Adam
_SIZES = (2, 2, 12)
#: stages -> which of the three ZeRO shards; "swapped" shards the parameters and keeps the gradients,
#: which gives stage 2's total whenever parameters and gradients take as many bytes: only the three
#: numbers tell them apart
_STAGES = {(False, False, False): "ddp", (False, False, True): "zero1", (False, True, True): "zero2",
           (True, True, True): "zero3", (True, False, True): "swapped"}
_STAGE_HINTS = {
    "ddp": "that is DDP's figure: stage 2 shards the gradients and the optimizer state",
    "zero1": "that is ZeRO-1: stage 2 also shards the gradients",
    "zero3": "that is ZeRO-3: in stage 2 every rank still holds all the fp16 parameters",
    "swapped": ("that shards the parameters and keeps every gradient: stage 2 shards what backward and the "
                "optimizer produce, and every rank still holds all the fp16 parameters forward needs"),
}


def _judge_zero2_bytes(answer: Any) -> str | None:
    if real(answer) is not None:
        return ("write three numbers, (parameters, gradients, optimizer state) in bytes: one total cannot "
                "show which of them stage 2 shards (sharding the parameters instead of the gradients "
                "gives the same total when both take 2 bytes)")
    parts = reals(answer, 3)
    if parts is None:
        return ("write three numbers in a tuple or list, (parameters, gradients, optimizer state) in bytes, "
                f"not {type(answer).__name__}")

    def near(value: float, target: float) -> bool:
        return abs(value - target) <= 0.005 * target

    def read(values: list[float]) -> tuple | None:
        """For each part: sharded (True), whole (False), or None when it is neither."""
        return tuple(True if near(value, size * _PSI / _N) else False if near(value, size * _PSI) else None
                     for value, size in zip(values, _SIZES, strict=True))

    kinds = read(parts)
    stage = _STAGES.get(kinds)
    if stage == "zero2":
        return None
    if stage in _STAGE_HINTS:
        return _STAGE_HINTS[stage]
    if _STAGES.get(read([v * 10**9 for v in parts])) == "zero2":
        return "that is in GB (10^9 bytes): the question asks for bytes"
    p, g, k = parts
    if p == 0:
        return "the parameters are missing: in stage 2 every rank still holds all the fp16 parameters"
    if kinds == (False, True, False):
        return "stage 2 shards the optimizer state too, as every stage from 1 on does"
    if kinds[:2] == (False, True) and any(near(k, b * _PSI / _N) for b in (8, 10, 14, 16)):
        return ("count K = 12 bytes of Adam state per parameter in mixed precision: an fp32 master "
                "copy and two fp32 moments")
    if near(p, 4 * _PSI) or near(g, 4 * _PSI / _N):
        return "the parameters and gradients are fp16 here: 2 bytes each"
    return ("list the kinds of model state mixed-precision Adam keeps per parameter, and for each ask "
            "whether stage 2 keeps it whole on every rank or splits it over the N ranks")


#: 10.2's cases: the world sizes it launches, the shard length on each rank (odd: no written-in
#: halves), the seed of the parameters and gradients
ZERO1_CASES = [(2, 5, 0), (3, 4, 1), (4, 3, 2)]
#: 10.3's cases: the world sizes, each with two gradients (rows that do not divide evenly): one
#: whose norm is above max_norm, one below it (a clip that always rescales fails there)
CLIP_WORLDS, CLIP_ROWS = (2, 3), 7
CLIP_CASES = [("above", 1.0), ("below", 1000.0)]

CASES: dict[str, list[str]] = {
    "10.1": ["Ψ = 10^9 parameters, N = 8 ranks: parameters, gradients, optimizer state"],
    "10.2": [f"world_size={n}, a shard of {size} values, seed {seed}" for n, size, seed in ZERO1_CASES],
    "10.3": [f"world_size={n}, 3 gradients of {CLIP_ROWS} rows split unevenly, norm {where} max_norm={m:g}"
             for n in CLIP_WORLDS for where, m in CLIP_CASES],
}


def zero1_step_rank(rank: int, world_size: int, answer: Any, size: int, seed: int) -> str | None:
    """One rank of exercise 10.2's check: ``answer`` against AdamW on the averaged gradient, with
    the bytes it sent counted in the ring model where every route to a collective ends, torch's
    dispatcher (``collectives_dispatched``: the functional collectives too)."""
    import torch.distributed as dist

    from ..devices import rank_device
    from .dispatched import collectives_dispatched, ring_bytes_sent

    device = rank_device()
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(size * world_size, generator=g).to(device)
    grads = [torch.randn(size * world_size, generator=g).to(device) for _ in range(world_size)]
    reference = torch.nn.Parameter(start.clone())
    reference.grad = sum(grads) / world_size
    torch.optim.AdamW([reference], lr=0.1).step()

    flat_param = start.clone()
    mine = slice(size * rank, size * (rank + 1))
    shard = torch.nn.Parameter(flat_param[mine].clone())
    optimizer = torch.optim.AdamW([shard], lr=0.1)
    flat_grad = grads[rank].clone()
    try:
        with collectives_dispatched() as calls:  # what ran, whatever name or route the answer took
            answer(flat_param, flat_grad, shard, optimizer)
    except AttributeError as err:  # a collective's name from another torch release
        names = [n for pair in COLLECTIVE_NAMES.items() for n in pair if f"'{n}'" in str(err)]
        if not names:
            raise
        return (f"torch {torch.__version__} has no dist.{names[0]}: the flat-tensor collectives "
                "changed names in torch 2.13 (see 'What gloo offers'); compat.reduce_scatter_single "
                "and compat.all_gather_single work on every release")
    dist.barrier()
    if shard.grad is None:
        return "shard.grad is still None: reduce-scatter the gradient into a tensor and set shard.grad"
    if torch.allclose(shard.grad, sum(grads)[mine]):
        return "shard.grad is the sum over the ranks: DDP averages, so divide by the world size"
    if not torch.allclose(shard.grad, reference.grad[mine]):
        summed = sum(grads)[mine]
        ratio = (summed @ shard.grad / (shard.grad @ shard.grad).clamp_min(1e-30)).item()
        if torch.allclose(shard.grad * ratio, summed, rtol=1e-4, atol=1e-6):  # a fixed divisor
            return ("shard.grad is the sum divided by a fixed number, not by the world size: this check "
                    "runs on several world sizes")
        return "shard.grad is not this rank's slice of the averaged gradient: reduce-scatter flat_grad"
    if not torch.allclose(shard.detach(), reference.detach()[mine]):
        return ("shard.grad is right, but the shard was not stepped with it: the optimizer updates a "
                "parameter with the gradient it holds when step() runs, and before that it held none")
    if not torch.allclose(flat_param[mine], reference.detach()[mine]):
        return "this rank's slice of flat_param was not updated: gather the stepped shards back into it"
    if not torch.allclose(flat_param, reference.detach()):
        return "the other ranks' slices of flat_param are stale: all-gather the updated shards into it"
    zero1 = 2 * (world_size - 1) / world_size * flat_param.nbytes  # a reduce-scatter and an all-gather
    if ring_bytes_sent(calls, world_size) > zero1 * 1.001:
        return ("the numbers are right, but a whole tensor went to every rank where ZeRO moves slices: "
                "with a reduce-scatter each rank receives only the summed slice it steps, and an "
                "all-gather brings back each rank's stepped shard; all-reducing everything and keeping "
                "a slice sends more bytes for nothing")
    if not torch.equal(flat_grad, grads[rank]):
        return ("the caller's flat_grad was changed in place: it is this rank's gradient, which the "
                "step reads and must leave as it found it")
    return None


_judge_zero1_step = by_plan(case_by_case(zero1_step_rank, ZERO1_CASES),
                            "the ranks hung: every rank must call the same collectives, in the same order")


def clip_rank(rank: int, world_size: int, answer: Any) -> str | None:
    """One rank of exercise 10.3's check: the total norm and the clipped shards, for every case of
    :data:`CLIP_CASES` (one launch)."""
    from ..devices import rank_device

    device = rank_device()
    for index, (where, max_norm) in enumerate(CLIP_CASES):
        g = torch.Generator().manual_seed(10 * world_size + index)
        full = [torch.randn(CLIP_ROWS, 4, generator=g).to(device) * (i + 1) for i in range(3)]
        total = torch.sqrt(sum(t.square().sum() for t in full))
        parts = [[p.clone() for p in t.tensor_split(world_size)] for t in full]  # uneven rows
        shards = [p[rank].clone() for p in parts]
        got = real(answer(shards, max_norm))
        if got is None:
            return f"return the total norm as one number (a float or a 0-d tensor): {NOT_A_NUMBER}"
        if abs(got - total.item()) > 1e-4 * total.item():
            norms = [torch.sqrt(sum(p[r].square().sum() for p in parts)).item() for r in range(world_size)]
            local, local_max = norms[rank], max(norms)
            if abs(got - local) < 1e-4 * local:
                return "that is the norm of this rank's shards only: the other ranks hold the rest"
            if abs(got - local_max) < 1e-4 * local_max:
                return ("that is the largest shard's norm: the whole gradient's norm is larger than "
                        "every shard's, as it holds all of them")
            if abs(got * math.sqrt(world_size) - total.item()) < 1e-4 * total.item():
                return ("that is the norm of the mean of the squares: the whole gradient's sum of "
                        "squares counts every rank's shards once, it is not averaged over the ranks")
            return ("norms do not add up across ranks: a norm is the square root of a sum of squares; "
                    "which part of that can be added up across the ranks?")
        scale = min(1.0, max_norm / (total.item() + 1e-6))
        for s, p in zip(shards, parts, strict=True):
            if torch.allclose(s, p[rank] * scale, rtol=1e-4, atol=1e-7):
                continue
            if where == "below":
                return ("the gradient's norm was below max_norm, and the shards were scaled all the same: "
                        "clipping only shrinks a gradient whose norm is above the limit")
            return "the norm is right, but the shards were not scaled by max_norm / total on every rank"
    return None


_judge_clip = by_plan(case_by_case(clip_rank, [(n,) for n in CLIP_WORLDS]),
                      "the ranks hung: every rank must take part in the same all-reduce")


CASES["10.4"] = [f"Ψ = {psi:g} parameters, {nodes} node(s) of {gpus} GPUs" for psi, nodes, gpus in _CLUSTERS]


EXERCISES = load_bank(__name__)
