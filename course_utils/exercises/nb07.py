"""Judges of the exercises of notebook 07 (fault tolerance and several nodes);
their content is in nb07.toml."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from .core import load_bank, not_a_pair

__all__ = ["EXERCISES"]


class _DiesHalfWay:
    """Stands in for the moment a writer is killed: pickling it raises in the middle of a save."""

    def __reduce__(self):
        raise RuntimeError("the writer died half-way through the save (simulated)")


def _step_in(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True).get("step")
    except Exception:  # noqa: BLE001 - an unreadable file is what the judge looks for
        return None


def _judge_save_atomically(answer: Any) -> str | None:
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "snapshot.pt"
        answer({"step": 1}, str(target))
        if _step_in(target) != 1:
            return "after save_atomically(state, path), torch.load(path) should give the state back"
        events: list[tuple] = []  # ("sync", inode) and ("rename", inode, src, dst), in order
        real_replace, real_rename, real_fsync = os.replace, os.rename, os.fsync

        def renamed(real):
            def rename(src, dst, *args, **kwargs):
                events.append(("rename", os.stat(src).st_ino, Path(src), Path(dst)))
                return real(src, dst, *args, **kwargs)
            return rename

        def fsync(fd):
            events.append(("sync", os.fstat(fd).st_ino))
            return real_fsync(fd)

        with mock.patch.object(os, "replace", renamed(real_replace)), \
                mock.patch.object(os, "rename", renamed(real_rename)), mock.patch.object(os, "fsync", fsync):
            answer({"step": 2}, str(target))
            if _step_in(target) != 2:
                return "a second save should replace the first: torch.load(path) gave the old state back"
            try:
                answer({"step": 3, "payload": _DiesHalfWay()}, str(target))
            except Exception:  # noqa: BLE001, S110 - the simulated death is expected
                pass
        if _step_in(target) != 2:
            return ("a save that died half-way destroyed the last good snapshot: writing over the "
                    "file truncates it first. Write the new snapshot under another name, then put it "
                    "in place in one step")
        renames = [e for e in events if e[0] == "rename"]
        if not renames:
            return ("the new snapshot must take the old one's place in one atomic step: a rename "
                    "(os.replace), not a copy")
        if any(src.parent != target.parent for _, _, src, _ in renames):
            return ("the temporary file is in another folder, perhaps on another file system, where "
                    "a rename is no longer atomic (it becomes a copy): write it beside the target")
        if not any(e[0] == "sync" for e in events):
            return ("force the new file to disk (os.fsync) before the rename: after a crash the rename "
                    "could otherwise be on disk before the data")
        first = events.index(renames[0])
        if not any(e == ("sync", renames[0][1]) for e in events[:first]):
            return ("the new snapshot reached the disk only after the rename (or another file did): after "
                    "a crash the name could point at a file whose data never arrived; force it first")
    return None


_BATCH, _SAMPLES, _RESUME_AT, _STEPS = 4, 24, 8, 15  # 6 batches per epoch; resume after step 8 of 15


def _job_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(_SAMPLES, 8, generator=g), torch.randn(_SAMPLES, 2, generator=g)


def _job() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small job with everything at stake: dropout (random numbers) and momentum (state)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, batch: int,
           steps: int) -> tuple[int, int]:
    """``steps`` steps from batch ``batch`` of ``epoch``, each epoch in its own shuffled order (the
    sampler's seed + epoch rule); returns where the next step would start."""
    inputs, targets = _job_data()
    batches = _SAMPLES // _BATCH
    for _ in range(steps):
        order = torch.randperm(_SAMPLES, generator=torch.Generator().manual_seed(epoch))
        rows = order[batch * _BATCH:(batch + 1) * _BATCH]
        loss = nn.functional.mse_loss(model(inputs[rows]), targets[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        epoch, batch = (epoch + 1, 0) if batch + 1 == batches else (epoch, batch + 1)
    return epoch, batch


def _judge_snapshot(answer: Any) -> str | None:
    with torch.random.fork_rng():  # the notebook's own random numbers stay as they were
        torch.manual_seed(1234)
        model, optimizer = _job()
        epoch, batch = _train(model, optimizer, 0, 0, _RESUME_AT)
        snapshot = answer(model, optimizer, epoch, batch)
        if not isinstance(snapshot, dict):
            return f"return a dict (what torch.save writes), not {type(snapshot).__name__}"
        saved = io.BytesIO()
        torch.save(snapshot, saved)  # now, as a job does: later steps must not change it
        _train(model, optimizer, epoch, batch, _STEPS - _RESUME_AT)
        uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

        torch.manual_seed(999)  # a fresh process: its own initial weights and random numbers
        model, optimizer = _job()
        saved.seek(0)
        try:
            loaded = torch.load(saved, weights_only=True)
        except Exception:  # noqa: BLE001 - what weights_only refuses is the point
            return ("torch.load(..., weights_only=True), as load_snapshot reads a snapshot, refuses "
                    "whole objects: store state dicts and plain values")
        if not isinstance(loaded.get("model"), dict):
            return "the snapshot needs the model's weights, as its state dict, under 'model'"
        model.load_state_dict(loaded["model"])
        if "optimizer" in loaded:
            optimizer.load_state_dict(loaded["optimizer"])
        rng = loaded.get("rng")
        if isinstance(rng, int):
            return ("'rng' holds a seed: that says where the random numbers started, not where they "
                    "stand after 8 steps")
        if rng is not None:
            torch.set_rng_state(rng)
        if "epoch" not in loaded or "step_in_epoch" not in loaded:
            return "the snapshot needs the position: without it the resumed run starts epoch 0 again"
        _train(model, optimizer, loaded["epoch"], loaded["step_in_epoch"], _STEPS - _RESUME_AT)
        resumed = model.state_dict()
    if all(torch.equal(resumed[k], v) for k, v in uninterrupted.items()):
        return None
    if "optimizer" not in loaded:
        return ("the resumed run differs from its first step: besides the weights, what decides how "
                "big a step of SGD with momentum is?")
    if rng is None:
        return ("the resumed run drifts where randomness enters (dropout): the snapshot must hold "
                "where the random numbers stand")
    return ("the resumed run still ends elsewhere than the uninterrupted one: compare what your "
            "snapshot holds with the table at the top of the notebook")


def _judge_restart(answer: Any) -> str | None:
    wrong_shape = not_a_pair(answer, "(the step of the snapshot the job resumes from, steps computed twice)")
    if wrong_shape:
        return wrong_shape
    resumed, repeated = answer
    every, killed_after = 3, 10
    last = killed_after // every * every
    if resumed != last:
        if resumed == killed_after:
            return ("the job resumes from its last snapshot, and snapshots are written every 3 "
                    "steps: step 10 is not one of them")
        if resumed == 0:
            return "the job saved snapshots before the kill: a restart resumes, it does not start over"
        if resumed % every == 0 and resumed < last:
            return "that snapshot was overwritten by a later one, still written before the kill"
        return "the job resumes from its last snapshot: which steps did it write one after?"
    if repeated != killed_after - last:
        if repeated == 0:
            return ("the steps done after the last snapshot died with the process: the restarted job "
                    "computes them again")
        return "the repeated steps are those finished after the last snapshot, up to the kill"
    return None


EXERCISES = load_bank(__name__)
