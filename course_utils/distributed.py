"""Run N ranks of a function from a notebook, a script or a test (notebook 05).

``launch(fn, world_size, *args)`` starts ``world_size`` fresh Python processes, sets up a process
group in each (gloo on the CPU, NCCL when every rank can have its own GPU), runs
``fn(rank, world_size, *args)`` and returns the ranks' return values in rank order. With
``init="none"`` it sets up no group: each rank gets torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...) and ``fn`` calls ``init_process_group``
itself, as the PyTorch DDP tutorial's ``demo_basic`` and every torchrun script do.

What it takes care of, because a notebook cannot:

- **Functions from anywhere.** A rank never comes from forking the kernel (fork after torch
  compute can deadlock). ``fn`` and ``args`` travel to the ranks with ``cloudpickle``: a function
  defined in a notebook cell, a script's ``__main__``, or inside another function (a closure, a
  lambda) is sent *by value*, with the globals and closure variables it uses; a function that can
  be imported by name (``course_utils.ddp_demos.hello``) is sent by reference, as plain pickle
  does. What cannot travel (an open file, a lock, a socket, a generator, a GPU tensor) is named
  in a ``TypeError`` before any rank starts.
- **Fast starts.** A fresh interpreter spends about 1.2 s importing torch, and DDP's first
  construction about 1.5 s more importing ``torch._dynamo``. On Linux machines without a GPU,
  ranks are therefore forked from a *fork server*: a clean process that ``multiprocessing``
  starts once, which imports torch and those modules and does no torch compute, so forking it is
  safe. A rank then starts in a few hundredths of a second. With a GPU (CUDA and fork do not
  mix), on other systems, or with ``start="subprocess"``, every rank is a fresh
  ``python -m course_utils.launcher.rank``.
- **No port races.** The parent hosts the rendezvous ``TCPStore`` on a port the OS assigns, and
  closes it when the launch ends.
- **Failures reach you.** If a rank raises, ``launch`` stops the other ranks and raises
  :class:`RankError` with that rank's traceback and output. If the ranks do not finish within
  ``timeout_s`` (a rank stuck in a collective, say), it asks each stuck rank where it is (a
  ``faulthandler`` dump of its Python stack), stops them all and raises :class:`LaunchTimeout`
  with those stacks. Every rank runs in its own process session, which is killed as a whole, so
  nothing is left behind.
- **Deterministic output.** Each rank's stdout and stderr (C++ messages included) go to a file;
  the lines are printed afterwards, rank by rank, so nbval can compare them.
"""

from __future__ import annotations

import datetime
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._checks import check_positive_int, check_seconds
from .devices import choose_backend
from .launcher import rank as _rank
from .launcher.forkserver import Forked, RankProcess, forkserver_context, use_forkserver
from .launcher.pickling import serialise_call
from .launcher.processes import RankHandle, RankResult, stacks_of, stop

__all__ = ["LaunchTimeout", "RankError", "free_port", "launch", "rank_print"]

#: how long the parent's TCPStore waits for a rank's connection
#: How ``launch``'s ranks meet: its own store, ``env://``, ``tcp://``, or no group (``fn`` makes one).
INITS = ("store", "env", "tcp", "none")
STORE_TIMEOUT_S = 30.0
#: extra time a rank's process group gets beyond the launch's own limit, so the launch times out first
GROUP_GRACE_S = 30.0
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for ``tcp://`` and ``env://`` demos)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_print(*values: Any, rank: int | None = None, only_rank: int | None = None) -> None:
    """``print`` that prefixes the rank, or prints on ``only_rank`` alone (rank-0-only logging)."""
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if only_rank is not None and rank != only_rank:
        return
    print(*values, flush=True)


def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a function (or another callable), got {type(fn).__name__}")


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str | None = None,
    init: str = "store",
    threads_per_rank: int = 1,
    echo: bool = True,
    start: str = "auto",
    stacks: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results in order.

    ``fn`` may be defined anywhere, a notebook cell included: it is sent to the ranks with
    ``cloudpickle`` (by value, with the globals and closure variables it uses, unless it can be
    imported by name), and so are ``args``. What cannot be sent is named in a ``TypeError``
    before any rank starts. Return values come back the same way.

    ``backend``: ``"gloo"`` or ``"nccl"``; by default NCCL when every rank can have its own GPU,
    else gloo. ``init`` is how the ranks meet: ``"store"`` (a TCPStore held by this process; the
    robust default), ``"env"`` (``env://`` with ``MASTER_ADDR``/``MASTER_PORT``, as torchrun does),
    ``"tcp"`` (``tcp://127.0.0.1:PORT``, as in the Korean article), or ``"none"``: no group; ``fn`` calls
    ``init_process_group`` itself, from torchrun's environment (``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``)
    or from its own address and port; a group it leaves open is destroyed after it returns. Each
    rank uses ``threads_per_rank`` CPU threads. With ``echo`` the ranks' printed lines are printed
    here, rank by rank, each prefixed with ``[rank r]``. With ``stacks``, a timeout reports where
    each stuck rank was (its Python stack, from ``faulthandler``).

    ``start`` is how the rank processes start: ``"forkserver"`` (forked from a clean server that
    has imported torch once: fast), ``"subprocess"`` (a fresh interpreter per rank: about 1.2 s
    more each) or ``"auto"``: the fork server on Linux when no GPU is visible and ``__main__`` is
    not a script run by path; else subprocesses.
    """
    _check_callable(fn)
    world_size = check_positive_int("world_size", world_size)
    threads_per_rank = check_positive_int("threads_per_rank", threads_per_rank)
    timeout_s = check_seconds("timeout_s", timeout_s)
    if not (isinstance(init, str) and init in INITS):
        raise ValueError(f"init must be one of {', '.join(map(repr, INITS))} ('none': fn sets up its "
                         f"own process group), got {init!r}")
    if not isinstance(stacks, bool):
        raise TypeError(f"stacks must be True or False, got {stacks!r}")
    backend = choose_backend(world_size) if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    forkserver = use_forkserver(start, backend)
    call = serialise_call(fn, args)  # before anything starts: what cannot travel is named here

    import torch.distributed as dist

    workdir = Path(tempfile.mkdtemp(prefix="course-launch-"))
    store = None
    ranks: list[RankHandle] = []
    try:
        if init == "store":
            store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=STORE_TIMEOUT_S),
                                  wait_for_workers=False)
            port = store.port
        else:
            port = free_port()
        # plain pickle around the cloudpickled call: a rank reads the settings and sys.path first
        payload = {"call": call, "sys_path": list(sys.path), "world_size": world_size,
                   "backend": backend, "init": init, "port": port,
                   "timeout_s": timeout_s + GROUP_GRACE_S, "threads": threads_per_rank}
        (workdir / "payload.pkl").write_bytes(pickle.dumps(payload))
        env_base = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads_per_rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
        context = forkserver_context() if forkserver else None
        for rank in range(world_size):
            log, result = workdir / f"rank{rank}.log", workdir / f"rank{rank}.result"
            env = {**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            process: subprocess.Popen | Forked
            if context is not None:  # the rank opens its own log (rank{N}.log) once forked
                forked = RankProcess(target=_rank.forked, args=(str(workdir), rank, env),
                                      name=f"course-rank-{rank}")
                forked.start()
                process = Forked(forked)
            else:
                with open(log, "wb") as out:
                    process = subprocess.Popen(
                        [sys.executable, "-m", "course_utils.launcher.rank", str(workdir), str(rank)],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                        start_new_session=True,
                    )
            ranks.append(RankHandle(rank, process, log, result))
        return _wait(ranks, timeout_s, echo, stacks)
    finally:
        stop(ranks)
        for r in ranks:
            if isinstance(r.process, Forked):
                r.process.close()
        del store
        shutil.rmtree(workdir, ignore_errors=True)


def _is_echo(result: RankResult) -> bool:
    return _PEER_FAILED.search(result.message or "") is not None


def _cause(results: dict[int, RankResult]) -> int:
    """The rank to blame: the earliest failure that is not a peer's echo, else the earliest."""
    errors = sorted((res.finished_at, rank) for rank, res in results.items() if not res.ok)
    own = [(at, rank) for at, rank in errors if not _is_echo(results[rank])]
    return (own or errors)[0][1]


def _wait(ranks: list[RankHandle], timeout_s: float, echo: bool, stacks: bool) -> list[Any]:
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
