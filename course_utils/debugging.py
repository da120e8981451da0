"""A zoo of real distributed-training failures, each a small rank function (notebook 10).

Every function here runs under ``distributed.launch(fn, world_size, ..., timeout_s=small)``: the
broken ones hang or raise on purpose, and ``launch`` stops a hang at its timeout and reports where
each stuck rank waited (``LaunchTimeout.stacks``). :func:`run_broken` runs a broken program that
way, on gloo on every machine (:data:`ZOO_BACKEND`), and keeps each rank's Flight Recorder dump;
:func:`where_stuck` turns the stacks into one line per rank that reads the same on every machine.
The fixed versions sit next to the broken ones. :func:`flight_table`, :func:`first_disagreement`
and :func:`analyze_flight_records` read the dumps (each rank's last collectives side by side, and
torch's own analyzer). Training-loop failures (accumulation, uneven inputs, unused parameters,
seeds, compression hooks, checkpoints) are in :mod:`course_utils.debug_training`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import pickle
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data.distributed import DistributedSampler

from .compat import analyzer_reads_gloo, dump_flight_recorder
from .devices import rank_device
from .distributed import LaunchTimeout, launch
from .launcher.forkserver import cuda_visible

__all__ = [
    "HANG_FRESH_S",
    "HANG_S",
    "ZOO_BACKEND",
    "Hang",
    "analyze_flight_records",
    "collectives_in_order",
    "collectives_out_of_order",
    "eval_on_rank_0_only",
    "evaluate_everywhere",
    "evaluation_set",
    "exact_accuracy",
    "example_flight_records",
    "first_disagreement",
    "first_mismatch_of",
    "flight_table",
    "hang_limit",
    "out_of_order_as_on_nccl",
    "padded_accuracy",
    "sampler_orders",
    "read_flight_records",
    "recording_flight",
    "rendezvous_at",
    "run_broken",
    "save_then_load",
    "where_stuck",
]

#: The backend of every broken program, on every machine. gloo's collectives block the calling
#: thread until they complete, so a stuck rank waits at the collective that does not match, where
#: its stack points. NCCL's return at once (the GPU runs them later): the same bug would surface
#: at the next point that waits for the GPU, and a launch could even see the ranks "finish".
ZOO_BACKEND = "gloo"
#: How long a broken program runs before it counts as stuck: forked ranks start in hundredths of a
#: second; fresh interpreters (where a GPU is visible) first import torch. Measured with fresh
#: interpreters on Colab's torch (a CUDA build, 2.11) on 2 busy cores: the slowest right answer
#: of notebook 10's exercises took 4.7 s a launch; three times that is the allowance, so that a
#: slower machine (Colab's 2 vCPUs) never reads a right program as stuck.
HANG_S, HANG_FRESH_S = 2.0, 15.0

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
    """The seconds a broken program gets here: :data:`HANG_S`, or :data:`HANG_FRESH_S` where a GPU
    is visible (ranks are then fresh interpreters)."""
    return HANG_FRESH_S if cuda_visible() else HANG_S


@dataclasses.dataclass
class Hang:
    """What :func:`run_broken` saw: each stuck rank's stack, and every rank's Flight Recorder dump."""

    stacks: dict[int, list[str]]
    flight_records: dict[int, dict]


def run_broken(fn: Callable[..., Any], *args: Any, world_size: int = 2) -> Hang | None:
    """Run a program that hangs, on gloo on every machine; print which ranks were stuck, and where.

    Each rank keeps its Flight Recorder dump meanwhile (:func:`recording_flight`); they come back
    in the :class:`Hang`, with the stacks.
    """
    with tempfile.TemporaryDirectory(prefix="course-flight-") as folder:
        until = time.time() + hang_limit()  # dumps show the ranks as they hung, not as stopped
        try:
            launch(recording_flight(fn, folder, until), world_size, *args, backend=ZOO_BACKEND,
                   timeout_s=hang_limit(), echo=False)
        except LaunchTimeout as err:
            print("LaunchTimeout:", str(err).split(". All ranks")[0])
            for rank, where in where_stuck(err.stacks).items():
                print(f"  rank {rank} was in {where}")
            return Hang(_without_recorder(err.stacks), read_flight_records(folder))
    print("it finished: no hang")
    return None


# ----------------------------------------------------------------------------- Flight Recorder

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
    entry there differs from every other rank's): the answer exercise 10.12 asks for."""
    found = _disagreement(records)
    if found is None:
        return None
    (_, seq), seen = found
    values = list(seen.values())
    return seq, next(r for r, v in seen.items() if values.count(v) == 1)


def example_flight_records() -> dict[int, dict]:
    """The Flight Recorder entries of a 3-rank NCCL job that hung, in the format of the dumps above
    (only the fields :func:`flight_table` reads): exercise 10.12 asks where they first disagree.

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


# ----------------------------------------------------------------------------- set_epoch

def sampler_orders(rank: int, world_size: int, size: int, epochs: int, set_epoch: bool) -> list[list[int]]:
    """The indices this rank reads in each epoch from a shuffling ``DistributedSampler``."""
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # the fix: a new shuffle every epoch
        orders.append(list(sampler))
    return orders


# ----------------------------------------------------------------------------- evaluation

def evaluation_set(size: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed validation set of ``size`` rows and labels, with a fixed model's predictions
    right on the first rows and on every third row after them (so padding shows)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    torch.manual_seed(0)
    x = torch.randn(size, 4)
    model = _classifier()
    with torch.no_grad():  # the model's own predictions, computed without calling it on the CPU
        labels = (x @ model.weight.T + model.bias).argmax(1)
    wrong = [i for i in range(size) if i >= 3 and i % 3 != 0]
    labels[wrong] = 1 - labels[wrong]
    return x, labels


def _classifier() -> nn.Module:
    torch.manual_seed(1)
    return nn.Linear(4, 2)


def _correct_on(indices: list[int], size: int, device: torch.device) -> torch.Tensor:
    x, y = evaluation_set(size)
    model = _classifier().to(device)
    with torch.no_grad():
        return (model(x[indices].to(device)).argmax(1) == y[indices].to(device)).float()


def eval_on_rank_0_only(rank: int, world_size: int, size: int = 10) -> float | None:
    """The hang: only rank 0 evaluates, and evaluation all-reduces its counts."""
    if rank == 0:
        return evaluate_everywhere(rank, world_size, size)  # rank 0 waits here for the others
    return None  # the other ranks went on (to the next epoch, a barrier, the end)


def evaluate_everywhere(rank: int, world_size: int, size: int = 10) -> float:
    """The right pattern: every rank evaluates its shard, and the counts are all-reduced."""
    device = rank_device()
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=False)
    correct = _correct_on(list(sampler), size, device)
    counts = torch.tensor([correct.sum().item(), float(len(correct))], device=device)
    dist.all_reduce(counts)  # every rank must get here
    return (counts[0] / counts[1]).item()


def padded_accuracy(rank: int, world_size: int, size: int) -> dict[str, Any]:
    """Accuracy over a padded ``DistributedSampler``: the first rows count twice."""
    accuracy = evaluate_everywhere(rank, world_size, size)
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=False)
    return {"indices": list(sampler), "accuracy": accuracy}


def exact_accuracy(rank: int, world_size: int, size: int) -> dict[str, Any]:
    """Exact distributed accuracy: all-gather (index, correct) pairs, drop the padded duplicates."""
    device = rank_device()
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=False)
    indices = list(sampler)
    correct = _correct_on(indices, size, device)
    mine = torch.stack([torch.tensor(indices, dtype=torch.float, device=device), correct], 1)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]  # same length on every rank
    dist.all_gather(gathered, mine)
    seen: dict[int, float] = {}
    for index, ok in torch.cat(gathered).tolist():
        seen.setdefault(int(index), ok)  # a padded duplicate repeats an index already seen
    return {"counted": len(seen), "accuracy": sum(seen.values()) / len(seen)}


# ----------------------------------------------------------------------------- collective order

def collectives_out_of_order(rank: int, world_size: int, detail: bool = False) -> str:
    """The hang: rank 0 all-reduces then broadcasts; the others broadcast then all-reduce.

    With ``detail`` the collectives run on a group made under debug level DETAIL (what
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for every group): the ranks compare each collective's
    fingerprint first and raise on a mismatch instead of waiting forever.
    """
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    group = dist.new_group(list(range(world_size)))
    device = rank_device()
    grads, flag = torch.ones(4, device=device), torch.zeros(1, device=device)
    try:
        dist.all_reduce(torch.zeros(1, device=device), group=group)  # a step the ranks agree on
        if rank == 0:
            dist.all_reduce(grads, group=group)
            dist.broadcast(flag, 0, group=group)
        else:
            dist.broadcast(flag, 0, group=group)
            dist.all_reduce(grads, group=group)
    except RuntimeError as err:
        ops = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                         r"SequenceNumber=\d+, OpType=(\w+)", str(err))
        return "; ".join(f"rank {r} runs {op}" for r, op in sorted(set(ops)))
    return "no error"


def out_of_order_as_on_nccl(rank: int, world_size: int) -> str:
    """The same bug as NCCL runs it, imitated on gloo: each collective only *starts* (NCCL queues
    it on the GPU and returns), the program goes on, and it waits where it needs a result on the
    CPU, as ``loss.item()`` or ``tensor.cpu()`` wait for the GPU. The hang surfaces there."""
    device = rank_device()
    grads, flag = torch.ones(4, device=device), torch.zeros(1, device=device)
    if rank == 0:
        started = [dist.all_reduce(grads, async_op=True), dist.broadcast(flag, 0, async_op=True)]
    else:
        started = [dist.broadcast(flag, 0, async_op=True), dist.all_reduce(grads, async_op=True)]
    loss = (grads * 2).sum()  # the program goes on computing
    for work in started:
        work.wait()  # what loss.item() does under NCCL: wait for the GPU's queued work
    return f"loss {loss.item()}"


def collectives_in_order(rank: int, world_size: int) -> list[float]:
    """The fix: every rank makes the same collective calls in the same order."""
    device = rank_device()
    grads, flag = torch.ones(4, device=device), torch.full((1,), float(rank), device=device)
    dist.all_reduce(grads)
    dist.broadcast(flag, 0)
    return [grads[0].item(), flag.item()]


# ----------------------------------------------------------------------------- saving

def save_then_load(rank: int, world_size: int, path: str, barrier: bool) -> list[float]:
    """Rank 0 saves a checkpoint (slowly, as a big one is); every rank then loads it.

    Without ``barrier`` the other ranks read before rank 0 has written: ``FileNotFoundError``
    (or, worse, last run's file). ``map_location`` puts the tensors on this rank's device, not
    on the GPU they were saved from.
    """
    device = rank_device()
    torch.manual_seed(0)
    model = nn.Linear(2, 1).to(device)
    if rank == 0:
        time.sleep(0.5)  # writing a large checkpoint takes a while
        torch.save(model.state_dict(), path)
    if barrier:
        dist.barrier()  # nobody reads before rank 0 has written
    state = torch.load(path, map_location=device)
    return state["weight"].flatten().tolist()


# ----------------------------------------------------------------------------- ports

def rendezvous_at(rank: int, world_size: int, port: int) -> int:
    """Make a process group at ``tcp://127.0.0.1:PORT``, as the Korean article's scripts do
    (for ``launch(..., init=False)``). Rank 0 hosts the store there: a port still held by an
    interrupted cell's store makes it fail with ``EADDRINUSE``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    return rank
