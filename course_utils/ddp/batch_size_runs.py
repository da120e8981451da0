"""The real-rank runs of notebook 07 (sections 1 to 3), for ``launch``, and their one-process
references.

Every run trains :func:`.batch_task.model` on :mod:`.batch_task`'s rows with SGD (momentum 0.9).
The rows of a step are the global batch drawn from one generator, the same on every rank, and
each rank takes its slice (``tensor_split``): so a run on N ranks and a run in one process on the
whole batch see the same rows, and must end with the same weights.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..devices import rank_device, wrap_ddp
from . import batch_task
from .batch_size import MOMENTUM, draws
from .noise_scale import NoiseScaleDDP

__all__ = ["gradient_draws_rank", "noise_scale_rank", "sweep_point_rank", "train_one_process",
           "two_ways_rank"]


def _global_batches(global_batch: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [batch_task.batch(generator, global_batch) for _ in range(steps)]


def _train(global_batch: int, steps: int, lr: float, *, rank: int = 0, world_size: int = 1,
           ddp: bool = False) -> tuple[torch.Tensor, list[float]]:
    """``steps`` SGD steps on global batches of ``global_batch`` rows, this rank on its slice of
    each (one process: the whole batch); the weights and the exact loss after each step."""
    device = rank_device()
    model = batch_task.model().to(device)
    trained = wrap_ddp(model, device) if ddp else model
    optimizer = torch.optim.SGD(trained.parameters(), lr=lr, momentum=MOMENTUM)
    losses = []
    for x, y in _global_batches(global_batch, steps):
        x, y = x.tensor_split(world_size)[rank].to(device), y.tensor_split(world_size)[rank].to(device)
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(trained(x).squeeze(-1), y).backward()
        optimizer.step()
        losses.append(float(batch_task.loss(model.weight.detach().cpu()[0])))
    weights = model.weight.detach().cpu()[0].clone()
    trained = optimizer = None  # DDP gone before the process group (gloo's clean exit)
    gc.collect()
    return weights, losses


def train_one_process(global_batch: int, steps: int, lr: float) -> tuple[torch.Tensor, list[float]]:
    """One process on the whole global batch: the weights, and the loss after each step."""
    return _train(global_batch, steps, lr)


def two_ways_rank(rank: int, world_size: int, global_batch: int, per_rank_batch: int, steps: int,
                  lr: float) -> dict[str, tuple[torch.Tensor, list[float]]]:
    """Section 1: the same training under DDP on this world, the two ways to add ranks:
    ``"fixed global batch"`` (each rank ``global_batch / N`` rows) and ``"fixed per-rank batch"``
    (each rank ``per_rank_batch`` rows: a global batch of ``N * per_rank_batch``)."""
    out = {"fixed global batch": _train(global_batch, steps, lr, rank=rank, world_size=world_size, ddp=True)}
    dist.barrier()
    out["fixed per-rank batch"] = _train(per_rank_batch * world_size, steps, lr, rank=rank,
                                         world_size=world_size, ddp=True)
    return out


def gradient_draws_rank(rank: int, world_size: int, weights: torch.Tensor, per_rank_batches: Sequence[int],
                        draws_per_batch: int) -> dict[int, torch.Tensor]:
    """Section 1: DDP's averaged gradient at fixed ``weights``, over ``draws_per_batch`` independent
    global batches, for each per-rank batch of ``per_rank_batches``: each rank draws its own rows
    (a generator of its own), computes the mean gradient of each draw, and one all-reduce (sum,
    then divide by N) averages every draw at once, as DDP does step by step. Returns, per per-rank
    batch, the averaged gradients ``[draws, DIM]`` (the same on every rank)."""
    device = rank_device()
    w = weights.to(device)
    out = {}
    for b in per_rank_batches:
        generator = torch.Generator().manual_seed(1_000_003 * (rank + 1) + b)
        x, y = batch_task.batch(generator, b, draws_per_batch)  # [draws, b, DIM], [draws, b]
        x, y = x.to(device), y.to(device)
        grads = torch.einsum("db,dbk->dk", torch.sigmoid(x @ w) - y, x) / b  # each draw's mean gradient
        dist.all_reduce(grads)
        out[b] = (grads / world_size).cpu()
    return out


def sweep_point_rank(rank: int, world_size: int, batch: int, lr: float, seed: int, seeds: int,
                     steps: int) -> list[float]:
    """Section 2's check of the sweep on real ranks: torch's DDP and ``torch.optim.SGD`` trained on
    the rows the sweep's copy ``seed`` saw at global batch ``batch`` (:func:`.batch_size.draws`),
    each rank on its slice; the loss after each step."""
    device = rank_device()
    model = batch_task.model().to(device)
    ddp_model = wrap_ddp(model, device)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=MOMENTUM)
    rows, losses = draws(batch, seeds), []
    for _ in range(steps):
        x, y = next(rows)
        x = x[seed].tensor_split(world_size)[rank].to(device)
        y = y[seed].tensor_split(world_size)[rank].to(device)
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(ddp_model(x).squeeze(-1), y).backward()
        optimizer.step()
        losses.append(float(batch_task.loss(model.weight.detach().cpu()[0])))
    ddp_model = optimizer = None
    gc.collect()
    return losses


def noise_scale_rank(rank: int, world_size: int, per_rank_batch: int, lr: float, steps: int) -> dict:
    """Section 3: training under :class:`.noise_scale.NoiseScaleDDP` (all-reduce in buckets, one
    scalar more per step), each rank on ``per_rank_batch`` rows of its own generator's; per step,
    the pair of squared norms (mean local, averaged), the loss, and the weights."""
    device = rank_device()
    model = batch_task.model().to(device)
    ddp_model = NoiseScaleDDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=MOMENTUM)
    generator = torch.Generator().manual_seed(7919 * (rank + 1))
    losses, weights = [], []
    for _ in range(steps):
        x, y = batch_task.batch(generator, per_rank_batch)
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(ddp_model(x.to(device)).squeeze(-1), y.to(device)).backward()
        optimizer.step()
        weights.append(model.weight.detach().cpu()[0].clone())
        losses.append(float(batch_task.loss(weights[-1])))
    return {"sq_norms": list(ddp_model.history), "losses": losses, "weights": weights}
