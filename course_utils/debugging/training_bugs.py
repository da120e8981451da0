"""Training-loop failures under DDP and their fixes, with single-process references (notebook 12).

Each ``train_*`` function is a rank function for ``distributed.launch``; each ``*_reference``
computes in one process what the ranks must end with, so a fix is asserted, not claimed:

- gradient accumulation with ``no_sync`` (:func:`accumulate_step`) equals one big batch
  (:func:`accumulation_reference`); the classic off-by-one (:func:`accumulate_step_off_by_one`)
  lets the ranks drift apart;
- uneven inputs: a rank with more batches hangs the others (:func:`train_uneven` ``"plain"``);
  the ``Join`` context manager (``"join"``) and equal-length shards (``"equal"``) both finish and
  equal :func:`uneven_reference`;
- ``Join`` with a collective of our own inside the joined loop (:func:`train_joined_logging`);
- parameters that get no gradient, ranks seeded differently, and the prefixes that wrappers add
  to a state dict.

Compression hooks, trained on the same ``small_model``, are in
:mod:`course_utils.debugging.gradient_compression`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..ddp.demos import TwoHeads
from ..devices import rank_device
from ..faults.snapshots import state_copy
from ..models import seeded

__all__ = [
    "accumulate_step",
    "accumulate_step_off_by_one",
    "accumulation_data",
    "accumulation_reference",
    "different_seeds",
    "small_model",
    "train_accumulating",
    "train_joined_logging",
    "train_uneven",
    "train_unused",
    "uneven_batches",
    "uneven_reference",
    "wrapped_keys",
]

LR = 0.1


def small_model() -> nn.Module:
    """The small regression network every experiment here starts from (seeded: same weights)."""
    return seeded(0, lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))


# ----------------------------------------------------------------------------- accumulation

def accumulation_data(world_size: int, k: int, micro: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets shaped ``[steps, world_size, k, micro, 4]`` and ``[..., 1]``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps, world_size, k, micro, 4, generator=g)
    return x, x.sum(-1, keepdim=True).sin()


def accumulate_step(ddp_model: DDP, optimizer: torch.optim.Optimizer, micro_batches: list) -> None:
    """One optimizer step over k micro-batches: all-reduce once, on the last backward."""
    k = len(micro_batches)
    # region: accumulate
    for i, (x, y) in enumerate(micro_batches):
        last = i == k - 1
        with contextlib.nullcontext() if last else ddp_model.no_sync():  # sync only the last
            loss = F.mse_loss(ddp_model(x), y) / k  # the mean over the k micro-batches
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    # endregion


def accumulate_step_off_by_one(ddp_model: DDP, optimizer: torch.optim.Optimizer,
                               micro_batches: list) -> None:
    """The classic off-by-one: syncs on the first micro-batch instead of the last."""
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i % k != 0 else contextlib.nullcontext():
            (F.mse_loss(ddp_model(x), y) / k).backward()
    optimizer.step()
    optimizer.zero_grad()


def train_accumulating(rank: int, world_size: int, step: Callable[..., None], k: int, micro: int,
                       steps: int) -> dict[str, torch.Tensor]:
    """DDP training where every optimizer step is ``step(ddp_model, optimizer, micro_batches)``."""
    device = rank_device()
    ddp_model = DDP(small_model().to(device))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    x, y = accumulation_data(world_size, k, micro, steps)
    for s in range(steps):
        step(ddp_model, optimizer, [(x[s, rank, i].to(device), y[s, rank, i].to(device))
                                    for i in range(k)])
    return state_copy(ddp_model.module)


def accumulation_reference(world_size: int, k: int, micro: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, one batch of all ``world_size * k * micro`` rows per step."""
    x, y = accumulation_data(world_size, k, micro, steps)
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(steps):
        F.mse_loss(model(x[s].reshape(-1, 4)), y[s].reshape(-1, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return state_copy(model)


# ----------------------------------------------------------------------------- uneven inputs

def uneven_batches(batches_per_rank: list[int], rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches (3 rows each), ``batches_per_rank[rank]`` of them."""
    counts = _check_batches(batches_per_rank)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(counts):
        raise ValueError(f"rank must be an int in [0, {len(counts)}), got {rank!r}")
    g = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(counts[rank]):
        x = torch.randn(3, 4, generator=g)
        batches.append((x, x.sum(-1, keepdim=True).sin()))
    return batches


def _check_batches(batches_per_rank: Any) -> list[int]:
    if not isinstance(batches_per_rank, (list, tuple)) or not batches_per_rank or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in batches_per_rank):
        raise ValueError(f"batches_per_rank must be a non-empty list of ints >= 1, got {batches_per_rank!r}")
    return list(batches_per_rank)


def train_uneven(rank: int, world_size: int, batches_per_rank: list[int], mode: str) -> dict:
    """Each rank trains on its own number of batches. ``mode``: ``"plain"`` (hangs when they
    differ), ``"join"`` (the ``Join`` context manager) or ``"equal"`` (all stop at the fewest)."""
    from torch.distributed.algorithms.join import Join

    device = rank_device()
    ddp_model = DDP(small_model().to(device))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    batches = uneven_batches(batches_per_rank, rank)
    if mode == "equal":  # equal-length shards: agree on the shortest, drop the rest
        count = torch.tensor([len(batches)], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        batches = batches[:int(count.item())]
    # region: join
    with Join([ddp_model]) if mode == "join" else contextlib.nullcontext():
        for x, y in batches:
            F.mse_loss(ddp_model(x.to(device)), y.to(device)).backward()
            optimizer.step()
            optimizer.zero_grad()
    # endregion
    return {"steps": len(batches), "params": state_copy(ddp_model.module)}


def uneven_reference(batches_per_rank: list[int], mode: str) -> dict[str, torch.Tensor]:
    """What ``train_uneven`` must end with, in one process.

    ``"join"``: at step s the ranks that still have a batch contribute their gradient and the
    ranks that have joined contribute zeros; DDP divides by the initial world size.
    ``"equal"``: every rank stops at the fewest batches.
    """
    counts = list(batches_per_rank)
    world_size = len(counts)
    if mode == "equal":
        counts = [min(counts)] * world_size
    batches = [uneven_batches(counts, r) for r in range(world_size)]
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(max(counts)):
        active = [b[s] for b in batches if s < len(b)]
        loss = sum(F.mse_loss(model(x), y) for x, y in active) / world_size
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return state_copy(model)


def train_joined_logging(rank: int, world_size: int, batches_per_rank: list[int],
                         log_inside: bool) -> dict[str, Any]:
    """``Join`` with a mean loss of our own, all-reduced ``log_inside`` the joined loop every step
    (the bug: ``Join`` shadows the collectives of its joinables, DDP's, not ours) or once after it
    (the fix: every rank gets there). Returns the mean loss over every rank's batches and steps."""
    from torch.distributed.algorithms.join import Join

    device = rank_device()
    ddp_model = DDP(small_model().to(device))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    totals = torch.zeros(2, device=device)  # this rank's loss sum and batch count
    # region: logged
    with Join([ddp_model]):
        for x, y in uneven_batches(batches_per_rank, rank):
            loss = F.mse_loss(ddp_model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            totals += torch.stack([loss.detach(), torch.ones((), device=device)])
            if log_inside:
                logged = loss.detach().clone()
                dist.all_reduce(logged)  # the bug: a collective of our own, which Join does not shadow
    dist.all_reduce(totals)  # the fix: after the joined loop, where every rank arrives
    # endregion
    return {"mean loss": (totals[0] / totals[1]).item(), "batches": int(totals[1].item())}


# ----------------------------------------------------------------------------- unused parameters

def train_unused(rank: int, world_size: int, mode: str, steps: int = 3) -> list[float]:
    """Train notebook 05's ``ddp.demos.TwoHeads`` under DDP. ``mode``: ``"plain"`` (fails at the
    second step), ``"debug"`` (the same under debug level INFO: the error names the parameters),
    ``"find_unused"`` or ``"static_graph"`` (both train)."""
    group = None
    if mode == "debug":  # what TORCH_DISTRIBUTED_DEBUG=INFO does, for a group made after it
        dist.set_debug_level(dist.DebugLevel.INFO)
        group = dist.new_group(list(range(world_size)))
    device = rank_device()
    torch.manual_seed(0)
    ddp_model = DDP(TwoHeads().to(device), process_group=group,
                    find_unused_parameters=mode == "find_unused", static_graph=mode == "static_graph")
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    return [round(loss, 4) for loss in _sine_steps(ddp_model, optimizer, rank, steps, rows=4)]


def _sine_steps(ddp_model: DDP, optimizer: torch.optim.Optimizer, rank: int, steps: int,
                rows: int) -> list[float]:
    """``steps`` SGD steps on this rank's own random rows, learning ``sin(sum(x))``; the losses."""
    device = rank_device()
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(rows, 4, generator=g).to(device)
        loss = F.mse_loss(ddp_model(x), x.sum(-1, keepdim=True).sin())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# ----------------------------------------------------------------------------- seeds

def different_seeds(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank seeds itself with its rank (the bug): what DDP's first broadcast fixes, and not.

    Returns the first weights before and after ``DDP(model)``, a dropout mask, the order a
    shuffling ``DataLoader`` reads 8 samples in, and the indices a ``DistributedSampler`` (which
    shuffles with its own ``seed``, not the global generator) gives this rank.
    """
    device = rank_device()
    torch.manual_seed(rank)  # the bug: a different seed on every rank
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)).to(device)
    before = model[0].weight[0, :3].tolist()
    ddp_model = DDP(model)  # broadcasts rank 0's parameters and buffers to every rank
    after = ddp_model.module[0].weight[0, :3].tolist()
    mask = (model[1](torch.ones(1, 8, device=device)) != 0).int().flatten().tolist()
    loader = torch.utils.data.DataLoader(range(8), batch_size=8, shuffle=True)
    sampler = torch.utils.data.DistributedSampler(range(8), num_replicas=world_size, rank=rank, seed=0)
    return {"before": before, "after": after, "dropout mask": mask,
            "data order": next(iter(loader)).tolist(), "sampler order": list(sampler)}


# ----------------------------------------------------------------------------- state-dict prefixes

def wrapped_keys(rank: int, world_size: int) -> dict[str, dict[str, list[str]]]:
    """The keys of one ``nn.Linear`` as saved from each wrapper a training script uses, nested
    either way: by ``state_dict()``, and by ``get_model_state_dict``, which names them as the
    model itself does whatever wraps it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    device = rank_device()
    model = nn.Linear(2, 1).to(device)
    compiled = torch.compile(model)  # wraps at once; compiles only at the first call
    in_place = nn.Linear(2, 1).to(device)
    in_place.compile()  # compiles the module itself (at its first call): no wrapper, no prefix
    wrapped = {"model": model, "DDP(model)": DDP(model), "torch.compile(model)": compiled,
               "DDP(torch.compile(model))": DDP(compiled),
               "torch.compile(DDP(model))": torch.compile(DDP(model)),
               "model.compile(); DDP(model)": DDP(in_place)}
    return {"state_dict": {name: list(m.state_dict()) for name, m in wrapped.items()},
            "get_model_state_dict": {name: list(get_model_state_dict(m)) for name, m in wrapped.items()}}
