"""Run a broken rank program without hanging the notebook, and say where each rank got stuck
(notebook 12).

:func:`run_broken` runs a program that hangs under ``distributed.launch`` with a small timeout, on
gloo on every machine (:data:`ZOO_BACKEND`), and keeps each rank's Flight Recorder dump
(:mod:`course_utils.debugging.flight_recorder`); :func:`where_stuck` turns the stacks of the stuck ranks into
one line per rank that reads the same on every machine. The broken programs themselves, and their
fixes, are in :mod:`course_utils.debugging.failure_zoo`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ..distributed import LaunchTimeout, launch
from ..launcher.forkserver import fresh_starts
from .flight_recorder import read_flight_records, recording_flight

__all__ = ["HANG_FRESH_S", "HANG_S", "HANG_TRIES", "ZOO_BACKEND", "Hang", "hang_limit", "run_broken",
           "where_stuck"]

#: The backend of every broken program, on every machine. gloo's collectives block the calling
#: thread until they complete, so a stuck rank waits at the collective that does not match, where
#: its stack points. NCCL's return at once (the GPU runs them later): the same bug would surface
#: at the next point that waits for the GPU, and a launch could even see the ranks "finish".
ZOO_BACKEND = "gloo"
#: How long a broken program runs before it counts as stuck: forked ranks start in hundredths of a
#: second; fresh interpreters (where a GPU is visible) first import torch. Measured with fresh
#: interpreters on Colab's torch (a CUDA build, 2.11) on 2 busy cores: the slowest right answer
#: of notebook 12's exercises took 4.7 s a launch; three times that is the allowance, so that a
#: slower machine (Colab's 2 vCPUs) never reads a right program as stuck.
HANG_S, HANG_FRESH_S = 2.0, 15.0
#: Slow is not stuck: a run stopped before its stuck ranks had been in the program long enough
#: (still importing torch on a busy machine, or their Flight Recorder still watching) showed a slow
#: start, not the hang; it is run again with twice the limit, up to this many runs in all.
HANG_TRIES = 3

_FRAME = re.compile(r'^\s*File "(.*)", line \d+, in (\S+)$')
#: frames that are plumbing, not the program: torch's logging decorators, the Flight Recorder's
_PLUMBING = ("wrapper", "_fn", "_with_flight_recorder")


def where_stuck(stacks: dict[int, list[str]], last: int = 3) -> dict[int, str]:
    """One line per stuck rank: the last ``last`` functions it was in, and the line of its own code
    that it was waiting on.

    ``stacks`` is ``LaunchTimeout.stacks``. Paths and line numbers are left out (and torch's
    logging decorators), so the line reads the same on every machine:
    ``eval_on_rank_0_only -> evaluate_everywhere -> all_reduce  at: dist.all_reduce(counts)``.
    """
    if not isinstance(stacks, dict):
        raise TypeError(f"stacks must be a dict of rank -> stack lines (LaunchTimeout.stacks), "
                        f"got {type(stacks).__name__}")
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"last must be an int >= 1, got {last!r}")
    summary = {}
    for rank, lines in sorted(stacks.items()):
        names, mine = [], ""
        for i, line in enumerate(lines):
            match = _FRAME.match(line)
            if not match or match.group(2) in _PLUMBING:
                continue
            names.append(match.group(2))
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if f"{os.sep}torch{os.sep}" not in match.group(1) and not _FRAME.match(following):
                mine = following.strip()  # the source line of the newest frame outside torch
        text = " -> ".join(names[-last:]) or "(no Python frame)"
        summary[rank] = f"{text}  at: {mine}" if mine else text
    return summary


def hang_limit() -> float:
    """The seconds a broken program gets here: :data:`HANG_S`, or :data:`HANG_FRESH_S` where ranks
    start as fresh interpreters, each importing torch first (off Linux, or with
    ``COURSE_START=subprocess``)."""
    return HANG_FRESH_S if fresh_starts() else HANG_S


@dataclasses.dataclass
class Hang:
    """What :func:`run_broken` saw: each stuck rank's stack, and every rank's Flight Recorder dump."""

    stacks: dict[int, list[str]]
    flight_records: dict[int, dict]


def run_broken(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> Hang | None:
    """Run a program that hangs, on gloo on every machine; print which ranks were stuck, and where.

    Each rank keeps its Flight Recorder dump meanwhile (:func:`recording_flight`); they come back
    in the :class:`Hang`, with the stacks. A run stopped before every stuck rank had been in ``fn``
    long enough (a slow start, not the hang) is made again with twice the limit, up to
    :data:`HANG_TRIES` runs.
    """
    if not fresh_starts():  # the first launch of a process starts the fork server, which
        # imports torch (seconds): not part of the program's allowance, so it happens before
        launch(_started, world_size, backend=ZOO_BACKEND, init="none", timeout_s=120, echo=False)
    limit = hang_limit()
    stopped = _stopped_after(limit, fn, args, world_size)
    for _ in range(HANG_TRIES - 1):  # slow is not stuck: stopped before the hang showed
        if stopped is None or _inside(fn, stopped[1].stacks):
            break
        limit *= 2
        stopped = _stopped_after(limit, fn, args, world_size)
    if stopped is None:
        print("it finished: no hang")
        return None
    message, hang = stopped
    print("LaunchTimeout:", message)
    for rank, where in where_stuck(hang.stacks).items():
        print(f"  rank {rank} was in {where}")
    return hang


def _stopped_after(limit: float, fn: Callable[..., Any], args: tuple,
                   world_size: int) -> tuple[str, Hang] | None:
    """One run of ``fn``, stopped after ``limit`` s: the timeout's first sentence and the
    :class:`Hang`; None if it finished."""
    with tempfile.TemporaryDirectory(prefix="course-flight-") as folder:
        until = time.time() + limit  # dumps show the ranks as they hung, not as stopped
        try:
            launch(recording_flight(fn, folder, until), world_size, *args, backend=ZOO_BACKEND,
                   timeout_s=limit, echo=False)
        except LaunchTimeout as err:
            return (str(err).split(". All ranks")[0],
                    Hang(_without_recorder(err.stacks), read_flight_records(folder)))
    return None


def _started(rank: int, world_size: int) -> int:
    return rank


def _inside(fn: Callable[..., Any], stacks: dict[int, list[str]]) -> bool:
    """Whether the run went on long enough to show the hang: every stuck rank has a stack, had
    entered ``fn`` (where ``fn`` has a name to look for), and its Flight Recorder had stopped
    watching (``FLIGHT_LATEST_S`` after ``fn`` began: its thread would show in the stack)."""
    name = getattr(fn, "__name__", None)
    functions = [{m.group(2) for line in lines if (m := _FRAME.match(line))} for lines in stacks.values()]
    return all(found and (name is None or name in found) and "_dump_when_stuck" not in found
               for found in functions)


def _without_recorder(stacks: dict[int, list[str]]) -> dict[int, list[str]]:
    """The stacks without the recorder's frame (and its source line), which only calls ``fn``."""
    cleaned = {}
    for rank, lines in stacks.items():
        keep, skipping = [], False
        for line in lines:
            match = _FRAME.match(line)
            if match:
                skipping = match.group(2) == "_with_flight_recorder"
            if not skipping:
                keep.append(line)
        cleaned[rank] = keep
    return cleaned
