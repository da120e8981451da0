"""Judges of the exercises of notebook 09 (fault tolerance and several nodes);
their content is in nb09.toml."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from .answers import whole
from .core import load_bank, untimed

__all__ = ["CASES", "EXERCISES"]

#: 09.1's targets, inside a fresh folder
_TARGETS = ["snapshot.pt", "runs/job 1/last.pt"]
#: 09.2's jobs are 15 steps of 6 batches per epoch; the snapshot is taken after these steps
_RESUME_AFTER = [8, 3, 12]
#: 09.3's job writes a snapshot every 3 steps; it is killed after these steps, one run each (a rule
#: such as "resume one step back" agrees with the right one after step 10, not after 11 or 9)
_EVERY, _KILLS = 3, (11, 9)

CASES: dict[str, list[str]] = {
    "09.1": [f"two saves, then one that dies half-way, to {name!r} in a fresh folder" for name in _TARGETS],
    "09.2": [f"a snapshot after step {k} of 15 (epoch {k // 6}, batch {k % 6}), resumed in a fresh process"
             for k in _RESUME_AFTER],
    "09.3": [f"a snapshot every {_EVERY} steps, killed after step {k}" for k in _KILLS],
}


class _DiesHalfWay:
    """Stands in for the moment a writer is killed: pickling it notes what a restart would find
    under the target's name at that moment (what a handler run later cannot change), then raises."""

    def __init__(self, target: Path, found: list) -> None:
        self.target, self.found = target, found

    def __reduce__(self):
        self.found.append(_step_in(self.target))
        raise RuntimeError("the writer died half-way through the save (simulated)")


#: the events of the save being watched, in order, while a check of 09.1 runs (else None):
#: ("sync", inode or None where the file is not known) and ("rename", inode, src, dst)
_EVENTS: list | None = None
_AUDITING = False


def _audit(event: str, args: tuple) -> None:
    """Every rename that runs (os.rename, os.replace, Path.replace, shutil.move), however it is named."""
    if _EVENTS is None or event != "os.rename":
        return
    try:
        src, dst = (Path(os.fsdecode(os.fspath(a))) for a in args[:2])
        _EVENTS.append(("rename", os.stat(src).st_ino, Path(os.path.realpath(src)), dst))
    except (OSError, TypeError, ValueError):
        pass


def _watch_syncs(wrapper_code: Any) -> Any:
    """A profile function noting every fsync that runs other than through ``os.fsync`` as the
    check wraps it (a name imported before the check): a sync whose file the check cannot tell."""
    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and _EVENTS is not None and frame.f_code is not wrapper_code \
                and getattr(arg, "__name__", "") in ("fsync", "fdatasync"):
            _EVENTS.append(("sync", None))
    return profile


def _step_in(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True).get("step")
    except Exception:  # noqa: BLE001 - an unreadable file is what the judge looks for
        return None


def _judge_save_atomically(answer: Any) -> str | None:
    global _AUDITING
    if not _AUDITING:  # an audit hook cannot be removed: one, idle outside this check, per session
        sys.addaudithook(_audit)
        _AUDITING = True
    for name in _TARGETS:
        # the answer runs in a scratch working folder of its own, so that what it writes under a
        # relative name is cleaned up too (and is not beside the target)
        with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as scratch, \
                contextlib.chdir(scratch):
            target = Path(folder) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            hint = _atomic_saves(answer, target)
        if hint:
            return hint
    return None


def _atomic_saves(answer: Any, target: Path) -> str | None:
    global _EVENTS
    answer({"step": 1}, str(target))
    if _step_in(target) != 1:
        return "after save_atomically(state, path), torch.load(path) should give the state back"
    events: list[tuple] = []
    real_fsync = os.fsync

    def fsync(fd):
        events.append(("sync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    found: list = []  # what the target held at the moment the third save died
    previous = sys.getprofile()
    _EVENTS = events
    sys.setprofile(_watch_syncs(fsync.__code__))
    try:
        with mock.patch.object(os, "fsync", fsync):
            answer({"step": 2}, str(target))
            if _step_in(target) != 2:
                return "a second save should replace the first: torch.load(path) gave the old state back"
            try:
                answer({"step": 3, "payload": _DiesHalfWay(target, found)}, str(target))
            except Exception:  # noqa: BLE001, S110 - the simulated death is expected
                pass
    finally:
        sys.setprofile(previous)
        _EVENTS = None
    if _step_in(target) != 2 or found[:1] != [2]:
        return ("a save that died half-way destroyed the last good snapshot: at the moment it was killed, "
                "the file under that name was already cut short or gone. Write the new snapshot under "
                "another name, then put it in place in one step")
    renames = [e for e in events if e[0] == "rename"]
    if not renames:
        return ("the new snapshot must take the old one's place in one atomic step: a rename "
                "(os.replace), not a copy")
    if any(src.parent != Path(os.path.realpath(target.parent)) for _, _, src, _ in renames):
        return ("the temporary file is in another folder, perhaps on another file system, where "
                "a rename is no longer atomic (it becomes a copy): write it beside the target")
    if not any(e[0] == "sync" for e in events):
        return ("force the new file to disk (os.fsync) before the rename: after a crash the rename "
                "could otherwise be on disk before the data")
    first = events.index(renames[0])
    if not any(e in (("sync", renames[0][1]), ("sync", None)) for e in events[:first]):
        return ("the new snapshot reached the disk only after the rename (or another file did): after "
                "a crash the name could point at a file whose data never arrived; force it first")
    return None


_BATCH, _SAMPLES, _STEPS = 4, 24, 15  # 6 batches per epoch, 15 steps in all


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
    for resume_at in _RESUME_AFTER:
        hint = _resumed(answer, resume_at)
        if hint:
            return hint
    return None


def _resumed(answer: Any, resume_at: int) -> str | None:
    with torch.random.fork_rng():  # the notebook's own random numbers stay as they were
        torch.manual_seed(1234)
        with untimed():  # the course's own job: only the answer's time counts
            model, optimizer = _job()
            epoch, batch = _train(model, optimizer, 0, 0, resume_at)
        snapshot = answer(model, optimizer, epoch, batch)
        if not isinstance(snapshot, dict):
            return f"return a dict (what torch.save writes), not {type(snapshot).__name__}"
        saved = io.BytesIO()
        torch.save(snapshot, saved)  # now, as a job does: later steps must not change it
        # timed: the answer had this model and optimizer in its hands
        _train(model, optimizer, epoch, batch, _STEPS - resume_at)
        uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

        torch.manual_seed(999)  # a fresh process: its own initial weights and random numbers
        with untimed():
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
        if whole(rng) is not None:  # a number, however written (answers.py): a seed
            return ("'rng' holds a seed: that says where the random numbers started, not where they "
                    "stand after the steps already taken")
        if rng is not None:
            torch.set_rng_state(rng)
        if "epoch" not in loaded or "step_in_epoch" not in loaded:
            return "the snapshot needs the position: without it the resumed run starts epoch 0 again"
        position = (whole(loaded["epoch"]), whole(loaded["step_in_epoch"]))  # 0 is a position too
        if position != (epoch, batch):
            return ("the position in the snapshot is not where the job stood when it saved (the check "
                    "saves at several points): store the position the job is at, as it is given")
        with untimed():  # a fresh job, with what weights_only loaded: no code of the answer's
            _train(model, optimizer, *position, _STEPS - resume_at)
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
    shape = ("write two pairs of whole numbers, one per run: ((step of the snapshot it resumes from, "
             "steps computed twice) killed after step 11, (the same) killed after step 9)")
    if not (isinstance(answer, (tuple, list)) and len(answer) == len(_KILLS)):
        return shape
    runs = []
    for run in answer:
        values = [whole(v) for v in run] if isinstance(run, (tuple, list)) else []
        if len(values) != 2 or None in values:
            return shape
        runs.append(values)
    for (resumed, repeated), killed_after in zip(runs, _KILLS, strict=True):
        hint = _restart_hint(resumed, repeated, _EVERY, killed_after)
        if hint:
            return hint if killed_after == _KILLS[0] else f"killed after step {killed_after}: {hint}"
    return None


def _restart_hint(resumed: int, repeated: int, every: int, killed_after: int) -> str | None:
    last = killed_after // every * every
    if resumed != last:
        if resumed == killed_after:
            return (f"the job resumes from its last snapshot, and snapshots are written every {every} "
                    f"steps: step {killed_after} is not one of them")
        if resumed == 0:
            return "the job saved snapshots before the kill: a restart resumes, it does not start over"
        if resumed % every == 0 and resumed < last:
            return "that snapshot was overwritten by a later one, still written before the kill"
        return "the job resumes from its last snapshot: which steps did it write one after?"
    if repeated != killed_after - last:
        if repeated == 0:
            return ("the steps done after the last snapshot died with the process: the restarted job "
                    "computes them again")
        return ("the repeated steps are those finished after the last snapshot, up to the kill: "
                "count them, none when the snapshot came last")
    return None


EXERCISES = load_bank(__name__)
