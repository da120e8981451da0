"""What notebook 09 runs to show that a snapshot must hold everything, and that saves are atomic.

``train_in_process`` is a small training loop in one process (no process group) with the parts
that make resuming hard: SGD with momentum (optimizer state), dropout (random numbers), and a
shuffled ``DistributedSampler`` walked batch by batch (a position inside an epoch). It can stop
after a chosen step, leaving a snapshot, and resume from it while deliberately forgetting parts
of the snapshot, to show what each part is for.

``die_while_saving`` is a rank function for ``launch``: it writes one good snapshot, then dies
with SIGKILL in the middle of writing the next, either the atomic way (``save_snapshot``) or
by writing the new snapshot straight over the old file.
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from .._checks import check_positive_int
from ..data import regression_dataset
from ..distributed import rank_print
from ..models import seeded
from .snapshots import ResumableSampler, load_snapshot, save_snapshot, state_copy

__all__ = ["PARTS", "KillAt", "demo_model", "die_while_saving", "kill_myself", "train_in_process"]

#: What a resume can restore, besides the model's weights.
PARTS = ("optimizer", "rng", "position")

_BATCH = 8
_SAMPLES = 48  # 6 steps per epoch


def demo_model() -> nn.Module:
    """The demos' model: a small MLP with dropout, with the same initial weights every time."""
    return seeded(0, lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 2)))


def train_in_process(
    total_steps: int,
    snapshot: str | os.PathLike | None = None,
    *,
    stop_after: int | None = None,
    resume: bool = False,
    restore: tuple[str, ...] = PARTS,
) -> dict:
    """Train for ``total_steps`` steps (6 per epoch), or stop after ``stop_after`` steps.

    With ``stop_after``, a snapshot is written to ``snapshot`` at that step and training stops.
    With ``resume``, training continues from ``snapshot``, restoring only the parts named in
    ``restore`` (a subset of :data:`PARTS`; the weights are always restored). Returns the final
    parameters, the losses of the steps this call ran, and the step it started from.
    """
    # region: setup
    torch.manual_seed(1234)  # the job's random numbers (dropout) start from a fixed state
    dataset = regression_dataset(_SAMPLES, 8, 2, seed=0)[0]
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    resumable = ResumableSampler(sampler)
    # The loader's own generator: otherwise every new epoch's iterator draws a seed from the
    # global generator, and a resumed run (which starts one more iterator) would drift.
    loader = DataLoader(dataset, batch_size=_BATCH, sampler=resumable,
                        generator=torch.Generator().manual_seed(0))
    model = demo_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epoch = batch = step = 0
    if resume:
        info = load_snapshot(snapshot, model, optimizer if "optimizer" in restore else None,
                             restore_rng="rng" in restore)
        step = info.global_step
        if "position" in restore:
            epoch, batch = info.epoch, info.step_in_epoch
    # endregion
    start, losses = step, []
    steps_per_epoch = _SAMPLES // _BATCH
    while step < total_steps:
        sampler.set_epoch(epoch)
        resumable.skip = batch * _BATCH
        for inputs, targets in loader:
            loss = nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step, batch = step + 1, batch + 1
            if batch == steps_per_epoch:
                epoch, batch = epoch + 1, 0
            if step == stop_after:
                save_snapshot(snapshot, model, optimizer, epoch=epoch, step_in_epoch=batch,
                              global_step=step)
                return {"params": state_copy(model), "losses": losses, "start": start}
            if step == total_steps:
                break
    return {"params": state_copy(model), "losses": losses, "start": start}


def kill_myself(_tmp: Path) -> None:
    """The hook ``die_while_saving`` gives ``save_snapshot(before_commit=...)``: SIGKILL, now."""
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt:
    """A fault to inject into ``train_resumable(..., before_step=KillAt(rank, step))`` (notebook 09).

    Rank ``rank`` sends itself SIGKILL once ``step`` steps are done, on the first attempt only
    (``TORCHELASTIC_RESTART_COUNT`` is 0), so that a job restarted by torchrun runs through.
    """

    def __init__(self, rank: int, step: int) -> None:
        self.rank = check_positive_int("rank", rank, minimum=0)
        self.step = check_positive_int("step", step, minimum=0)

    def __repr__(self) -> str:
        return f"KillAt(rank={self.rank}, step={self.step})"

    def check(self, world_size: int, total_steps: int) -> None:
        """Refuse a fault that would never fire in a job of this size."""
        if not (self.rank < world_size and self.step < total_steps):
            raise ValueError(f"{self!r} never fires: the rank must be in [0, {world_size}) and the "
                             f"step in [0, {total_steps})")

    def __call__(self, rank: int, global_step: int, attempt: int) -> None:
        if rank == self.rank and global_step == self.step and attempt == 0:
            rank_print(f"rank {rank}: SIGKILL to myself after step {global_step}", rank=rank)
            os.kill(os.getpid(), signal.SIGKILL)


def die_while_saving(rank: int, world_size: int, path: str, how: str) -> None:
    """Save a good snapshot (step 1) at ``path``, then die while saving the next (step 2).

    ``how="atomic"`` uses ``save_snapshot`` and dies after the new bytes are on disk, before the
    rename. ``how="in place"`` writes the new snapshot straight into ``path`` and dies half-way.
    """
    model = demo_model()
    save_snapshot(path, model, epoch=0, step_in_epoch=1, global_step=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if how == "atomic":
        save_snapshot(path, model, epoch=0, step_in_epoch=2, global_step=2,
                      before_commit=kill_myself)
    else:
        payload = torch.load(path, weights_only=True)
        payload.update(model=model.state_dict(), step_in_epoch=2, global_step=2)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = buffer.getvalue()
        with open(path, "wb") as f:  # opening for writing truncates the good snapshot at once
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: the process should have died")  # pragma: no cover
