"""The runs of notebook 10's last section: data parallelism on a 2-D ``DeviceMesh`` (HSDP).

Four ranks stand for 2 nodes of 2 GPUs. ``mesh_2d`` lays them out as a (nodes, gpus_per_node)
mesh whose dimensions are named for what the model does along them: ``"replicate"`` (across
nodes: one rank per node, each holding the same shard) and ``"shard"`` (inside a node: the ranks
that split the model between them). ``mesh_rank`` trains ``toy_model()`` on the same rows as
notebook 10's FSDP section five ways: DDP and FSDP on the flat group of all ranks, FSDP with
``reshard_after_forward`` set to the node size, HSDP on the mesh, and HSDP accumulating two
micro-batches with ``set_requires_all_reduce(False)``. ``logged_links`` counts what each rank
sends in every collective torch's own code runs, in a ring over the collective's group in rank
order (``LinkLog``), on the link to the next rank of that ring: inside its node or between nodes.
That is the ring model applied to the calls FSDP2 and DDP make (which groups, what sizes): what
NCCL's ring would send, not what gloo sends (``ledgers``' docstring says how they differ).
``ledgers.link_bytes_per_step`` is the formula the counts must equal.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .ledgers import LINKS, link_bytes_per_step
from .runs import logged_collectives, model_state_bytes, shard_layers, toy_batches, toy_model

__all__ = ["MESH_DIMS", "RUNS", "LinkLog", "describe_mesh", "logged_links", "mesh_2d", "mesh_rank", "node_of",
           "run_link_bytes", "train"]

#: the mesh's dimensions, outer first: across nodes the model is replicated, inside one it is sharded
MESH_DIMS = ("replicate", "shard")


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node a global rank runs on: torchrun numbers a node's ranks one after another."""
    return rank // gpus_per_node


class LinkLog:
    """Bytes one rank sends in each collective, in a ring over the collective's group in rank
    order, as ``zero.CommLog`` counts them: a rank sends only to the next rank of that ring, so all
    its bytes go on one link, ``"inside node"`` when that rank is on its node, ``"between nodes"``
    when it is not (notebook 10). ``groups``: the groups whose ring it sent on, by link. Which way
    round the ring runs is a convention: the other way, other ranks send across, as many bytes."""

    def __init__(self, gpus_per_node: int) -> None:
        self.gpus_per_node = gpus_per_node
        self.sent: dict[str, dict[str, float]] = {link: {} for link in LINKS}
        self.groups: dict[str, set[tuple[int, ...]]] = {link: set() for link in LINKS}

    def count(self, kind: str, tensor: torch.Tensor, group: Any = None) -> None:
        """Log one collective; ``tensor`` as for ``CommLog.count``, ``group`` the one it ran on."""
        import torch.distributed as dist

        if kind == "broadcast":  # who sends depends on the source, which the log is not told
            raise ValueError("LinkLog counts all-reduces, all-gathers and reduce-scatters, not broadcasts")
        ranks = sorted(dist.get_process_group_ranks(dist.group.WORLD if group is None else group))
        n, nbytes, me = len(ranks), tensor.nbytes, dist.get_rank()
        if kind == "all_reduce":
            sent = 2 * nbytes * (n - 1) / n
        else:  # reduce-scatter (the output, a shard) and all-gather (the input, a shard): N-1 shards
            sent = (n - 1) * nbytes
        after = ranks[(ranks.index(me) + 1) % n]  # the next rank of the ring, which receives it all
        link = LINKS[node_of(after, self.gpus_per_node) != node_of(me, self.gpus_per_node)]
        self.sent[link][kind] = self.sent[link].get(kind, 0.0) + sent
        self.groups[link].add(tuple(ranks))

    def per_step(self, steps: int) -> dict[str, dict[str, float]]:
        """Bytes sent per step: link -> kind of collective -> bytes."""
        return {link: {kind: b / steps for kind, b in kinds.items()} for link, kinds in self.sent.items()}


def logged_links(log: LinkLog) -> contextlib.AbstractContextManager[None]:
    """While inside, count in ``log`` what torch's own code hands to ``dist.all_reduce``,
    ``dist.broadcast`` and the flat all-gather and reduce-scatter, with the group each ran on
    (``runs.logged_collectives``, which counts the same calls for one flat group)."""
    return logged_collectives(log, groups=True)


def mesh_2d(nodes: int, gpus_per_node: int) -> Any:
    """A ``DeviceMesh`` of ``nodes`` × ``gpus_per_node`` ranks, dimensions named ``MESH_DIMS``, on
    this rank's device type (``cuda`` under NCCL, ``cpu`` under gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ..devices import rank_device

    # region: mesh
    mesh = init_device_mesh(rank_device().type, (nodes, gpus_per_node),  # a row per node
                            mesh_dim_names=("replicate", "shard"))  # across nodes, within a node
    # endregion
    return mesh


def describe_mesh(mesh: Any, gpus_per_node: int) -> dict:
    """This rank's place on ``mesh``: its coordinates, and for each named dimension the ranks of
    its group along it and whether they would all be inside one machine on a real cluster."""
    import torch.distributed as dist

    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names}
    return {"coordinate": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True)),
            "groups": groups,
            "inside one node": {name: len({node_of(r, gpus_per_node) for r in ranks}) == 1
                                for name, ranks in groups.items()}}


def train(model: nn.Module, batches: list, lr: float, micro_batches: int = 1) -> torch.optim.Optimizer:
    """AdamW on ``batches``, each cut into ``micro_batches`` whose gradients add up before the
    step; under HSDP only the last micro-batch all-reduces across nodes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        # region: accumulate
        for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            if micro_batches > 1:  # HSDP: reduce-scatter inside the node each time, all-reduce once
                model.set_requires_all_reduce(i == micro_batches - 1)
            loss = nn.functional.mse_loss(model(xm), ym) * len(xm) / len(x)  # its share of the batch
            loss.backward()
        # endregion
        optimizer.step()
    return optimizer


#: mesh_rank's runs: name -> (strategy, reshard_after_forward set to the node size?, micro-batches);
#: "hsdp" runs on the 2-D mesh, the others on the flat group of all ranks
RUNS = {"ddp": ("ddp", False, 1), "fsdp": ("fsdp", False, 1), "fsdp_node": ("fsdp", True, 1),
        "hsdp": ("hsdp", False, 1), "hsdp_accum": ("hsdp", False, 2)}


def run_link_bytes(run: str, numel: int, nodes: int, gpus_per_node: int, rank: int | None = None) -> dict:
    """``ledgers.link_bytes_per_step`` for one of the ``RUNS``."""
    strategy, node_size, micro_batches = RUNS[run]
    return link_bytes_per_step(numel, nodes, gpus_per_node, strategy, rank=rank, micro_batches=micro_batches,
                               reshard_after_forward=gpus_per_node if node_size else None)


def mesh_rank(rank: int, world_size: int, nodes: int = 2, steps: int = 3, rows: int = 12,
              lr: float = 1e-2) -> dict:
    """One of ``world_size`` ranks on ``nodes`` nodes: the ``RUNS``, each trained on this rank's
    rows of the FSDP section's batches. Returns the mesh as this rank sees it and, per run, the
    full parameters after training, the bytes of model state held and the bytes sent per step on
    each link."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ..devices import rank_device, wrap_ddp

    device, gpus_per_node = rank_device(), world_size // nodes
    batches = [(x.chunk(world_size)[rank].to(device), y.chunk(world_size)[rank].to(device))
               for x, y in toy_batches(steps, rows)]
    mesh = mesh_2d(nodes, gpus_per_node)
    out: dict = {"mesh": describe_mesh(mesh, gpus_per_node), "device": str(device)}
    logs = {run: LinkLog(gpus_per_node) for run in RUNS}

    model = toy_model().to(device)
    ddp_model = wrap_ddp(model, device)
    ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's all-reduce, counted
    with logged_links(logs["ddp"]):
        optimizer = train(ddp_model, batches, lr)
    out["ddp"] = {"parameters": [p.detach().cpu() for p in model.parameters()],
                  "held": model_state_bytes(model, optimizer)}
    del ddp_model

    for run, (strategy, node_size, micro_batches) in list(RUNS.items())[1:]:
        with logged_links(logs[run]):
            # region: hsdp
            model = shard_layers(toy_model().to(device), mesh=mesh if strategy == "hsdp" else None,
                                 reshard_after_forward=gpus_per_node if node_size else None)
            optimizer = train(model, batches, lr, micro_batches)
            # endregion
        weight = model[0].weight
        out[run] = {"parameters": [p.full_tensor().cpu() for p in model.parameters()],
                    "held": model_state_bytes(model, optimizer), "placements": str(weight.placements),
                    "local": tuple(weight.to_local().shape)}
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    for run, log in logs.items():
        out[run]["sent"] = log.per_step(steps)
        out[run]["groups"] = {link: sorted(groups) for link, groups in log.groups.items()}
    return out
