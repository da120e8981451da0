"""Which backend a job uses and which device each rank computes on: one place for the whole course.

Every rank function of the course (notebooks 05, 09, 11) gets its device from :func:`rank_device`,
never by building ``torch.device("cuda", rank)`` or leaving tensors on the CPU by default. The rules:

- **Backend** (:func:`choose_backend`): NCCL when every rank on this machine can have a GPU of its
  own and NCCL exists; gloo otherwise. One GPU cannot host two NCCL ranks ("Duplicate GPU
  detected"), so two ranks on one GPU, like two emulated nodes on one machine, use gloo. The
  environment variable ``COURSE_BACKEND`` (``gloo`` or ``nccl``) overrides the choice; the
  launchers set it when they must.
- **Device** (:func:`device_for`): under NCCL, rank ``LOCAL_RANK`` computes on ``cuda:LOCAL_RANK``;
  under gloo, on the CPU (gloo's collectives on CUDA tensors exist, but the course keeps gloo jobs
  on the CPU so that they run the same everywhere).
- **Binding** (:func:`init_kwargs`, :func:`rank_device`): under NCCL, ``torch.cuda.set_device`` runs
  before any CUDA work, and ``init_process_group`` is told the device (``device_id``), so that a
  ``barrier()`` knows which GPU it uses instead of guessing with a warning.

The course's tests check every rank function against these rules on any machine
(``tests/device_audit.py``): a tensor that reaches a collective or a module without passing
through ``.to(rank_device())`` runs on the CPU anyway, but would fail under NCCL.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._checks import check_positive_int

__all__ = [
    "BACKEND_VARIABLE",
    "choose_backend",
    "device_for",
    "emulated_node_env",
    "gpu_count",
    "init_kwargs",
    "local_rank",
    "rank_device",
    "wrap_ddp",
]

#: Set to ``gloo`` or ``nccl`` to override :func:`choose_backend` (the launchers set it).
BACKEND_VARIABLE = "COURSE_BACKEND"


def gpu_count() -> int:
    """How many CUDA devices this process may use (0 without CUDA). Does not initialise CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(ranks_on_this_machine: int, *, gpus: int | None = None,
                   nccl_available: bool | None = None) -> str:
    """``"nccl"`` when each of the ranks on this machine can have a GPU of its own, else ``"gloo"``.

    ``gpus`` and ``nccl_available`` default to this machine's; the variable ``COURSE_BACKEND``
    overrides the rule.
    """
    import torch.distributed as dist

    ranks = check_positive_int("ranks_on_this_machine", ranks_on_this_machine)
    forced = os.environ.get(BACKEND_VARIABLE, "")
    if forced:
        if forced not in ("gloo", "nccl"):
            raise ValueError(f"{BACKEND_VARIABLE} must be 'gloo' or 'nccl', got {forced!r}")
        return forced
    gpus = gpu_count() if gpus is None else gpus
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be an int >= 0, got {gpus!r}")
    if nccl_available is None:
        nccl_available = dist.is_available() and dist.is_nccl_available()
    return "nccl" if nccl_available and gpus >= ranks else "gloo"


def local_rank() -> int:
    """This process's rank on its machine: ``LOCAL_RANK``, else the global rank, else 0."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device of the rank with this ``local_rank`` under ``backend``: ``cuda:N`` or the CPU."""
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def init_kwargs(backend: str, local_rank: int) -> dict[str, Any]:
    """Bind this process to its GPU (NCCL) and return what ``init_process_group`` should be told.

    Under NCCL: ``torch.cuda.set_device`` now, before any CUDA work, and ``{"device_id": device}``
    for ``init_process_group``. Under gloo: nothing to do, ``{}``.
    """
    device = device_for(backend, local_rank)
    if device.type != "cuda":
        return {}
    torch.cuda.set_device(device)
    return {"device_id": device}


def rank_device() -> torch.device:
    """The device this rank computes on, in the current process group (the CPU outside one).

    Under NCCL it is ``cuda:LOCAL_RANK``, and it is made the current CUDA device.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    device = device_for(dist.get_backend(), local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def wrap_ddp(model: torch.nn.Module, device: torch.device, **options: Any) -> torch.nn.Module:
    """``DistributedDataParallel(model, **options)`` for a model on ``device`` (notebook 05): on a GPU
    DDP is told which one (``device_ids=[device.index]``, the GPU ``rank_device`` chose, which need
    not be ``cuda:rank``); on the CPU it is told none."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **options)


def emulated_node_env(node: int, nnodes: int, nproc_per_node: int, *,
                      gpus: int | None = None) -> dict[str, str]:
    """The environment for node ``node`` of ``nnodes`` emulated as agents on this one machine.

    Real nodes each have their own GPUs, numbered from 0 on each. Emulated nodes share this
    machine's: with a GPU for every rank of every node, node ``i`` sees only its own slice
    (``CUDA_VISIBLE_DEVICES``), so its local rank 0 is a different GPU from the other nodes'; with
    fewer, every agent is told to use gloo on the CPU (``COURSE_BACKEND=gloo``), since two NCCL
    ranks on one GPU stop with "Duplicate GPU detected".
    """
    nnodes = check_positive_int("nnodes", nnodes)
    nproc_per_node = check_positive_int("nproc_per_node", nproc_per_node)
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nnodes:
        raise ValueError(f"node must be an int in [0, {nnodes}), got {node!r}")
    gpus = gpu_count() if gpus is None else gpus
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be an int >= 0, got {gpus!r}")
    if gpus < nnodes * nproc_per_node:
        return {BACKEND_VARIABLE: "gloo"}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()] or [str(i) for i in range(gpus)]
    mine = ids[node * nproc_per_node:(node + 1) * nproc_per_node]
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}
