"""Sharded data parallelism: the ledgers (memory and bytes sent per rank) of notebook 10; its runs
are in :mod:`course_utils.sharding.runs`.

Memory per rank for Ψ parameters on N ranks, with p, g bytes per parameter and gradient element
and K bytes of optimizer state per parameter (``BYTES_PER_PARAMETER``: Adam in fp32, or mixed
precision with ``torch.autocast`` or FSDP2's ``MixedPrecisionPolicy``, 4, 4, 8; DeepSpeed's and
Apex O2's 16-bit parameters with an fp32 master copy, the ZeRO paper's count, 2, 2, 12):

========= ============== ============== ===============
strategy  parameters     gradients      optimizer state
========= ============== ============== ===============
DDP       pΨ             gΨ             KΨ
ZeRO-1    pΨ             gΨ             KΨ/N
ZeRO-2    pΨ             gΨ/N           KΨ/N
ZeRO-3    pΨ/N           gΨ/N           KΨ/N
FSDP      as ZeRO-3, each parameter's rows split as ``torch.chunk`` splits them
HSDP      as FSDP, over the G ranks of one node (N nodes of G: the model is replicated N times)
========= ============== ============== ===============

Bytes each rank sends per step, in the ring model: every collective a ring over its group in
rank order, a reduce-scatter or an all-gather of B bytes over n ranks sending B(n-1)/n per rank
and an all-reduce twice that, which is what NCCL's ring algorithm sends. DDP, ZeRO-1 and ZeRO-2
``2 sΨ (N-1)/N``, ZeRO-3 ``3 sΨ (N-1)/N`` (a second all-gather of the parameters, for backward).
On N nodes of G ranks, ``link_bytes_per_step`` says which link those bytes take, rank by rank: a
rank sends only to the next rank of the ring, so its bytes cross between nodes exactly when that
rank is on another node. That is a model of the calls torch makes (which groups, what sizes),
not of gloo's wire: gloo runs a reduce-scatter as an all-reduce of the whole tensor (its bytes,
``2B(n-1)/n``), and its rings send from each rank to the previous one for an all-reduce or a
reduce-scatter and to the next one for an all-gather (``tests/test_gloo_wire.py`` measures both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .._checks import check_int, check_positive_int
from ..dataparallel.memory import Ledger, ledger
from ..dataparallel.model_specs import ModelSpec
from .zero import shard_numel

__all__ = [
    "BYTES_PER_PARAMETER",
    "PASSES",
    "SHARDED",
    "ShardedLedger",
    "LINKS",
    "comm_bytes_per_step",
    "fsdp_local_numel",
    "link_bytes_per_step",
    "ring_steps_between_nodes",
    "sharded_bytes",
    "sharded_ledger",
]

#: accounting -> bytes per parameter of (parameters, gradients, AdamW's state) kept from step to
#: step. ``torch.autocast`` and FSDP2's ``MixedPrecisionPolicy`` keep the parameters, their gradients
#: and both moments in fp32, so mixed precision as this course runs it holds what fp32 holds. The
#: 16-bit copies of the weights are not state, but they are not short-lived either: autograd saves
#: autocast's copy of each weight whose layer's input needs a gradient (every layer but the first)
#: for that layer's backward, so about 2 bytes per parameter stay from forward until each layer's
#: backward (tests/test_mixed_precision_accounting.py). DeepSpeed's fp16/bf16 modes and Apex O2 store
#: 16-bit parameters and gradients and keep an fp32 master copy beside the two moments.
BYTES_PER_PARAMETER = {"fp32": (4, 4, 8), "autocast": (4, 4, 8), "master_weights": (2, 2, 12)}

#: strategy -> (parameters, gradients, optimizer state) sharded?
SHARDED = {"ddp": (False, False, False), "zero1": (False, False, True), "zero2": (False, True, True),
           "zero3": (True, True, True), "fsdp": (True, True, True), "hsdp": (True, True, True)}
_LABELS = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp": "FSDP",
           "hsdp": "HSDP"}


def _check_strategy(strategy: str) -> None:
    if strategy not in SHARDED:
        raise ValueError(f"strategy must be one of {tuple(SHARDED)}, got {strategy!r}")


def fsdp_local_numel(shapes: Sequence[Sequence[int]], world_size: int, rank: int) -> int:
    """Elements of ``rank``'s shards under ``fully_shard``: each parameter's dim 0 chunked as
    ``torch.chunk`` chunks it (so the last ranks may hold fewer rows, or none)."""
    total = 0
    for shape in shapes:
        rows, per_row = shape[0], int(torch.Size(shape[1:]).numel())
        size = shard_numel(rows, world_size)
        total += max(0, min(rows - rank * size, size)) * per_row
    return total


def sharded_bytes(numels: Sequence[int], world_size: int, strategy: str, *, rank: int = 0,
                  shapes: Sequence[Sequence[int]] = (), param_bytes: int = 4, grad_bytes: int = 4,
                  state_bytes: int = 8) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state on ``rank``: the ledger's model rows.

    ``numels``: elements of each flat unit (for ZeRO, ``ZeroByHand`` pads each to a multiple of N,
    and so does this count); for ``"fsdp"``, ``shapes`` (every parameter's shape) is used instead.
    ``"hsdp"`` counts as ``"fsdp"`` over the ranks of one node: ``world_size`` is then the mesh's
    ``"shard"`` size (G) and ``rank`` the rank's place along it.
    """
    _check_strategy(strategy)
    world_size = check_positive_int("world_size", world_size)
    if strategy in ("fsdp", "hsdp"):
        shard = full = fsdp_local_numel(shapes, world_size, rank)
    else:
        if any(check_int("numels", n) < 0 for n in numels):
            raise ValueError(f"numels must be ints >= 0, got {list(numels)!r}")
        shard = sum(shard_numel(n, world_size) for n in numels)
        full = sum(numels) if strategy == "ddp" else shard * world_size
    p, g, k = SHARDED[strategy]
    return {"parameters": (shard if p else full) * param_bytes,
            "gradients": (shard if g else full) * grad_bytes,
            "optimizer state": (shard if k else full) * state_bytes}


#: strategy -> passes of sΨ(N-1)/N bytes each rank sends per step: DDP and ZeRO-1/2 reduce and
#: gather once each (an all-reduce is both); ZeRO-3 and FSDP gather twice; PyTorch's
#: ZeroRedundancyOptimizer with DDP all-reduces every gradient, then broadcasts every parameter
PASSES = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 3, "fsdp": 3, "zero_redundancy": 3}


def comm_bytes_per_step(numel: int, world_size: int, strategy: str, itemsize: int = 4) -> float:
    """Bytes one rank sends per training step: ``2 sΨ(N-1)/N`` (DDP, ZeRO-1/2), ``3 sΨ(N-1)/N``
    (ZeRO-3, FSDP, and ``"zero_redundancy"``: ``ZeroRedundancyOptimizer`` with DDP)."""
    if strategy not in PASSES:
        raise ValueError(f"strategy must be one of {tuple(PASSES)}, got {strategy!r}")
    world_size = check_positive_int("world_size", world_size)
    if check_int("numel", numel) < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return PASSES[strategy] * numel * itemsize * (world_size - 1) / world_size


#: the link a rank's bytes take: to a rank of its own node, or to a rank on another node
LINKS = ("inside node", "between nodes")


def link_bytes_per_step(numel: int, nodes: int, gpus_per_node: int, strategy: str, itemsize: int = 4, *,
                        rank: int | None = None, reshard_after_forward: int | None = None,
                        micro_batches: int = 1, gather_itemsize: int | None = None,
                        shard_nodes: int = 1) -> dict[str, float]:
    """Bytes ``rank`` sends per step on each link in the ring model, ranks laid out
    ``gpus_per_node`` to a node in order (rank r on node r // G), every collective a ring over its
    group in rank order, in which a rank sends only to the next one: an all-gather or
    reduce-scatter of B bytes over n ranks (n-1)B/n, an all-reduce twice that (what NCCL's ring
    sends; gloo's reduce-scatter sends an all-reduce's bytes, see the module's docstring). Without
    ``rank``: the mean over the N·G ranks (what each GPU's network card carries when the crossings
    are spread evenly over every card).

    ``"ddp"`` all-reduces, ``"fsdp"`` all-gathers twice and reduce-scatters, on the ring of all
    N·G ranks, which crosses between nodes at each node's last rank only. ``reshard_after_forward``
    (``"fsdp"``, an int H dividing G): the backward all-gather runs over H ranks of one node.
    ``"hsdp"``: the all-gathers and the reduce-scatter over the ranks of ``shard_nodes`` whole
    nodes (one node by default; ``micro_batches`` times), one all-reduce of each rank's shard over
    the ranks holding the same shard, one per group of ``shard_nodes`` nodes, all of whose hops
    cross. ``numel``: Ψ after FSDP's padding. ``itemsize``: bytes per gradient element (the
    reductions); ``gather_itemsize``: bytes per parameter element of the all-gathers (FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)``: 2 for bf16), ``itemsize`` when None.
    """
    if strategy not in ("ddp", "fsdp", "hsdp"):
        raise ValueError(f"strategy must be one of ('ddp', 'fsdp', 'hsdp'), got {strategy!r}")
    nodes = check_positive_int("nodes", nodes)
    g = check_positive_int("gpus_per_node", gpus_per_node)
    if check_int("numel", numel) < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    m = check_positive_int("micro_batches", micro_batches)
    if reshard_after_forward is not None and (strategy != "fsdp" or g % check_positive_int(
            "reshard_after_forward", reshard_after_forward)):
        raise ValueError(f"reshard_after_forward must be None, or with 'fsdp' an int dividing "
                         f"gpus_per_node ({g}), got {reshard_after_forward!r}")
    if gather_itemsize is not None:
        if strategy == "ddp":
            raise ValueError("gather_itemsize must be None with 'ddp', which gathers no parameters")
        check_positive_int("gather_itemsize", gather_itemsize)
    k = check_positive_int("shard_nodes", shard_nodes)
    if nodes % k or (k != 1 and strategy != "hsdp"):
        raise ValueError(f"shard_nodes must be 1, or with 'hsdp' an int dividing nodes ({nodes}), got {k}")
    world, size = nodes * g, numel * itemsize
    gathered = numel * (itemsize if gather_itemsize is None else gather_itemsize)
    if rank is not None and not 0 <= check_int("rank", rank) < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if strategy == "hsdp":  # its shard group's ring, then a ring of one rank per group of nodes
        shards, replicas = k * g, nodes // k
        ring = m * (2 * gathered + size) * (shards - 1) / shards
        crosses = 0.0 if k == 1 else 1 / g if rank is None else float(rank % g == g - 1)
        across = 2 * size / shards * (replicas - 1) / replicas
        return dict(zip(LINKS, (ring * (1 - crosses), ring * crosses + across), strict=True))
    h = reshard_after_forward or 1
    if strategy == "ddp":
        flat = 2 * size * (world - 1) / world
    else:  # on the ring of all ranks: the forward all-gather (and the backward one), the reduce-scatter
        flat = ((1 if reshard_after_forward else 2) * gathered + size) * (world - 1) / world
    node_ring = gathered * (h - 1) / h  # the backward all-gather over H ranks of one node (or none)
    crosses = 0.0 if nodes == 1 else 1 / g if rank is None else float(rank % g == g - 1)
    return dict(zip(LINKS, (flat * (1 - crosses) + node_ring, flat * crosses), strict=True))


def ring_steps_between_nodes(nodes: int, gpus_per_node: int, strategy: str, shard_nodes: int = 1) -> int:
    """Steps per layer (per bucket under DDP) of the rings that cross between nodes, in the ring
    model, each of which waits on the network: a ring collective over n ranks takes n-1 steps (an
    all-reduce 2(n-1)), and in each one every rank sends a chunk to the next. ``"ddp"``: an
    all-reduce over all N·G ranks; ``"fsdp"``: two all-gathers and a reduce-scatter over them;
    ``"hsdp"``: an all-reduce over N ranks, one per node (its all-gathers and reduce-scatter stay
    inside the node), or with ``shard_nodes`` k over N/k ranks, beside the three passes on its
    shard group of k nodes. A ring-model count: NCCL may use trees across nodes instead, whose
    steps grow as the logarithm of the number of nodes."""
    if strategy not in ("ddp", "fsdp", "hsdp"):
        raise ValueError(f"strategy must be one of ('ddp', 'fsdp', 'hsdp'), got {strategy!r}")
    nodes, g = check_positive_int("nodes", nodes), check_positive_int("gpus_per_node", gpus_per_node)
    k = check_positive_int("shard_nodes", shard_nodes)
    if nodes % k or (k != 1 and strategy != "hsdp"):
        raise ValueError(f"shard_nodes must be 1, or with 'hsdp' an int dividing nodes ({nodes}), got {k}")
    if nodes == 1:
        return 0
    if strategy == "hsdp":
        return 2 * (nodes // k - 1) + (3 * (k * g - 1) if k > 1 else 0)
    return {"ddp": 2 * (nodes * g - 1), "fsdp": 3 * (nodes * g - 1)}[strategy]


@dataclasses.dataclass
class ShardedLedger(Ledger):
    """A DDP ledger whose model state is sharded as ``SHARDED[strategy]`` says (notebook 10)."""

    @property
    def label(self) -> str:
        return _LABELS[self.strategy]


def sharded_ledger(spec: ModelSpec, strategy: str, *, batch_size: int, num_devices: int,
                   mixed_precision: bool | str = False, gpus_per_node: int | None = None) -> Ledger:
    """Notebook 04's DDP ledger with the model state of ``strategy``; activations unchanged.

    ``mixed_precision`` names an accounting of ``BYTES_PER_PARAMETER``: ``"autocast"`` (what
    ``torch.autocast`` and FSDP2 keep: 4 + 4 + 8 bytes, notebooks 08 and 11) or
    ``"master_weights"`` (DeepSpeed, Apex O2: 2 + 2 + 12, the ZeRO paper's (2 + 2 + K)Ψ with
    K = 12). ``True`` is ``"master_weights"`` (notebook 10 follows the paper); ``False``, fp32.
    Activations, inputs and outputs are counted in fp32 either way. No DDP buckets except DDP's.
    ``"hsdp"`` shards over ``gpus_per_node`` ranks (one node), which must divide ``num_devices``.
    """
    _check_strategy(strategy)
    shards = num_devices
    if strategy == "hsdp":
        shards = check_positive_int("gpus_per_node", gpus_per_node)
        if check_positive_int("num_devices", num_devices) % shards:
            raise ValueError(f"gpus_per_node must divide num_devices ({num_devices}), got {shards}")
    if mixed_precision is True or mixed_precision is False:
        mixed_precision = "master_weights" if mixed_precision else "fp32"
    if mixed_precision not in BYTES_PER_PARAMETER:
        raise ValueError(f"mixed_precision must be True, False or one of {tuple(BYTES_PER_PARAMETER)}, "
                         f"got {mixed_precision!r}")
    base = ledger(spec, "ddp", batch_size=batch_size, num_devices=num_devices)
    sizes = BYTES_PER_PARAMETER[mixed_precision]
    psi, n = spec.parameters, shards
    rows = []
    for row in base.rows:
        row = dict(row)
        for (name, sharded), size in zip(zip(("parameters", "gradients", "optimizer state"),
                                             SHARDED[strategy], strict=True), sizes, strict=True):
            row[name] = size * (shard_numel(psi, n) if sharded else psi)
        row["DDP buckets"] = row["gradients"] if strategy == "ddp" else 0
        rows.append(row)
    return ShardedLedger(spec, strategy, batch_size, 0, base.rows_per_device, rows)
