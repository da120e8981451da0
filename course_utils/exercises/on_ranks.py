"""Checks that run an answer on real ranks, through ``launch`` (notebooks 05, 09 and 11), so that
a wrong answer cannot hang the kernel.

Slow is not stuck: a check runs its ranks inside ``launcher.waiting.watching_stalls``, so they
count as hung when none of the unfinished ranks has used the CPU for ``STALL_S`` (8 s: each waits
for a peer, in a collective or a barrier), however long a busy machine takes to start and run
them; a rank that computes without end is stopped once it has used ``CPU_BUDGET_S`` of CPU, and
:data:`RANKS_LIMIT_S` of wall time is the last resort. Fresh-interpreter starts (macOS, Windows,
a GPU) spend their seconds of imports on the CPU, which counts as progress.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .time_limit import untimed

__all__ = ["RANKS_LIMIT_S", "RUNAWAY_HINT", "collectives_called", "collectives_recorded", "hint_from_ranks",
           "run_on_ranks", "sent_per_rank", "collectives_dispatched", "ring_bytes_sent"]

#: the wall-clock limit of a check's launch, a last resort (hangs and runaways are caught sooner)
RANKS_LIMIT_S = 90.0
#: the hint when the ranks kept computing without finishing
RUNAWAY_HINT = ("the ranks kept computing and did not finish: look for a loop that never ends, or "
                "far more work than the check needs")


def run_on_ranks(rank_fn: Callable[..., Any], world_size: int, *args: Any, hang_hint: str,
                 timeout_s: float = RANKS_LIMIT_S) -> tuple[list | None, str | None]:
    """Run an answer (or a judge's rank function) on real ranks for a check.

    Returns ``(results, None)``, or ``(None, hint)`` when the ranks hung (``hang_hint``), ran away
    (:data:`RUNAWAY_HINT`) or one raised (its first line). Checks run on gloo, on the CPU, on any
    machine: they judge the logic of an answer, so answer cells need no device code. The one way
    a judge launches ranks (notebooks 05, 09 and 11).
    """
    from ..distributed import LaunchTimeout, RankError, launch
    from ..launcher.waiting import watching_stalls

    try:
        with untimed(), watching_stalls():  # the ranks are judged on evidence, not the check's clock
            return launch(rank_fn, world_size, *args, echo=False, timeout_s=timeout_s, stacks=False,
                          backend="gloo"), None
    except LaunchTimeout as err:
        return None, hang_hint if getattr(err, "cause", "stalled") == "stalled" else RUNAWAY_HINT
    except RankError as err:
        first = (err.message.strip().splitlines() or [""])[0]
        return None, f"rank {err.rank} raised {err.exc_type}: {first}"


def hint_from_ranks(rank_fn: Callable[..., str | None], world_size: int, *args: Any,
                    hang_hint: str, timeout_s: float = RANKS_LIMIT_S) -> str | None:
    """Judge on real ranks with :func:`run_on_ranks`, where ``rank_fn`` returns each rank's hint
    (None when satisfied): the first hint, or the hang or error hint."""
    results, hint = run_on_ranks(rank_fn, world_size, *args, hang_hint=hang_hint, timeout_s=timeout_s)
    return hint if results is None else next((h for h in results if h is not None), None)


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
    from ..compat import dump_flight_recorder

    def entries() -> list[dict] | None:
        try:
            dump = dump_flight_recorder(collectives=True, stacks=False)
        except Exception:  # noqa: BLE001 - no recorder here: the judge does without
            return None
        return None if dump is None else list(dump.get("entries", []))

    before = entries()
    seen = -1 if not before else max(e["record_id"] for e in before)
    kinds: list[str] | None = [] if before is not None else None
    try:
        yield kinds
    finally:
        after = entries() if kinds is not None else None
        if kinds is not None and after is not None:
            kinds.extend(str(e["profiling_name"]).split(":")[-1]
                         for e in sorted(after, key=lambda e: e["record_id"]) if e["record_id"] > seen)


# ---------------------------------------------------------------- what reached the dispatcher (rank side)

#: the collectives as torch's dispatcher sees them, by the op's name without its namespace: c10d's
#: ops (which every ``torch.distributed`` function and every ``ProcessGroup`` method ends in) and
#: the functional collectives' (``torch.distributed._functional_collectives``, DTensor's), which never
#: reach the group's Python methods; for each, its kind and the position of the argument that
#: holds what this rank hands in
_DISPATCHED = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0), "all_reduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0), "reduce_": ("reduce", 0),
    "send": ("send", 0),
    "allgather_": ("all_gather", 1), "_allgather_base_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1), "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0), "all_gather_into_tensor_out": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "gather_": ("gather", 1), "scatter_": ("scatter", 1),
    "barrier": ("barrier", None), "monitored_barrier_": ("barrier", None),
}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


@contextlib.contextmanager
def collectives_dispatched() -> Iterator[list[tuple[str, int]]]:
    """On a rank: ``(kind, bytes handed in)`` of every collective the block runs in this thread,
    seen where every route to one ends before the backend, torch's dispatcher (a
    ``TorchDispatchMode``): ``dist.all_reduce`` and any name or alias of it, the group's own
    methods, ``compat``'s, and the functional collectives, which :func:`collectives_called` misses.
    A collective nested in another (an autograd wrapper's) is seen once, as the outer one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[str, int]] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            namespace, name = getattr(func, "namespace", ""), func.__name__.split(".")[0]
            if namespace in _COLLECTIVE_NAMESPACES and name in _DISPATCHED:
                kind, position = _DISPATCHED[name]
                handed = args[position] if position is not None and len(args) > position else None
                calls.append((kind, _nbytes(handed)))
            return func(*args, **(kwargs or {}))

    with Seen():
        yield calls


def ring_bytes_sent(calls: list[tuple[str, int]], world_size: int) -> float:
    """The bytes one rank sends for ``calls`` (from :func:`collectives_dispatched` or
    :func:`collectives_called`) in the ring model of notebook 09: an all-reduce of B bytes
    ``2B(N-1)/N``; a reduce-scatter, an all-to-all or a broadcast of B bytes ``B(N-1)/N`` (a
    broadcast on average over the ranks); an all-gather of a b-byte shard ``(N-1)b``; a barrier
    nothing; anything else its bytes."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "broadcast": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "all_gather": n - 1, "barrier": 0}
    return sum(factors.get(kind, 1) * size for kind, size in calls)
