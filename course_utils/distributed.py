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
  be imported by name (``course_utils.ddp.demos.hello``) is sent by reference, as plain pickle
  does. What cannot travel (an open file, a lock, a socket, a generator, a GPU tensor) is named
  in a ``TypeError`` before any rank starts.
- **Fast starts.** A fresh interpreter spends about 1.2 s importing torch, and DDP's first
  construction about 1.5 s more importing ``torch._dynamo``. On Linux, ranks are therefore
  forked from a *fork server*: a clean process that ``multiprocessing`` starts once, which
  imports torch and those modules and does no torch compute, so forking it is safe. Its imports
  do not initialise CUDA, so a forked rank may use a GPU (NCCL too): it initialises CUDA itself. A rank then
  starts in a few hundredths of a second, with the launch's environment (``TORCH_DISTRIBUTED_DEBUG``
  included); a variable torch reads only as it loads (``launcher.rank.READ_AT_LOAD``:
  ``PYTORCH_CUDA_ALLOC_CONF``, ``TORCH_CPP_LOG_LEVEL``...) changed since the server started fails
  the rank with what to do. On other systems, or with ``start="subprocess"``, every rank is a
  fresh ``python -m course_utils.launcher.rank``. The environment variable
  ``COURSE_START=subprocess`` makes that the start of every launch that does not pass ``start=``
  (``make stress`` runs every notebook so: the start that macOS and Windows learners get).
- **No port races.** The ranks meet through a ``FileStore``: a file in the launch's own temporary
  folder, removed when the launch ends. No port is taken, and no address is looked up (a
  ``TCPStore`` makes torch look up the name of every peer that connects, and a name server that
  drops the query costs that rank 5 s, even on 127.0.0.1).
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

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._checks import check_positive_int, check_seconds
from .devices import choose_backend
from .launcher import rank as _rank
from .launcher.forkserver import Forked, RankProcess, forkserver_context, use_forkserver
from .launcher.pickling import serialise_call
from .launcher.processes import RankHandle, stop
from .launcher.waiting import LaunchTimeout, RankError, wait_for

__all__ = ["LaunchTimeout", "RankError", "free_port", "launch", "rank_print"]

#: How ``launch``'s ranks meet: its own store, ``env://``, ``tcp://``, or no group (``fn`` makes one).
INITS = ("store", "env", "tcp", "none")
#: extra time a rank's process group gets beyond the launch's own limit, so the launch times out first
GROUP_GRACE_S = 30.0
def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for ``tcp://`` and ``env://`` demos)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_print(*values: Any, rank: int | None = None, only_rank: int | None = None) -> None:
    """``print`` on ``only_rank`` alone (rank-0-only logging), or on every rank.

    The line goes out in one write. ``print`` writes each value and the newline separately, and
    where output is unbuffered (torchrun's workers run with ``PYTHONUNBUFFERED=1``) each piece is
    its own write to the pipe the ranks share, so another rank's line could land inside this one.
    """
    import torch.distributed as dist

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if only_rank is not None and rank != only_rank:
        return
    sys.stdout.write(" ".join(map(str, values)) + "\n")
    sys.stdout.flush()


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
    start: str | None = None,
    stacks: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results in order.

    ``fn`` may be defined anywhere, a notebook cell included: it is sent to the ranks with
    ``cloudpickle`` (by value, with the globals and closure variables it uses, unless it can be
    imported by name), and so are ``args``. What cannot be sent is named in a ``TypeError``
    before any rank starts. Return values come back the same way.

    ``backend``: ``"gloo"`` or ``"nccl"``; by default NCCL when every rank can have its own GPU,
    else gloo. ``init`` is how the ranks meet: ``"store"`` (a ``FileStore`` in the launch's
    temporary folder; the robust default), ``"env"`` (``env://`` with ``MASTER_ADDR`` and
    ``MASTER_PORT``, as torchrun does), ``"tcp"`` (``tcp://127.0.0.1:PORT``, as in the Korean
    article), or ``"none"``: no group; ``fn`` calls ``init_process_group`` itself, from torchrun's
    environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``) or from its own address and port; a group
    it leaves open is destroyed after it returns. Each rank uses ``threads_per_rank`` CPU threads.
    With ``echo`` the ranks' printed lines are printed here, rank by rank, each prefixed with
    ``[rank r]``. With ``stacks``, a timeout reports where each stuck rank was (its Python stack,
    from ``faulthandler``).

    ``start`` is how the rank processes start: ``"forkserver"`` (forked from a clean server that
    has imported torch once: fast), ``"subprocess"`` (a fresh interpreter per rank: about 1.2 s
    more each) or ``"auto"``: the fork server on Linux (with or without a GPU) when ``__main__``
    is not a script run by path; else subprocesses. Left out, it is the variable ``COURSE_START``
    (``subprocess``: fresh interpreters on every machine), or ``"auto"`` where that is unset.
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
    forkserver = use_forkserver(start)
    call = serialise_call(fn, args)  # before anything starts: what cannot travel is named here
    workdir = Path(tempfile.mkdtemp(prefix="course-launch-"))
    ranks: list[RankHandle] = []
    try:
        port = free_port()  # MASTER_PORT, for env://, tcp:// and a group fn makes itself
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
        return wait_for(ranks, timeout_s, echo, stacks)
    finally:
        stop(ranks)
        for r in ranks:
            if isinstance(r.process, Forked):
                r.process.close()
        shutil.rmtree(workdir, ignore_errors=True)
