"""Which backend a job uses and which device each rank computes on: one place for the whole course.

Every rank function of the course (notebooks 05, 07, 09) gets its device from :func:`rank_device`,
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

:class:`DeviceAudit` checks a rank function against these rules on any machine: it marks every
tensor created on the default device without being asked for, follows it through torch's
operations, and records each one that reaches a collective or a module without passing through
``.to(rank_device())`` (or a factory called with ``device=rank_device()``). On the CPU such a rank
function runs anyway; under NCCL it would fail. The course's tests run every rank function under it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from ._checks import check_positive_int

__all__ = [
    "BACKEND_VARIABLE",
    "DeviceAudit",
    "audited",
    "choose_backend",
    "device_for",
    "emulated_node_env",
    "gpu_count",
    "init_kwargs",
    "local_rank",
    "rank_device",
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
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise ValueError(f"local_rank must be an int >= 0, got {local_rank!r}")
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


# ----------------------------------------------------------------------------- the audit

#: Collectives whose tensor arguments must be on the rank's device; the flat all-gather and
#: reduce-scatter under both releases' names (2.13's ``*_single``, see compat), since the
#: course's ZeRO by hand calls whichever this torch has.
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_single",
                "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend",
                "irecv", "gather", "scatter")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> Any:
    try:
        storage = t.untyped_storage()
        return storage if storage.data_ptr() else None  # empty tensors hold no memory
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (sparse, meta, DTensor...)
        return None


class DeviceAudit(torch.overrides.TorchFunctionMode):
    """Record tensors that reach a collective or a module without being put on the rank's device.

    While active, a factory call (``torch.tensor``, ``torch.randn``, a layer's parameters...)
    without ``device=`` marks the memory it creates as *unplaced*, and so does any operation that
    reads unplaced memory. ``.to(device)``, ``.cuda()`` and factories given the rank's device
    make placed tensors (on the CPU, ``.to`` returns its input unchanged, so the audit hands back
    a copy). Each unplaced tensor that reaches a collective (its tensor arguments) or a module
    (its inputs, parameters and buffers) is a violation, listed in ``violations``.

    The audit keeps unplaced memory alive until it ends, so that an address freed and reused by a
    placed tensor cannot be mistaken for it: use it on small jobs. It sees only values: a factory
    called with a hard-coded ``device="cpu"`` passes on a CPU rank, so review those by eye.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.device = device
        self.violations: list[str] = []
        self._unplaced: dict[int, Any] = {}  # data pointer -> storage (kept alive on purpose)
        self._undo: list[Callable[[], None]] = []

    def is_unplaced(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        return storage is not None and storage.data_ptr() in self._unplaced

    def _mark(self, out: Any) -> None:
        for t in _tensors(out):
            storage = _storage(t)
            if storage is not None:
                self._unplaced[storage.data_ptr()] = storage

    @staticmethod
    def _placing(name: str, args: tuple, kwargs: dict) -> bool:
        """Whether a call puts its result on a device on purpose (``.to(device)``, ``.cuda()``)."""
        if name == "cuda":
            return True
        return name == "to" and ("device" in kwargs or any(
            isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args[1:]))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(args) + _tensors(kwargs)
        out = func(*args, **kwargs)
        if self._placing(name, args, kwargs):
            if any(o is i or _storage(o) is not None and o.data_ptr() == i.data_ptr()
                   for o in _tensors(out) for i in inputs):
                out = out.clone()  # already on that device: a placed copy, so the audit can tell
        elif not inputs:  # a factory: placed only when asked for the rank's device
            asked = kwargs.get("device")
            if asked is None or torch.device(asked) != self.device:
                self._mark(out)
        elif not name.endswith("_") and any(self.is_unplaced(t) for t in inputs):
            self._mark(out)  # computed from unplaced memory (in-place writes keep their target's)
        return out

    def _check(self, where: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if self.is_unplaced(t):
                self.violations.append(f"{where}: a {tuple(t.shape)} {t.dtype} tensor was never "
                                       "put on the rank's device")
                del self._unplaced[t.untyped_storage().data_ptr()]  # report each tensor once

    def __enter__(self) -> DeviceAudit:
        import torch.distributed as dist

        if self.device is None:
            self.device = rank_device()

        def forward_hook(module: torch.nn.Module, args: tuple) -> None:
            name = type(module).__name__
            self._check(f"{name} input", _tensors(args))
            self._check(f"{name} parameter or buffer",
                        list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))

        handle = torch.nn.modules.module.register_module_forward_pre_hook(forward_hook)
        self._undo.append(handle.remove)
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def checked(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                self._check(f"dist.{_name}", _tensors(args) + _tensors(kwargs))
                return _original(*args, **kwargs)

            setattr(dist, name, checked)
            self._undo.append(functools.partial(setattr, dist, name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        while self._undo:
            self._undo.pop()()
        self._unplaced.clear()


def audited(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> dict:
    """A rank function for ``launch``: run ``fn(rank, world_size, *args)`` under a :class:`DeviceAudit`.

    Returns ``{"device": the rank's device, "violations": [...], "result": type of fn's result}``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a rank function, got {type(fn).__name__}")
    with DeviceAudit() as audit:
        result = fn(rank, world_size, *args)
    return {"device": str(audit.device), "violations": audit.violations,
            "result": type(result).__name__}
