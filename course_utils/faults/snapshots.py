"""Snapshots: everything a training run needs to continue exactly where it stopped (notebook 09).

A snapshot holds the model (always without a ``module.`` prefix), the optimizer, the gradient
scaler if any, where training stood (epoch, batches done in that epoch, global step), the random
number generators of *every* rank, and any extra values. Rank 0 writes it atomically: the bytes
go to a temporary file in the same folder, are flushed to disk, and only then renamed over the
old snapshot, so a process killed in the middle of a save leaves the previous snapshot intact.
Every rank reads it.

``ResumableSampler`` wraps a sampler so that a resumed epoch starts at the batch it stopped at,
without loading the samples it skips.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.utils.data import Sampler

from .._checks import check_int

__all__ = ["ResumableSampler", "SnapshotInfo", "load_snapshot", "save_snapshot", "state_copy",
           "strip_module_prefix"]

FORMAT = "course_utils.snapshot/1"


@dataclass(frozen=True)
class SnapshotInfo:
    """Where a loaded snapshot says training stood."""

    epoch: int
    step_in_epoch: int
    global_step: int
    extra: dict


class ResumableSampler(Sampler):
    """Yield ``sampler``'s indices from position ``skip`` on (set ``skip`` before each epoch)."""

    def __init__(self, sampler: Sampler, skip: int = 0) -> None:
        if not (hasattr(sampler, "__iter__") and hasattr(sampler, "__len__")):
            raise TypeError(f"sampler must be a sampler (iterable with a length), "
                            f"got {type(sampler).__name__}")
        self.sampler = sampler
        self.skip = skip

    @property
    def skip(self) -> int:
        return self._skip

    @skip.setter
    def skip(self, value: int) -> None:
        value = check_int("skip", value)
        if value < 0:
            raise ValueError(f"skip must be >= 0, got {value}")
        self._skip = value

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self._skip, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self._skip)


def state_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model``'s state dict: what a rank returns to compare weights."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def strip_module_prefix(state: dict[str, Any]) -> dict[str, Any]:
    """Drop the ``module.`` that DataParallel and DDP put before every key, if every key has it."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a state dict (a dict), got {type(state).__name__}")
    copy = OrderedDict(state)
    if hasattr(state, "_metadata"):  # per-module versions that load_state_dict reads
        copy._metadata = OrderedDict(state._metadata)
    if state and all(k.startswith("module.") for k in state):
        consume_prefix_in_state_dict_if_present(copy, "module.")  # torch's own helper
    return copy


def _inner(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is pinned
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _rank_and_rngs() -> tuple[int, list[dict[str, Any]]]:
    import torch.distributed as dist

    local = _rng_state()
    if not (dist.is_available() and dist.is_initialized()):
        return 0, [local]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return dist.get_rank(), everyone


def _check_path(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    return Path(path)


def save_snapshot(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    epoch: int,
    step_in_epoch: int,
    global_step: int,
    extra: dict | None = None,
    before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Write a snapshot to ``path`` (rank 0 only; every rank must call it, as a collective).

    The temporary file is ``.<name>.tmp-<pid>`` beside ``path``; ``before_commit(tmp)`` runs
    after it is on disk and before the rename (a test uses it to kill the writer mid-save).
    """
    import torch.distributed as dist

    path = _check_path(path)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, "
                        f"got {type(optimizer).__name__}")
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
    for name, value in (("epoch", epoch), ("step_in_epoch", step_in_epoch),
                        ("global_step", global_step)):
        if check_int(name, value) < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot save a snapshot in {path.parent}: no such folder")
    rank, rngs = _rank_and_rngs()
    if rank == 0:
        payload = {
            "format": FORMAT,
            "model": _inner(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step,
            "rng": rngs,
            "extra": dict(extra or {}),
        }
        # region: atomic
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        if before_commit is not None:
            before_commit(tmp)
        os.replace(tmp, path)  # atomic: readers see the old snapshot or the new one, never half
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by writers that died
            stale.unlink(missing_ok=True)
        # endregion
        if hasattr(os, "O_DIRECTORY"):
            folder = os.open(path.parent, os.O_DIRECTORY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody reads before rank 0 has finished writing
    return path


def load_snapshot(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    *,
    restore_rng: bool = True,
) -> SnapshotInfo:
    """Restore ``model`` (plain or wrapped), ``optimizer``, ``scaler`` and this rank's RNGs."""
    import torch.distributed as dist

    path = _check_path(path)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not path.is_file():
        raise FileNotFoundError(f"no snapshot at {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"{path} is not a readable snapshot: {err}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a course_utils snapshot (format {FORMAT})")
    _inner(model).load_state_dict(strip_module_prefix(payload["model"]))
    if optimizer is not None:
        if payload["optimizer"] is None:
            raise ValueError(f"{path} holds no optimizer state")
        optimizer.load_state_dict(payload["optimizer"])
    if scaler is not None and payload["scaler"] is not None:
        scaler.load_state_dict(payload["scaler"])
    if restore_rng:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        rngs = payload["rng"]
        _set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    return SnapshotInfo(payload["epoch"], payload["step_in_epoch"], payload["global_step"],
                        payload["extra"])
