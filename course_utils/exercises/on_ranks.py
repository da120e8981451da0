"""Checks that run an answer on real ranks, through ``launch`` (notebooks 05, 10 and 12), so that
a wrong answer cannot hang the kernel. Slow is not stuck: inside ``launcher.waiting.watching_stalls``
the ranks count as hung when they used next to no CPU for ``STALL_S`` (each waits for a peer), as
runaways once one used ``CPU_BUDGET_S``; :data:`RANKS_LIMIT_S` of wall time is the last resort.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from typing import Any

from .time_limit import untimed

__all__ = ["RANKS_LIMIT_S", "RUNAWAY_HINT", "TIMEOUT_HINT", "Plan", "collectives_called",
           "collectives_recorded", "reductions_recorded", "run_on_ranks", "run_plan",
           "run_plans", "sent_per_rank"]

#: the wall-clock limit of a check's launch, a last resort (hangs and runaways are caught sooner)
RANKS_LIMIT_S = 90.0
#: the hint when the ranks kept computing without finishing
RUNAWAY_HINT = ("the ranks kept computing and did not finish: look for a loop that never ends, or "
                "far more work than the check needs")
#: the hint when the wall-clock limit came first, before either kind of evidence
TIMEOUT_HINT = ("the ranks did not finish within the check's time limit: look for ranks that wait for "
                "each other, a loop that never ends, or far more work than the check needs")


def run_on_ranks(rank_fn: Callable[..., Any], world_size: int, *args: Any, hang_hint: str,
                 timeout_s: float = RANKS_LIMIT_S) -> tuple[list | None, str | None]:
    """Run an answer (or a judge's rank function) on real ranks for a check.

    Returns ``(results, None)``, or ``(None, hint)`` when the ranks hung (``hang_hint``), ran away
    (:data:`RUNAWAY_HINT`), met the wall-clock limit first (:data:`TIMEOUT_HINT`) or one raised (its
    first line). Checks run on gloo, on the CPU, on any machine: they judge an answer's logic, so
    answer cells need no device code. The one way a judge launches ranks (notebooks 05, 10, 12).
    """
    from ..distributed import LaunchTimeout, RankError, launch
    from ..launcher.waiting import watching_stalls

    try:
        with untimed(), watching_stalls():  # the ranks are judged on evidence, not the check's clock
            return launch(rank_fn, world_size, *args, echo=False, timeout_s=timeout_s, stacks=False,
                          backend="gloo"), None
    except LaunchTimeout as err:
        cause = getattr(err, "cause", "stalled")
        return None, {"stalled": hang_hint, "runaway": RUNAWAY_HINT}.get(cause, TIMEOUT_HINT)
    except RankError as err:
        first = (err.message.strip().splitlines() or [""])[0]
        return None, f"rank {err.rank} raised {err.exc_type}: {first}"


# ------------------------------------------------ many answers of one judge, in few launches

#: a judge's plan: yields launches (rank_fn, world_size, *args), is sent (results, hint), returns its hint
Plan = Generator[tuple, Any, "str | None"]


def run_plan(plan: Plan, hang_hint: str) -> str | None:
    """Judge one answer by its plan, each launch on ranks of its own (what a check does)."""
    outcome = run_plans([plan], hang_hint)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def run_plans(plans: list[Plan], hang_hint: str) -> list[Any]:
    """Judge many answers as :func:`run_plan` judges one, in few launches: what they ask of one rank
    function and world size runs in one launch, answer after answer (:func:`_batch_rank`); an answer
    that raises, hangs or kills a rank is judged again alone. Each entry: the hint, or what was raised."""
    outcomes: list[Any] = [None] * len(plans)
    asked: dict[int, tuple] = {}  # the launch each unfinished plan waits for

    def advance(i: int, sent: Any) -> None:
        try:
            if isinstance(sent, BaseException):
                raise sent
            asked[i] = next(plans[i]) if sent is None else plans[i].send(sent)
        except (StopIteration, Exception) as end:  # noqa: BLE001 - raised where one answer's judge does
            outcomes[i] = end.value if isinstance(end, StopIteration) else end
            asked.pop(i, None)

    for i in range(len(plans)):
        advance(i, None)
    while asked:
        groups: dict[tuple, list[int]] = {}
        for i, request in asked.items():
            groups.setdefault(request[:2], []).append(i)
        for (rank_fn, world_size), members in groups.items():
            got = _launch_many(rank_fn, world_size, [asked[i][2:] for i in members], hang_hint)
            for i, outcome in zip(members, got, strict=True):
                advance(i, outcome)
    return outcomes


def _launch_many(rank_fn: Callable[..., Any], world_size: int, items: list[tuple], hang_hint: str) -> list:
    outcomes: list[Any] = [None] * len(items)
    todo = list(range(len(items)))
    while todo:
        records = _batch_launch(rank_fn, world_size, [items[i] for i in todo]) if todo[1:] else ["alone"]
        rest = [i for i, record in zip(todo, records, strict=True) if record == "unrun"]
        for i, record in zip(todo, records, strict=True):
            if isinstance(record, list):
                outcomes[i] = (record, None)
            elif record == "alone" or (record == "unrun" and rest == todo and i == todo[0]):
                try:  # it raised, hung or killed a rank in the batch, or the batch could not start
                    outcomes[i] = run_on_ranks(rank_fn, world_size, *items[i], hang_hint=hang_hint)
                except Exception as err:  # noqa: BLE001 - raised where a launch of its own raises it
                    outcomes[i] = err
        todo = rest[1:] if rest == todo else rest
    return outcomes


def _batch_launch(rank_fn: Callable[..., Any], world_size: int, items: list[tuple]) -> list[Any]:
    """One launch of :func:`_batch_rank`; per item, the ranks' results, "alone" or "unrun"."""
    import pickle
    import tempfile
    from pathlib import Path

    from ..distributed import LaunchTimeout, RankError, launch
    from ..launcher.waiting import CPU_BUDGET_S, Stalls, watching_stalls

    with tempfile.TemporaryDirectory(prefix="course-answers-") as folder:
        try:
            with untimed(), watching_stalls(Stalls(cpu_budget_s=CPU_BUDGET_S * len(items))):
                launch(_batch_rank, world_size, rank_fn, items, folder, echo=False, stacks=False,
                       timeout_s=RANKS_LIMIT_S * len(items), backend="gloo")
        except (LaunchTimeout, RankError, TypeError):  # TypeError: an answer cannot be sent
            pass  # the files say how far it went
        records: list[Any] = []
        for position in range(len(items)):
            paths = [Path(folder, f"{position}.{rank}") for rank in range(world_size)]
            got = [p.read_bytes() for p in paths] if all(map(Path.exists, paths)) else None
            started = any(Path(folder, f"{position}.{rank}.start").exists() for rank in range(world_size))
            records.append("unrun" if not started else "alone" if got is None or b"" in got
                           else [pickle.loads(g) for g in got])
    return records


def _batch_rank(rank: int, world_size: int, rank_fn: Callable[..., Any], items: list, folder: str) -> None:
    """A rank of a batch: each item from the same random state, its result on disk, a barrier (as a
    launch's teardown has); then, within 3 s, every rank, with as many collectives behind it, or the
    batch stops, and a rank stuck in what the item left open is stopped. (A runaway is caught later.)"""
    import datetime
    import os
    import random
    import signal
    from pathlib import Path

    import cloudpickle
    import numpy
    import torch
    import torch.distributed as dist

    def put(name: str, data: bytes) -> None:
        Path(folder, name + ".tmp").write_bytes(data)
        os.replace(Path(folder, name + ".tmp"), Path(folder, name))

    store, group = dist.distributed_c10d._get_default_store(), dist.distributed_c10d._get_default_group()
    store.set(f"course-batch/pid/{rank}", str(os.getpid()))
    states = (torch.random.get_rng_state(), random.getstate(), numpy.random.get_state())
    restores = (torch.random.set_rng_state, random.setstate, numpy.random.set_state)
    for position, args in enumerate(items):
        [restore(state) for restore, state in zip(restores, states, strict=True)]
        put(f"{position}.{rank}.start", b"")
        try:
            put(f"{position}.{rank}", cloudpickle.dumps(rank_fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - judged again alone
            put(f"{position}.{rank}", b"")
        dist.barrier()
        keys = [f"course-batch/{position}/{r}" for r in range(world_size)]
        store.set(keys[rank], str(group._get_sequence_number_for_group()))
        try:
            store.wait(keys, datetime.timedelta(seconds=3))
        except Exception:  # noqa: BLE001 - a rank is stuck in what the item left open: stop it
            kill = getattr(signal, "SIGKILL", signal.SIGTERM)
            [os.kill(int(store.get(f"course-batch/pid/{r}")), kill) for r in range(world_size)
             if not store.check([keys[r]])]
            return
        if len({store.get(key) for key in keys}) != 1:
            return  # out of step


# ---------------------------------------------------------------- what ran on a rank (rank side)

#: the collectives of ``torch.distributed.ProcessGroup`` (every release's names), by kind; for
#: each, the position of the argument that holds what this rank hands in
_PG_METHODS = {
    "allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0), "reduce": ("reduce", 0), "send": ("send", 0),
    "allgather": ("all_gather", 1), "_allgather_base": ("all_gather", 1),
    "all_gather_single": ("all_gather", 1), "allgather_coalesced": ("all_gather", 1),
    "allgather_into_tensor_coalesced": ("all_gather", 1),
    "reduce_scatter": ("reduce_scatter", 1), "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
    "alltoall": ("all_to_all", 1), "alltoall_base": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 1),
    "gather": ("gather", 1), "scatter": ("scatter", 1),
    "barrier": ("barrier", None), "monitored_barrier": ("barrier", None),
}


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0) or 0)


@contextlib.contextmanager
def collectives_called() -> Iterator[list[tuple[str, int]]]:
    """On a rank: ``(kind, bytes handed in)`` of every collective the block runs on a process group,
    whatever name the code called it by (``dist.all_reduce``, a name imported before the block,
    ``compat``'s, the group's own method): they are counted where every one of them ends, in the
    methods of ``ProcessGroup``. DDP's reducer calls its group from C++ and is not seen here (see
    :func:`collectives_recorded`)."""
    import torch.distributed as dist

    calls: list[tuple[str, int]] = []
    group_class = dist.ProcessGroup
    originals = {name: getattr(group_class, name) for name in _PG_METHODS if hasattr(group_class, name)}

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        kind, position = _PG_METHODS[name]

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            handed = args[position] if position is not None and len(args) > position else None
            calls.append((kind, _nbytes(handed)))
            return original(self, *args, **kwargs)
        return call

    # what the class itself holds (pybind's method descriptors), put back as it was afterwards
    held = {name: group_class.__dict__.get(name) for name in originals}
    for name, original in originals.items():
        setattr(group_class, name, counting(name, original))
    try:
        yield calls
    finally:
        for name, descriptor in held.items():
            if descriptor is None:
                delattr(group_class, name)
            else:
                setattr(group_class, name, descriptor)


def sent_per_rank(calls: list[tuple[str, int]], world_size: int) -> float:
    """The bytes one rank sends for ``calls`` (from :func:`collectives_called`), as a ring runs
    each collective: an all-reduce of B bytes ``2B(N-1)/N``, a broadcast or a reduce-scatter of B
    bytes ``B(N-1)/N``, an all-gather of a b-byte shard ``(N-1)b``; anything else its bytes."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "broadcast": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_gather": n - 1, "barrier": 0}
    return sum(factors.get(kind, 1) * size for kind, size in calls)


@contextlib.contextmanager
def collectives_recorded() -> Iterator[list[str] | None]:
    """On a rank: the kinds of collective (``"all_reduce"``, ``"broadcast"``...) that ran on the
    rank's process groups during the block, DDP's own included, from the Flight Recorder (which
    records every collective on gloo); None where this torch cannot dump it. Filled in at the end
    of the block."""
    with reductions_recorded() as recorded:
        kinds: list[str] | None = [] if recorded is not None else None
        yield kinds
    if kinds is not None and recorded is not None:
        kinds.extend(kind for kind, _ in recorded)


@contextlib.contextmanager
def reductions_recorded() -> Iterator[list[tuple[str, int]] | None]:
    """On a rank: as :func:`collectives_recorded`, each with the values it was handed (the Flight
    Recorder's input sizes: gradients, not a token), ``("all_reduce", 30)``; None without a recorder."""
    import math

    from ..compat import dump_flight_recorder

    def entries() -> list[dict] | None:
        try:
            dump = dump_flight_recorder(collectives=True, stacks=False)
        except Exception:  # noqa: BLE001 - no recorder here: the judge does without
            return None
        return None if dump is None else list(dump.get("entries", []))

    before = entries()
    seen = -1 if not before else max(e["record_id"] for e in before)
    recorded: list[tuple[str, int]] | None = [] if before is not None else None
    try:
        yield recorded
    finally:
        after = entries() if recorded is not None else None
        if recorded is not None and after is not None:
            recorded.extend((str(e["profiling_name"]).split(":")[-1],
                             sum(math.prod(size) for size in e.get("input_sizes") or []))
                            for e in sorted(after, key=lambda e: e["record_id"]) if e["record_id"] > seen)
