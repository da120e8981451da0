"""Run N ranks of a function from a notebook, a script or a test (notebook 05).

``launch(fn, world_size, *args)`` starts ``world_size`` fresh Python processes, sets up a process
group in each (gloo on the CPU, NCCL when every rank can have its own GPU), runs
``fn(rank, world_size, *args)`` and returns the ranks' return values in rank order. With
``init=False`` it sets up no group: each rank gets torchrun's environment (``RANK``,
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
  ``python -m course_utils._rank``.
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
import functools
import inspect
import io
import linecache
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from . import _rank
from ._checks import check_positive_int
from .devices import choose_backend, emulated_node_env, init_kwargs, local_rank

__all__ = [
    "LaunchTimeout",
    "RankError",
    "TorchrunResult",
    "choose_backend",
    "free_port",
    "init_from_torchrun",
    "launch",
    "rank_print",
    "torchrun",
    "torchrun_nodes",
]

#: c10d log lines start like "[W1122 14:02:53.123456789 ProcessGroupGloo.cpp:...]": they carry
#: timestamps and PIDs, so successful runs leave them out of the echoed output.
_C10D_LOG_PREFIXES = ("[W", "[I", "[E")


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


def init_from_torchrun(backend: str, timeout_s: float = 300.0) -> None:
    """``init_process_group`` for a worker that torchrun started, safe across restarts.

    By default torchrun's agent hosts a TCPStore and hands its address to the workers
    (``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``). That store outlives
    a restart, and so do the keys the dead attempt's ranks wrote into it: a restarted rank can
    read a dead rank's address and wait for it forever. Prefixing the store with the attempt
    number (``TORCHELASTIC_RESTART_COUNT``) gives every attempt clean keys, which is right on one
    node. With several nodes it is not: each agent counts its own restarts, and an agent that
    restarts because a peer node did does not count it, so the prefixes can differ. For those
    jobs set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun (``torchrun_nodes`` and
    ``cluster.slurm_script`` do): then rank 0 hosts a fresh store every attempt, and it is used
    without a prefix. Outside torchrun this is plain ``env://``.
    """
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout_s = _check_timeout(timeout_s)
    bind = init_kwargs(backend, local_rank())  # NCCL: this process's GPU, before any CUDA work
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, init_method="env://", **bind)
        return
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as missing:
        raise RuntimeError(f"torchrun's environment lacks {missing}") from None
    timeout = datetime.timedelta(seconds=timeout_s)
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not hosted_by_agent,
                          timeout=timeout)
    if hosted_by_agent:  # a store that outlives restarts: clean keys for every attempt
        store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **bind)


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


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, refusing open files (cloudpickle would send a copy of what a file opened for
    reading holds) and tensors that live on a device (a rank cannot use this process's)."""

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, io.IOBase) and not isinstance(obj, (io.StringIO, io.BytesIO))
                and obj not in (sys.stdout, sys.stderr, sys.stdin)):
            name = getattr(obj, "name", None)
            raise TypeError(f"an open file{f' ({name!r})' if name is not None else ''} cannot be "
                            f"sent to other processes: pass its path and open it in fn")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            raise TypeError(f"a tensor on {obj.device} cannot be sent to other processes: pass it "
                            f"on the CPU (.cpu()) and let each rank move it to its own device")
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _pickle_error(obj: Any) -> Exception | None:
    try:
        _dumps(obj)
    except Exception as err:  # noqa: BLE001 - any failure means it cannot travel
        return err
    return None


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The global names ``code`` may read, nested code (lambdas, comprehensions) included."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _parts(obj: Any) -> list[tuple[str, Any]]:
    """What a function sent by value carries along, each with a name a reader can find."""
    if isinstance(obj, functools.partial):
        return [("wrapped function", obj.func),
                *((f"bound argument {i}", a) for i, a in enumerate(obj.args)),
                *((f"bound keyword {k!r}", v) for k, v in obj.keywords.items())]
    if inspect.ismethod(obj):
        return [("object (self)", obj.__self__), ("function", obj.__func__)]
    if not inspect.isfunction(obj):
        return []
    parts = []
    for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
        try:
            parts.append((f"closure variable {name!r}", cell.cell_contents))
        except ValueError:  # an empty cell: a variable not yet assigned
            pass
    seen = set()
    for name in _global_names(obj.__code__):
        if name in obj.__globals__ and name not in seen:
            seen.add(name)
            parts.append((f"global {name!r}", obj.__globals__[name]))
    defaults = inspect.signature(obj).parameters.values() if obj.__defaults__ or obj.__kwdefaults__ else ()
    for parameter in defaults:
        if parameter.default is not inspect.Parameter.empty:
            parts.append((f"default of parameter {parameter.name!r}", parameter.default))
    return parts


def _type_name(obj: Any) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _culprit(obj: Any, err: Exception, depth: int = 0) -> tuple[list[str], Any, Exception]:
    """Follow what ``obj`` carries down to the innermost piece that cannot be pickled."""
    if depth < 5:
        for name, part in _parts(obj):
            part_err = _pickle_error(part)
            if part_err is not None:
                path, found, found_err = _culprit(part, part_err, depth + 1)
                return [name, *path], found, found_err
    return [], obj, err


def _serialise_call(fn: Callable, args: tuple) -> bytes:
    """``(fn, args)`` as cloudpickle bytes, or a TypeError that names what cannot travel."""
    try:
        return _dumps((fn, args))
    except Exception as err:  # noqa: BLE001 - explained below
        first_err = err
    hint = ("Each rank is a separate process: create open files, locks, sockets, generators and "
            "GPU tensors inside fn, and pass plain data (paths, numbers, CPU tensors) instead.")
    fn_err = _pickle_error(fn)
    if fn_err is not None:
        what = f"fn {getattr(fn, '__qualname__', None) or _type_name(fn)!r}"
        path, found, found_err = _culprit(fn, fn_err)
        where = ("its " + ", whose ".join(path)) if path else what
    else:
        what = "the arguments for fn"
        for i, arg in enumerate(args):
            arg_err = _pickle_error(arg)
            if arg_err is not None:
                path, found, found_err = _culprit(arg, arg_err)
                where = ", whose ".join([f"args[{i}]", *path])
                break
        else:  # each piece travels, the whole does not (pickle's own limits): say what it said
            found, found_err, where = (fn, args), first_err, "the call"
    raise TypeError(f"cannot send {what} to the ranks: {where} is a {_type_name(found)}, which "
                    f"cannot be pickled ({found_err}). {hint}") from None


#: What the fork server imports once, so that a forked rank need not: torch, c10d, and what
#: DDP's first construction imports lazily (torch._dynamo, about 1.5 s on its own).
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "cloudpickle",
            "course_utils._rank", "course_utils.distributed"]


def _use_forkserver(start: str, backend: str) -> bool:
    if start not in ("auto", "forkserver", "subprocess"):
        raise ValueError(f"start must be 'auto', 'forkserver' or 'subprocess', got {start!r}")
    available = "forkserver" in multiprocessing.get_all_start_methods()
    if start == "forkserver" and not available:
        raise ValueError("start='forkserver' is not available on this platform; use "
                         "start='subprocess'")
    if start != "auto":
        return start == "forkserver"
    # A script run by path keeps fresh interpreters under "auto", as it always has (ranks no
    # longer re-import it, see _RankPopen, so start="forkserver" suits it as well).
    main = sys.modules.get("__main__")
    main_is_safe = getattr(main, "__spec__", None) is not None or not hasattr(main, "__file__")
    # With a GPU, ranks keep fresh interpreters: a forked process can use CUDA only if the server
    # never initialised it, and a GPU machine was not available to check the server's imports.
    return (available and sys.platform == "linux" and backend == "gloo" and main_is_safe
            and not _cuda_visible())


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _forkserver_context() -> Any:
    """multiprocessing's fork server, told to preload what a rank needs when it first starts.

    The server is one per process and shared with anything else that uses it (a ``DataLoader``
    with ``multiprocessing_context="forkserver"``, say). If it is already running, its preload
    list stays as it was: ranks then still work, and import the rest themselves.
    """
    multiprocessing.set_forkserver_preload(_PRELOAD)
    return multiprocessing.get_context("forkserver")


_PREPARING = threading.Lock()

try:  # the fork server exists on POSIX systems only
    from multiprocessing import context as _mp_context
    from multiprocessing import popen_forkserver as _popen_forkserver
    from multiprocessing import spawn as _spawn
except ImportError:  # pragma: no cover - Windows
    _RankProcess: Any = None
else:
    class _RankPopen(_popen_forkserver.Popen):
        """Starts a fork-server child that does not re-import ``__main__``.

        multiprocessing's children import the parent's ``__main__`` again (a script run by path
        runs once more, as ``__mp_main__``; a kernel imports ``ipykernel_launcher``), so that
        functions pickled by reference from ``__main__`` can be found. A rank needs none of that:
        ``fn`` comes by value in ``payload.pkl``, and the target is ``_rank.forked``. Leaving it
        out lets a script without an ``if __name__ == "__main__":`` guard run once, and saves the
        import. (The preparation data is built by ``spawn.get_preparation_data``; it is replaced
        for the moment of the start.)
        """

        def _launch(self, process_obj: Any) -> None:
            with _PREPARING:
                prepare = _spawn.get_preparation_data

                def without_main(name: str) -> dict:
                    data = prepare(name)
                    data.pop("init_main_from_path", None)
                    data.pop("init_main_from_name", None)
                    return data

                _spawn.get_preparation_data = without_main
                try:
                    super()._launch(process_obj)
                finally:
                    _spawn.get_preparation_data = prepare

    class _RankProcess(_mp_context.ForkServerProcess):  # type: ignore[no-redef]
        """A fork-server ``Process`` started by :class:`_RankPopen`."""

        @staticmethod
        def _Popen(process_obj: Any) -> _RankPopen:
            return _RankPopen(process_obj)


class _Forked:
    """A rank forked by the fork server, seen through the part of ``Popen``'s API launch uses."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout or 0.0)
        return code

    def close(self) -> None:
        try:
            self._process.close()  # releases its pipes; refused while the process still runs
        except ValueError:
            pass


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen | _Forked
    log: Path
    result: Path

    @property
    def stack(self) -> Path:
        """Where the rank's faulthandler writes its Python stack when it gets SIGUSR1."""
        return self.log.with_suffix(".stack")

    def output(self, *, keep_logs: bool = False) -> list[str]:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return []
        lines = text.splitlines()
        if keep_logs:
            return lines
        return [line for line in lines if not line.startswith(_C10D_LOG_PREFIXES)]

    def read_result(self) -> tuple | None:
        try:
            with open(self.result, "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            return None


def _stop(ranks: list[_Rank], grace_s: float = 3.0) -> None:
    """Terminate every rank's whole process session, then kill what is left."""
    alive = [r for r in ranks if r.process.poll() is None]
    for r in alive:
        _signal_session(r.process, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in alive:
        try:
            r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for r in ranks:
        # SIGKILL the session even if the leader exited: a grandchild (a DataLoader worker, say)
        # may still hold it.
        _signal_session(r.process, signal.SIGKILL)
        try:
            r.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that ignores SIGKILL
            pass


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux: read from /proc; elsewhere: none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - no /proc
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL ``process``'s session and every descendant, even those in sessions of their own.

    torchrun starts each worker in a new session, so killing the agent's session alone would
    leave its workers running (and holding the output pipe open).
    """
    for pid in _descendants(process.pid):
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _signal_session(process, signal.SIGKILL)


def _signal_session(process: subprocess.Popen | _Forked, sig: int) -> None:
    try:
        if hasattr(os, "killpg"):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                # a forked rank that has not yet made its own session: signal the process alone
                if process.poll() is None:
                    os.kill(process.pid, sig)
        elif process.poll() is None:  # pragma: no cover - Windows
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    backend: str | None = None,
    init: str | bool = "store",
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
    ``"tcp"`` (``tcp://127.0.0.1:PORT``, as in the seeds), or ``False``: no group; ``fn`` calls
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
    _check_timeout(timeout_s)
    if not (init is False or (isinstance(init, str) and init in ("store", "env", "tcp"))):
        raise ValueError(f"init must be 'store', 'env', 'tcp' or False (fn creates its own "
                         f"process group), got {init!r}")
    if not isinstance(stacks, bool):
        raise TypeError(f"stacks must be True or False, got {stacks!r}")
    backend = choose_backend(world_size) if backend is None else backend
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    forkserver = _use_forkserver(start, backend)
    call = _serialise_call(fn, args)  # before anything starts: what cannot travel is named here

    import torch.distributed as dist

    workdir = Path(tempfile.mkdtemp(prefix="course-launch-"))
    store = None
    ranks: list[_Rank] = []
    try:
        if init == "store":
            store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30),
                                  wait_for_workers=False)
            port = store.port
        else:
            port = free_port()
        # plain pickle around the cloudpickled call: a rank reads the settings and sys.path first
        payload = {"call": call, "sys_path": list(sys.path), "world_size": world_size,
                   "backend": backend, "init": init, "port": port,
                   "timeout_s": float(timeout_s) + 30.0, "threads": threads_per_rank}
        (workdir / "payload.pkl").write_bytes(pickle.dumps(payload))
        env_base = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads_per_rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
        context = _forkserver_context() if forkserver else None
        for rank in range(world_size):
            log, result = workdir / f"rank{rank}.log", workdir / f"rank{rank}.result"
            env = {**env_base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            process: subprocess.Popen | _Forked
            if context is not None:  # the rank opens its own log (rank{N}.log) once forked
                forked = _RankProcess(target=_rank.forked, args=(str(workdir), rank, env),
                                      name=f"course-rank-{rank}")
                forked.start()
                process = _Forked(forked)
            else:
                with open(log, "wb") as out:
                    process = subprocess.Popen(
                        [sys.executable, "-m", "course_utils._rank", str(workdir), str(rank)],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                        start_new_session=True,
                    )
            ranks.append(_Rank(rank, process, log, result))
        return _wait(ranks, float(timeout_s), echo, stacks)
    finally:
        _stop(ranks)
        for r in ranks:
            if isinstance(r.process, _Forked):
                r.process.close()
        del store
        shutil.rmtree(workdir, ignore_errors=True)


def _wait(ranks: list[_Rank], timeout_s: float, echo: bool, stacks: bool) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, tuple] = {}
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
        errors = [(res[4], rank) for rank, res in results.items() if res[0] == "error"]
        if died or errors:
            now = time.monotonic()
            trouble_since = trouble_since or now
            if now - trouble_since < 0.5 and len(exited_at) < len(ranks):
                time.sleep(0.02)
                continue
            _stop(ranks)
            if died:
                first = min(died, key=lambda r: exited_at[r.rank])
                code = first.process.returncode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise RankError(first.rank, "ProcessDied", f"the process {how} before returning",
                                "(no Python traceback: the process itself ended)",
                                first.output(keep_logs=True))
            _, rank = min(errors)  # the earliest failure is the cause; later ones are its echoes
            _, exc_type, message, tb, _ = results[rank]
            raise RankError(rank, exc_type, message, tb, ranks[rank].output(keep_logs=True))
        if len(results) == len(ranks):
            if len(exited_at) == len(ranks):
                break
            # every rank has returned; give the processes a moment to exit, then stop them
            trouble_since = trouble_since or time.monotonic()
            if time.monotonic() - trouble_since > 10.0:
                break
        if time.monotonic() > deadline:
            done = sorted(results)
            stuck = [r for r in ranks if r.rank not in results]
            where = _stacks(stuck) if stacks else {}
            reports = []
            for r in stuck:
                if r.rank in where:
                    reports.append(f"--- where rank {r.rank} was (most recent call last) ---\n"
                                   + ("\n".join(where[r.rank]) or "(no Python frame)"))
                reports.append(f"--- last output of rank {r.rank} ---\n"
                               + ("\n".join(r.output(keep_logs=True)[-10:]) or "(nothing)"))
            _stop(ranks)
            raise LaunchTimeout(
                f"the ranks did not finish within {timeout_s:g} s: rank(s) "
                f"{[r.rank for r in stuck]} were still running (finished: {done or 'none'}). All "
                f"ranks were stopped. A rank that waits in a collective its peers never call "
                f"blocks forever; check that every rank makes the same collective calls in the "
                f"same order.\n" + "\n".join(reports), where)
        time.sleep(0.02)
    if echo:
        for r in ranks:
            for line in r.output():
                print(f"[rank {r.rank}] {line}")
    return [results[r.rank][1] for r in ranks]


def _stacks(stuck: list[_Rank], wait_s: float = 2.0) -> dict[int, list[str]]:
    """Ask each stuck rank for its Python stack (SIGUSR1: faulthandler writes it), briefly."""
    if not hasattr(signal, "SIGUSR1"):  # pragma: no cover - Windows
        return {}
    asked = []
    for r in stuck:
        if r.process.poll() is None:
            try:
                os.kill(r.process.pid, signal.SIGUSR1)
                asked.append(r)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    sizes: dict[int, int] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.05)
        now = {r.rank: r.stack.stat().st_size if r.stack.exists() else 0 for r in asked}
        if all(now.values()) and now == sizes:  # every dump written, and none still growing
            break
        sizes = now
    found = {}
    for r in asked:
        try:
            found[r.rank] = _format_stack(r.stack.read_text(errors="replace"))
        except FileNotFoundError:
            pass
    return found


_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


def _format_stack(dump: str) -> list[str]:
    """A faulthandler dump as traceback lines: most recent call last, with the source lines,
    without the launcher's own frames (``_rank.run`` and what calls it)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if line.startswith(("Current thread", "Thread", "Stack")):
            threads.append([])
        elif threads and (match := _FRAME.match(line)):
            threads[-1].append((match.group(1), int(match.group(2)), match.group(3)))
    rank_file = os.path.normcase(os.path.abspath(_rank.__file__))
    lines = []
    for frames in threads:  # each thread's frames: most recent call first
        own = [i for i, (path, _, _) in enumerate(frames)
               if os.path.normcase(os.path.abspath(path)) == rank_file]
        # fn's frames and what they call; or, when fn has returned, where the launcher's rank
        # code waits (tearing down the group, say)
        mine = (frames[:own[0]] or frames[own[0]:own[0] + 1]) if own else frames
        if not mine:
            continue
        if not own:
            lines.append("  (another thread)")
        for path, number, name in reversed(mine):
            lines.append(f'  File "{path}", line {number}, in {name}')
            source = linecache.getline(path, number).strip()
            if source:
                lines.append(f"    {source}")
    return lines


@dataclass
class TorchrunResult:
    """What a torchrun agent left: its exit code, its workers' printed lines, and its logs.

    ``lines`` holds what the workers printed; ``log_lines`` holds the agent's and c10d's log
    records (timestamps, PIDs), the ``[rankN]:`` tracebacks torchrun relays from failed
    workers, and the C++ runtime's "terminate called ..." from workers stopped mid-collective.
    ``restarts`` counts the agent's "will restart worker group" decisions.
    """

    command: list[str]
    returncode: int
    lines: list[str]
    log_lines: list[str]

    @property
    def restarts(self) -> int:
        return sum("will restart worker group" in line for line in self.log_lines)

    def agent_events(self) -> list[str]:
        """The agent's decisions, without timestamps, PIDs or paths (needs ``LOGLEVEL=INFO``).

        Each rendezvous's ``restart_count``, every restart decision and the final outcome:
        enough to follow a restart, and the same on every run.
        """
        events = []
        for line in self.log_lines:
            message = line.split("] ", 1)[1].strip() if _AGENT_LOG.match(line) else ""
            if not message.startswith(_AGENT_EVENTS):
                continue
            events.append(re.sub(r"\. Waiting \d+ seconds.*$", ".", message))
        return events


_AGENT_LOG = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ \S+\] ")
# Only decisions that do not depend on timing: which rank the agent reports as the first failure
# depends on how fast the survivors notice, so "failed (exitcode ...)" is left to log_lines.
_AGENT_EVENTS = ("[default] Worker group FAILED", "restart_count=",
                 "[default] worker group successfully finished")
# Log records, tracebacks torchrun relays from failed workers, and what the C++ runtime prints
# when a process it is tearing down still has a live thread (a surviving rank that the agent
# stops after another rank died prints it in some runs and not others).
_LOG_LINE = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d|^\[rank\d+\]:|^\[[IWE]\d"
                       r"|^terminate called (without an active exception|after throwing)")


def _check_timeout(timeout_s: Any) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


def _torchrun_command(module: str, nproc_per_node: int, script_args: tuple,
                      launcher_args: tuple[str, ...]) -> list[str]:
    if not isinstance(module, str) or not module:
        raise TypeError(f"module must be a module name such as 'course_utils.ddp_train', got {module!r}")
    nproc_per_node = check_positive_int("nproc_per_node", nproc_per_node)
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args,
            f"--nproc-per-node={nproc_per_node}", "-m", module, *map(str, script_args)]


def _start(command: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True, text=True)


def _finish(processes: list[subprocess.Popen], commands: list[list[str]],
            timeout_s: float) -> list[TorchrunResult]:
    deadline = time.monotonic() + timeout_s
    outputs = []
    try:
        for process in processes:
            try:
                out, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in processes:
                    _kill_tree(p)
                try:
                    tail = process.communicate(timeout=10)[0].splitlines()[-20:]
                except subprocess.TimeoutExpired:  # pragma: no cover - something still holds the pipe
                    tail = ["(no output: the pipe is still held open)"]
                raise LaunchTimeout(f"torchrun did not finish within {timeout_s:g} s and was "
                                    "killed.\n" + "\n".join(tail)) from None
            outputs.append(out)
    finally:
        for p in processes:
            _kill_tree(p)  # any worker an agent left behind
    results = []
    for command, process, out in zip(commands, processes, outputs, strict=True):
        lines = out.splitlines()
        logs = [ln for ln in lines if _LOG_LINE.match(ln)]
        results.append(TorchrunResult(command, process.returncode,
                                      [ln for ln in lines if not _LOG_LINE.match(ln)], logs))
    return results


def _check_launcher(launcher_args: Any, env: Any) -> None:
    if isinstance(launcher_args, str) or not all(isinstance(a, str) for a in launcher_args):
        raise TypeError(f"launcher_args must be a tuple of strings, got {launcher_args!r}")
    if env is not None and not (isinstance(env, dict)
                                and all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in env.items())):
        raise TypeError(f"env must be a dict of strings to strings, got {env!r}")


def torchrun(module: str, nproc_per_node: int, *script_args: str, timeout_s: float = 180.0,
             launcher_args: tuple[str, ...] = ("--standalone",),
             env: dict[str, str] | None = None) -> TorchrunResult:
    """Run ``python -m torch.distributed.run LAUNCHER_ARGS --nproc-per-node=N -m MODULE ARGS``.

    ``sys.executable -m torch.distributed.run`` is torchrun itself, without relying on the
    ``torchrun`` script being on the kernel's PATH. ``env`` adds environment variables (for
    example ``LOGLEVEL=INFO``, which makes the agent log its restart decisions). The job runs in
    its own process session; if it outlives ``timeout_s`` the whole session is killed and
    :class:`LaunchTimeout` is raised.
    """
    timeout_s = _check_timeout(timeout_s)
    _check_launcher(launcher_args, env)
    command = _torchrun_command(module, nproc_per_node, script_args, launcher_args)
    return _finish([_start(command, env)], [command], timeout_s)[0]


def torchrun_nodes(module: str, nnodes: int, nproc_per_node: int, *script_args: str,
                   timeout_s: float = 180.0, job_id: str = "course",
                   launcher_args: tuple[str, ...] = (),
                   env: dict[str, str] | None = None) -> list[TorchrunResult]:
    """Start ``nnodes`` torchrun agents on this machine, as if each were a separate node.

    They meet through c10d rendezvous at ``127.0.0.1:PORT`` (a free port), exactly as agents on
    different machines would meet at the first node's address, with ``--nnodes=N``.
    ``launcher_args`` are added to each agent's (``--max-restarts=1``, say), and ``env`` to its
    environment. Every agent runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, so that a
    restart meets in a fresh store (see ``init_from_torchrun``). The agents share this machine's
    GPUs: each node gets a slice of its own when there is a GPU for every rank, else all use gloo
    (``devices.emulated_node_env``). Returns one result per agent.
    """
    nnodes = check_positive_int("nnodes", nnodes)
    timeout_s = _check_timeout(timeout_s)
    _check_launcher(launcher_args, env)
    if not isinstance(job_id, str) or not re.fullmatch(r"[\w.-]+", job_id):
        raise ValueError(f"job_id must be a non-empty name of letters, digits, '_', '.' or '-', "
                         f"got {job_id!r}")
    endpoint = f"127.0.0.1:{free_port()}"
    launcher = (f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={job_id}", *launcher_args)
    commands = [_torchrun_command(module, nproc_per_node, script_args, launcher)
                for _ in range(nnodes)]
    agent_envs = [{**emulated_node_env(node, nnodes, nproc_per_node), **(env or {}),
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} for node in range(nnodes)]
    return _finish([_start(c, e) for c, e in zip(commands, agent_envs, strict=True)], commands,
                   timeout_s)
