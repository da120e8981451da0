"""Waiting for a launch's ranks: their results, the rank to blame when one fails, and what a timeout
reports (notebook 05). ``course_utils.distributed.launch`` starts the ranks and calls
:func:`wait_for`; the errors it raises are importable from ``course_utils.distributed``.
"""

from __future__ import annotations

import re
import time
from typing import Any

from .processes import RankHandle, RankResult, stacks_of, stop

__all__ = ["LaunchTimeout", "RankError", "wait_for"]

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
    """

    def __init__(self, message: str, stacks: dict[int, list[str]] | None = None) -> None:
        super().__init__(message)
        self.stacks = stacks or {}


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
        if time.monotonic() > deadline:
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
            raise LaunchTimeout(
                f"the ranks did not finish within {timeout_s:g} s: rank(s) "
                f"{[r.rank for r in stuck]} were still running (finished: {done or 'none'}). All "
                f"ranks were stopped. A rank that waits in a collective its peers never call "
                f"blocks forever; check that every rank makes the same collective calls in the "
                f"same order.\n" + "\n".join(reports), where)
        time.sleep(POLL_S)
    if echo:
        for r in ranks:
            for line in r.output():
                print(f"[rank {r.rank}] {line}")
    return [results[r.rank].value for r in ranks]
