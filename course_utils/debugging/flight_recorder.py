"""Flight Recorder dumps of a hung job, read side by side (notebook 12).

:func:`recording_flight` makes a rank function leave its rank's dump of its last collectives;
:func:`flight_table` shows each rank's last collectives side by side, :func:`first_disagreement`
names the first one the ranks disagree on, and :func:`analyze_flight_records` asks torch's own
analyzer. :func:`course_utils.debugging.hangs.run_broken` records every broken program this way.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..compat import analyzer_reads_gloo, dump_flight_recorder

__all__ = ["analyze_flight_records", "example_flight_records", "first_disagreement", "first_mismatch_of",
           "flight_table", "read_flight_records", "recording_flight"]

#: how often a rank's recorder looks at its collectives; how long one must stay unfinished before
#: the rank counts as stuck and dumps; and the latest it dumps anyway (well before a launch's
#: HANG_S, so that the dumping thread is gone when launch asks for the ranks' stacks)
FLIGHT_POLL_S, FLIGHT_STUCK_S, FLIGHT_LATEST_S = 0.05, 0.25, 1.2


def recording_flight(fn: Callable[..., Any], folder: str, until: float) -> Callable[..., Any]:
    """``fn`` as a rank function that leaves its rank's Flight Recorder dump in ``folder``.

    A rank stuck in a collective cannot dump from its main thread, which waits in C++; a thread
    of its own can. It watches the rank's collectives and, whenever one has stayed unfinished for
    ``FLIGHT_STUCK_S``, writes the dump to ``folder/rank{R}``; it ends after ``FLIGHT_LATEST_S``
    (before launch asks for the stacks). A rank that finishes writes its dump as it returns. No
    dump is written after ``until`` (a ``time.time()``): when a launch stops stuck ranks, a
    survivor's collective fails, its program may go on and return, and a dump then would show
    the stop, not the hang.
    """
    return functools.partial(_with_flight_recorder, fn, str(folder), until)


def _with_flight_recorder(fn: Callable[..., Any], folder: str, until: float, rank: int,
                          world_size: int, *args: Any) -> Any:
    done = threading.Event()
    watcher = threading.Thread(target=_dump_when_stuck, args=(folder, rank, until, done),
                               name="flight-recorder", daemon=True)
    watcher.start()
    try:
        return fn(rank, world_size, *args)
    finally:
        done.set()
        watcher.join()
        _save_flight_record(folder, rank, until)


def _dump_when_stuck(folder: str, rank: int, until: float, done: threading.Event) -> None:
    """Dump each time the rank's collectives settle in a stuck state (one unfinished, nothing
    changing for ``FLIGHT_STUCK_S``), so that a peer that arrives late updates the dump; stop at
    ``FLIGHT_LATEST_S``, with a dump of the state then if it was not dumped yet."""
    start = time.monotonic()
    seen, since, dumped = None, start, None
    while not done.wait(FLIGHT_POLL_S):
        status = (dump_flight_recorder(collectives=False, stacks=False) or {}).get("pg_status", {})
        now = time.monotonic()
        if status != seen:
            seen, since = status, now
        unfinished = any(s["last_enqueued_collective"] > s["last_completed_collective"]
                         for s in status.values())
        last_call = now - start >= FLIGHT_LATEST_S
        if status != dumped and ((unfinished and now - since >= FLIGHT_STUCK_S) or last_call):
            _save_flight_record(folder, rank, until)
            dumped = status
        if last_call:
            return


def _save_flight_record(folder: str, rank: int, until: float) -> None:
    record = dump_flight_recorder()
    if record is None or time.time() > until:
        return
    # gloo leaves the dump's table of groups empty (the group's name is set after its backend is
    # made): fill it from this rank's groups, so that torch's analyzer can match the ranks' entries
    record["pg_config"] = {
        name: {"name": name, "desc": group.group_desc, "ranks": str(dist.get_process_group_ranks(group))}
        for group, name in dist.distributed_c10d._world.pg_names.items()}
    path = Path(folder) / f"rank{rank}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(record))
    os.replace(tmp, path)


def read_flight_records(folder: str) -> dict[int, dict]:
    """The Flight Recorder dumps that :func:`recording_flight` left in ``folder``, by rank."""
    return {int(path.name[len("rank"):]): pickle.loads(path.read_bytes())
            for path in sorted(Path(folder).glob("rank[0-9]*")) if path.suffix != ".tmp"}


def _by_collective(records: dict[int, dict]) -> dict[tuple[str, int], dict[int, dict]]:
    """Every rank's entries keyed by (group, collective sequence number), in the order seen."""
    table: dict[tuple[str, int], dict[int, dict]] = {}
    for rank, record in sorted(records.items()):
        for entry in record.get("entries", []):
            key = (entry["process_group"][0], entry["collective_seq_id"])
            table.setdefault(key, {})[rank] = entry
    return table


def _describe(entry: dict | None) -> str:
    if entry is None:
        return "(nothing)"
    done = "done" if entry["retired"] else "NOT DONE"
    return f"{entry['profiling_name']} {entry['input_sizes']} {done}"


def flight_table(records: dict[int, dict], last: int = 4) -> list[str]:
    """Each rank's last ``last`` collectives side by side: one line per (group, sequence number),
    saying what each rank ran there, with which sizes, and whether it finished."""
    if not records:
        return ["(no Flight Recorder dump: this torch cannot take one)"]
    if not any(record.get("entries") for record in records.values()):
        return ["(no collectives recorded: this torch's Flight Recorder does not record gloo's)"]
    ranks = sorted(records)
    cells = [[f"group {group}, #{seq}"] + [_describe(entries.get(r)) for r in ranks]
             for (group, seq), entries in list(_by_collective(records).items())[-last:]]
    header = [""] + [f"rank {r}" for r in ranks]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    return ["  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()
            for row in [header, *cells]]


def _disagreement(records: dict[int, dict]) -> tuple[tuple[str, int], dict[int, str]] | None:
    """The first (group, sequence number) whose entries differ between the ranks, with what each
    rank ran there (operation and sizes; ``None`` where a rank has no entry)."""
    for key, entries in _by_collective(records).items():
        seen = {r: repr((e["profiling_name"], e["input_sizes"])) if (e := entries.get(r)) else None
                for r in sorted(records)}
        if len(set(seen.values())) > 1:
            return key, seen
    return None


def first_disagreement(records: dict[int, dict]) -> str | None:
    """The first collective that the ranks' dumps disagree on (what they ran, or with which sizes),
    or where a rank has no entry; ``None`` when every rank ran the same collectives."""
    found = _disagreement(records)
    if found is None:
        return None
    (group, seq), seen = found
    entries = _by_collective(records)[group, seq]
    return f"group {group}, collective #{seq}: " + "; ".join(
        f"rank {r} ran {_describe(entries.get(r))}" for r in seen)


def first_mismatch_of(records: dict[int, dict]) -> tuple[int, int] | None:
    """Where the dumps first disagree, as (the collective's number in its group, the rank whose
    entry there differs from every other rank's): the answer exercise 12.12 asks for."""
    found = _disagreement(records)
    if found is None:
        return None
    (_, seq), seen = found
    values = list(seen.values())
    return seq, next(r for r, v in seen.items() if values.count(v) == 1)


def example_flight_records() -> dict[int, dict]:
    """The Flight Recorder entries of a 3-rank NCCL job that hung, in the format of the dumps above
    (only the fields :func:`flight_table` reads): exercise 12.12 asks where they first disagree.

    After two matched gradient all-reduces, ranks 0 and 2 all-reduce the loss for the log (one
    value); rank 1 skipped that and all-reduces the next step's gradient. Under NCCL no rank stops
    there: each queues its next collective, and nothing completes from then on."""
    grads, loss = [[1024]], [[1]]
    runs = {0: [grads, grads, loss, grads], 1: [grads, grads, grads, loss], 2: [grads, grads, loss, grads]}
    return {rank: {"entries": [{"process_group": ("0", "default_pg"), "collective_seq_id": seq,
                                "profiling_name": "nccl:all_reduce", "input_sizes": sizes,
                                "retired": seq <= 2}
                               for seq, sizes in enumerate(sizes_run, start=1)]}
            for rank, sizes_run in runs.items()}


def analyze_flight_records(records: dict[int, dict]) -> list[str]:
    """What torch's Flight Recorder analyzer (``python -m torch.distributed.flight_recorder.fr_trace
    FOLDER``) finds in the ranks' dumps: one line per collective it reports, without its log."""
    if not analyzer_reads_gloo() and any(e["profiling_name"].startswith("gloo:")
                                         for record in records.values() for e in record["entries"]):
        return [f"(torch {torch.__version__.split('+')[0]}'s analyzer reads NCCL's dumps, not "
                "gloo's; torch 2.13's reads both)"]
    with tempfile.TemporaryDirectory(prefix="course-flight-") as folder, _quiet_analyzer():
        from torch.distributed.flight_recorder.components.builder import build_db
        from torch.distributed.flight_recorder.components.config_manager import JobConfig
        from torch.distributed.flight_recorder.components.loader import read_dump

        details = {}
        for rank, record in sorted(records.items()):  # in rank order: the analyzer compares the
            path = Path(folder) / f"rank{rank}"       # other ranks with the first it reads
            path.write_bytes(pickle.dumps(record))
            details[path.name] = read_dump("rank", str(path))
        args = JobConfig().parse_args([folder, "--prefix", "rank"])
        database = build_db(details, args, str(records[min(records)]["version"]))
    lines = []
    for collective in database.collectives:
        if collective.pass_check:
            continue
        head = (f"collective #{collective.collective_seq_id} of group {collective.pg_desc} "
                f"({collective.collective_name} on ranks {sorted(collective.expected_ranks)})")
        for rank, wrong in sorted((collective.mismatch_collectives or {}).items()):
            lines.append(f"{head}: culprit rank {rank}, {wrong.type_of_mismatch}")
        if collective.missing_ranks:
            lines.append(f"{head}: missing ranks {sorted(collective.missing_ranks)}")
    return lines


@contextlib.contextmanager
def _quiet_analyzer() -> Iterator[None]:
    """The analyzer logs its report (with local paths) to stderr, warns at import when
    ``tabulate`` is missing, and turns the garbage collector off as it reads: silence the first
    two, undo the third."""
    logger = logging.getLogger("Flight Recorder")
    was_disabled, gc_enabled = logger.disabled, gc.isenabled()
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was_disabled
        if gc_enabled:
            gc.enable()
