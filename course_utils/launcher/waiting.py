"""Waiting for a launch's ranks: their results, the rank to blame when one fails, and what a timeout
reports (notebook 05). ``course_utils.distributed.launch`` starts the ranks and calls
:func:`wait_for`; the errors it raises are importable from ``course_utils.distributed``.

Slow or stuck? A wall clock cannot tell: on a busy machine (a laptop with a browser open, Colab's
two vCPUs, a test run's own workers) a right program takes several times longer. Inside
:func:`watching_stalls` (the exercise checks use it) a launch therefore decides from evidence: the
unfinished ranks are stuck when they have used next to no CPU (:data:`IDLE_SHARE` of a core each)
for :data:`STALL_S` (a rank waiting in a collective its peers never call sleeps in the kernel; a rank
that computes, imports torch or is only slowed by other processes keeps using some), and they
run away when one of them has used :data:`CPU_BUDGET_S` of CPU. The launch's ``timeout_s`` stays
the last resort.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .processes import RankHandle, RankResult, stacks_of, stop

__all__ = ["CPU_BUDGET_S", "IDLE_SHARE", "STALL_S", "LaunchTimeout", "RankError", "Stalls", "wait_for",
           "watching_stalls"]

#: after a rank failed, how long to wait for the other ranks' evidence before blaming the first
EVIDENCE_S = 0.5
#: how long to wait for the cause when every failure so far is a peer's echo (see _PEER_FAILED)
ECHO_WAIT_S = 5.0
#: how a collective fails in a rank whose peer failed first: an echo of the cause, not the cause
#: (a rank that raised may clean up, e.g. destroy its group, before its own error is recorded)
_PEER_FAILED = re.compile(r"gloo/transport|Connection (?:closed|reset) by peer|Broken pipe|"
                          r"remote process exited|communicator was aborted", re.IGNORECASE)
#: after every rank returned, how long their processes get to exit by themselves
EXIT_GRACE_S = 10.0
#: how often the launcher polls the ranks
POLL_S = 0.02
#: stuck: the unfinished ranks used less than IDLE_SHARE of a core each, on average, over the last
#: STALL_S seconds. A rank blocked in a gloo collective is not quite at zero: gloo's and torch's
#: threads wake now and then (measured: 0.003 to 0.004 s of CPU per second per rank, idle or with
#: every core busy, so two ranks use about 0.05 s in 8 s). A fixed 0.05 s for all ranks together
#: was that very figure: a hang of 12.3 went unseen until the launch's wall-clock limit on a busy
#: machine. 0.02 of a core is five times what a waiting rank uses; one that runs, however starved
#: by other processes, gets far more (a third of a core with two busy loops per core). 5 s judged a
#: right answer of 12.8 (a rank sleeps 2 s while the other waits in a barrier) hung once in three
#: `make test` runs on 3 workers over 2 cores; 8 s leaves that room and still reports a hang
#: within about 10 s.
STALL_S, IDLE_SHARE = 8.0, 0.02
#: runaway: one rank (with the processes it started) used this much CPU. A right answer of the
#: course's checks uses under 1 s forked, about 3 s as a fresh interpreter (imports included).
CPU_BUDGET_S = 20.0
#: how often the CPU times of the ranks are read
CPU_POLL_S = 0.2


@dataclass(frozen=True)
class Stalls:
    """How a launch inside :func:`watching_stalls` tells slow from stuck (see the module's text)."""

    stall_s: float = STALL_S
    idle_share: float = IDLE_SHARE
    cpu_budget_s: float = CPU_BUDGET_S


_STALLS: contextvars.ContextVar[Stalls | None] = contextvars.ContextVar("course_stalls", default=None)


@contextlib.contextmanager
def watching_stalls(stalls: Stalls | None = None) -> Iterator[Stalls]:
    """Inside the block, a launch stops its ranks when they are stuck or run away (see above), not
    only at its ``timeout_s``: :class:`LaunchTimeout` then says which (``cause``)."""
    stalls = stalls or Stalls()
    token = _STALLS.set(stalls)
    try:
        yield stalls
    finally:
        _STALLS.reset(token)


def _cpu_seconds(handle: RankHandle) -> float | None:
    """CPU seconds (user + system) a rank and the processes it started have used; None once gone."""
    import psutil

    try:
        process = psutil.Process(handle.process.pid)
        total = sum(process.cpu_times()[:2])
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(child.cpu_times()[:2])
        return total
    except psutil.Error:
        return None


class _Watch:
    """The evidence on the unfinished ranks, read every CPU_POLL_S: their CPU seconds."""

    def __init__(self, stalls: Stalls) -> None:
        self.stalls = stalls
        self.read_at = 0.0
        self.mark: tuple[float, float] | None = None  # (when, CPU seconds) at the last progress
        self.ranks: frozenset[int] = frozenset()

    def verdict(self, stuck: list[RankHandle]) -> str | None:
        """``"stalled"``, ``"runaway"`` or None (progress, or too soon to say)."""
        now = time.monotonic()
        if now - self.read_at < CPU_POLL_S:
            return None
        self.read_at = now
        seconds = {r.rank: _cpu_seconds(r) for r in stuck}
        if any(s is None for s in seconds.values()):
            return None  # a rank is exiting: the launcher sees it at its next poll
        if any(s > self.stalls.cpu_budget_s for s in seconds.values()):
            return "runaway"
        total, ranks = sum(seconds.values()), frozenset(seconds)
        idle_cpu_s = self.stalls.idle_share * self.stalls.stall_s * len(ranks)  # at most, in a window
        if self.mark is None or ranks != self.ranks or total - self.mark[1] >= idle_cpu_s:
            self.mark, self.ranks = (now, total), ranks  # progress (or other ranks): start again
            return None
        return "stalled" if now - self.mark[0] >= self.stalls.stall_s else None



class RankError(RuntimeError):
    """A rank raised. ``rank``, ``exc_type``, ``rank_traceback`` and ``output`` say what happened."""

    def __init__(self, rank: int, exc_type: str, message: str, rank_traceback: str,
                 output: list[str]) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.rank_traceback = rank_traceback
        self.output = output
        tail = "\n".join(output[-20:]) or "(nothing)"
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n\n"
            f"--- traceback of rank {rank} ---\n{rank_traceback.rstrip()}\n"
            f"--- last output of rank {rank} ---\n{tail}"
        )


class LaunchTimeout(TimeoutError):
    """The ranks did not all finish within the launch's ``timeout_s``; they were stopped.

    ``stacks`` maps each stuck rank to the lines of its Python stack at the timeout (most recent
    call last), when ``launch(..., stacks=True)`` could get them; it is empty otherwise.
    ``cause`` is ``"time"`` (``timeout_s`` ran out), or inside :func:`watching_stalls`
    ``"stalled"`` (no unfinished rank used the CPU for ``stall_s``: they wait for each other) or
    ``"runaway"`` (a rank used ``cpu_budget_s`` of CPU: a loop that does not end, say).
    """

    def __init__(self, message: str, stacks: dict[int, list[str]] | None = None,
                 cause: str = "time") -> None:
        super().__init__(message)
        self.stacks = stacks or {}
        self.cause = cause


def _is_echo(result: RankResult) -> bool:
    return _PEER_FAILED.search(result.message or "") is not None


def _cause(results: dict[int, RankResult]) -> int:
    """The rank to blame: the earliest failure that is not a peer's echo, else the earliest."""
    errors = sorted((res.finished_at, rank) for rank, res in results.items() if not res.ok)
    own = [(at, rank) for at, rank in errors if not _is_echo(results[rank])]
    return (own or errors)[0][1]


def wait_for(ranks: list[RankHandle], timeout_s: float, echo: bool, stacks: bool) -> list[Any]:
    """The ranks' return values in rank order, once all have returned; else stop them all and raise
    :class:`RankError` (the rank that failed first and not as an echo of a peer) or
    :class:`LaunchTimeout` (with the stuck ranks' stacks when ``stacks``)."""
    deadline = time.monotonic() + timeout_s
    stalls = _STALLS.get()
    watch = _Watch(stalls) if stalls is not None else None
    results: dict[int, RankResult] = {}
    exited_at: dict[int, float] = {}
    trouble_since: float | None = None
    while True:
        for r in ranks:
            if r.rank not in exited_at and r.process.poll() is not None:
                exited_at[r.rank] = time.time()
            if r.rank not in results:
                found = r.read_result()  # read after the exit check: a result precedes the exit
                if found is not None:
                    results[r.rank] = found
        # A rank that exited without writing a result died (killed, crashed, os._exit); a rank
        # that raised wrote an error. Either makes its peers fail soon after ("Connection reset
        # by peer"), so wait a moment for the evidence, then blame the first cause.
        died = [r for r in ranks if r.rank in exited_at and r.rank not in results]
        errors = [(res.finished_at, rank) for rank, res in results.items() if not res.ok]
        if died or errors:
            now = time.monotonic()
            trouble_since = trouble_since or now
            echoes_only = not died and all(_is_echo(results[rank]) for _, rank in errors)
            wait = ECHO_WAIT_S if echoes_only else EVIDENCE_S
            if now - trouble_since < wait and len(exited_at) < len(ranks):
                time.sleep(POLL_S)
                continue
            stop(ranks)
            if died:
                first = min(died, key=lambda r: exited_at[r.rank])
                code = first.process.returncode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise RankError(first.rank, "ProcessDied", f"the process {how} before returning",
                                "(no Python traceback: the process itself ended)",
                                first.output(keep_logs=True))
            rank = _cause(results)
            res = results[rank]
            raise RankError(rank, res.exc_type, res.message, res.traceback,
                            ranks[rank].output(keep_logs=True))
        if len(results) == len(ranks):
            if len(exited_at) == len(ranks):
                break
            # every rank has returned; give the processes a moment to exit, then stop them
            trouble_since = trouble_since or time.monotonic()
            if time.monotonic() - trouble_since > EXIT_GRACE_S:
                break
        cause = "time" if time.monotonic() > deadline else None
        unfinished = [r for r in ranks if r.rank not in results]
        if cause is None and watch is not None and unfinished:
            cause = watch.verdict(unfinished)
        if cause is not None:
            _give_up(ranks, results, stacks, cause, timeout_s, stalls)
        time.sleep(POLL_S)
    if echo:
        for r in ranks:
            for line in r.output():
                print(f"[rank {r.rank}] {line}")
    return [results[r.rank].value for r in ranks]


def _give_up(ranks: list[RankHandle], results: dict[int, RankResult], stacks: bool, cause: str,
             timeout_s: float, stalls: Stalls | None) -> None:
    """Stop every rank and raise :class:`LaunchTimeout` with the stuck ranks' stacks and output."""
    done = sorted(results)
    stuck = [r for r in ranks if r.rank not in results]
    where = stacks_of(stuck) if stacks else {}
    reports = []
    for r in stuck:
        if r.rank in where:
            reports.append(f"--- where rank {r.rank} was (most recent call last) ---\n"
                           + ("\n".join(where[r.rank]) or "(no Python frame)"))
        reports.append(f"--- last output of rank {r.rank} ---\n"
                       + ("\n".join(r.output(keep_logs=True)[-10:]) or "(nothing)"))
    stop(ranks)
    if cause == "stalled" and stalls is not None:
        what = f"the ranks made no progress for {stalls.stall_s:g} s (none used the CPU)"
    elif cause == "runaway" and stalls is not None:
        what = f"a rank used {stalls.cpu_budget_s:g} s of CPU without finishing"
    else:
        what = f"the ranks did not finish within {timeout_s:g} s"
    raise LaunchTimeout(
        f"{what}: rank(s) {[r.rank for r in stuck]} were still running (finished: {done or 'none'}). "
        f"All ranks were stopped. A rank that waits in a collective its peers never call "
        f"blocks forever; check that every rank makes the same collective calls in the "
        f"same order.\n" + "\n".join(reports), where, cause)
