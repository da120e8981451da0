"""Judges of the exercises of notebook 08 (fault tolerance and several nodes);
their content is in nb08.toml."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from .core import load_bank

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
        renames, syncs = [], []
        real_replace, real_rename, real_fsync = os.replace, os.rename, os.fsync

        def replace(src, dst, *args, **kwargs):
            renames.append((Path(src), Path(dst)))
            return real_replace(src, dst, *args, **kwargs)

        def rename(src, dst, *args, **kwargs):
            renames.append((Path(src), Path(dst)))
            return real_rename(src, dst, *args, **kwargs)

        def fsync(fd):
            syncs.append(fd)
            return real_fsync(fd)

        with mock.patch.object(os, "replace", replace), mock.patch.object(os, "rename", rename), \
                mock.patch.object(os, "fsync", fsync):
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
        if not renames:
            return ("the new snapshot must take the old one's place in one atomic step: a rename "
                    "(os.replace), not a copy")
        if any(src.parent != target.parent for src, _ in renames):
            return ("the temporary file is in another folder, perhaps on another file system, where "
                    "a rename is no longer atomic (it becomes a copy): write it beside the target")
        if not syncs:
            return ("flush the temporary file and force it to disk (os.fsync) before the rename: "
                    "after a crash the rename could otherwise be on disk before the data")
    return None


def _judge_strip(answer: Any) -> str | None:
    values = [torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)]
    inner = ["encoder.weight", "encoder.submodule.weight", "decoder.bias"]
    wrapped = {f"module.{k}": v for k, v in zip(inner, values, strict=True)}
    got = answer(dict(wrapped))
    if not isinstance(got, dict):
        return f"return a dict (a state dict), not {type(got).__name__}"
    keys = list(got)
    if keys == [k.replace("module.", "") for k in wrapped]:
        return ("'module.' was removed wherever it appears, also inside a key: "
                "'encoder.submodule.weight' lost part of its name. Remove it only at the start")
    if keys == [k.lstrip("module.") for k in wrapped]:
        return ("str.lstrip('module.') removes any of the characters m, o, d, u, l, e and '.' from the "
                "left, not the prefix: 'decoder.bias' lost its first letters")
    if sorted(keys) == sorted(inner) and keys != inner:
        return "keep the keys in their order: load_state_dict does not mind, but printed and saved dicts do"
    if keys != inner:
        return f"the keys of a wrapped state dict should lose their leading 'module.', got {keys}"
    if any(got[k] is not v for k, v in zip(inner, values, strict=True)):
        return "keep the same tensors as values; only the keys change"
    plain = dict(zip(inner, values, strict=True))
    got_plain = answer(dict(plain))
    if not isinstance(got_plain, dict) or list(got_plain) != inner:
        return ("a state dict saved from a plain model has no prefix and must come back unchanged: "
                f"its keys became {list(got_plain) if isinstance(got_plain, dict) else got_plain!r}")
    return None


def _judge_restart(answer: Any) -> str | None:
    if not (isinstance(answer, tuple) and len(answer) == 2):
        return "write a pair: (the step of the snapshot the job resumes from, steps computed twice)"
    resumed, repeated = answer
    if any(isinstance(v, bool) or not isinstance(v, int) for v in answer):
        return "write both as whole numbers of steps"
    every, killed_after = 3, 10
    last = killed_after // every * every
    if resumed != last:
        if resumed == killed_after:
            return ("the job resumes from its last snapshot, and snapshots are written every 3 "
                    "steps: step 10 is not one of them")
        if resumed % every == 0 and resumed < last:
            return "that snapshot was overwritten by a later one, still written before the kill"
        return "the job resumes from its last snapshot: snapshots are written after every 3rd step"
    if repeated != killed_after - last:
        if repeated == 0:
            return ("the steps done after the last snapshot died with the process: the restarted job "
                    "computes them again")
        return "the repeated steps are those finished after the last snapshot, up to the kill"
    return None


EXERCISES = load_bank(__name__)
