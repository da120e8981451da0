"""What each rank of ``distributed.launch`` runs, in a process of its own.

A rank starts one of two ways: forked by the fork server (``forked``, the fast way on Linux),
or as a fresh interpreter, ``python -m course_utils.launcher.rank WORKDIR RANK`` (``main``). Either way
it reads the launch's payload (plain pickle around ``fn`` and ``args`` in cloudpickle's form, which
plain ``pickle`` loads), joins the process group unless ``init`` is ``"none"`` (then ``fn`` makes its
own), runs ``fn(rank, world_size, *args)`` and writes a ``processes.RankResult`` (the value, or the
exception's type, message and traceback) to ``WORKDIR/rank{RANK}.result``, atomically. It then
tears the group down (``fn``'s own too, if it left it open), dropping every object first (a DDP
model alive at teardown can make gloo abort at exit), and leaves with ``os._exit`` so that no
interpreter shutdown runs after the result is safe. On SIGUSR1, ``faulthandler`` writes the Python
stack of every thread to ``WORKDIR/rank{RANK}.stack``: ``launch`` asks for it on a timeout.
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import gc
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

from course_utils._checks import type_name
from course_utils.launcher.processes import RankResult

#: the file faulthandler writes this rank's stack to on SIGUSR1; open until the process ends
_stack_file: IO[str] | None = None


def _write(path: Path, record: RankResult) -> None:
    import cloudpickle  # a value made in fn (a lambda, a local class) comes back by value

    tmp = path.with_suffix(".tmp")
    try:
        data = cloudpickle.dumps(record)
    except Exception as err:  # the return value cannot be sent back
        name = type_name(record.value)
        data = pickle.dumps(RankResult(
            ok=False, finished_at=time.time(), exc_type="TypeError",
            message=f"the return value of rank {os.environ.get('RANK')} (a {name}) cannot be sent "
                    f"back (it must be picklable): {err}"))
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _dump_stack_on_sigusr1(workdir: Path, rank: int) -> None:
    global _stack_file
    if hasattr(signal, "SIGUSR1"):
        _stack_file = open(workdir / f"rank{rank}.stack", "w")  # kept open until the process ends
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


def _drain_before_destroy(dist: Any) -> None:
    """Make ``dist.destroy_process_group`` first give gloo's worker threads the GIL for a moment.

    Code that makes its own group (``launch(..., init="none")``, the PyTorch DDP tutorial) often
    calls ``destroy_process_group()`` right after a backward pass, with the DDP model still alive;
    the model then drops the last reference to the group when ``fn`` returns. A gloo worker thread
    that has just finished a gradient all-reduce still has to free that work, whose saved
    thread-local state holds a Python object (backward stashes a ``contextvars`` context there):
    it waits for the GIL. The group's destructor, running with the GIL, joins that thread:
    deadlock (in 2 of 3 runs of the tutorial, measured with torch 2.13). Sleeping a moment in
    ``destroy_process_group`` releases the GIL, so the worker threads finish first.
    """
    real = dist.destroy_process_group
    if getattr(real, "_drains", False):
        return

    @functools.wraps(real)
    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        time.sleep(_DRAIN_S)
        real(*args, **kwargs)

    destroy_process_group._drains = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


#: how long ``destroy_process_group`` releases the GIL before destroying (see above)
_DRAIN_S = 0.05
#: variables torch's C++ side reads once, when torch loads: a forked rank keeps the fork server's
#: values, whatever its launch's environment says (TORCH_DISTRIBUTED_DEBUG, read by Python, is
#: applied again in ``run``)
READ_AT_LOAD = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCH_CPP_LOG_LEVEL",
                "TORCH_SHOW_CPP_STACKTRACES", "TORCH_BLAS_PREFER_CUBLASLT",
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")


def forked(workdir: str, rank: int, env: dict[str, str]) -> None:
    """Entry point of a rank forked by the fork server: become a rank of its own, then run.

    The server was started once, with the environment of that moment, and has imported torch (and
    done no torch compute and never touched CUDA, so forking it is safe; a GPU rank initialises
    CUDA here, after the environment below, ``CUDA_VISIBLE_DEVICES`` included, is set). The rank
    takes a session of its own (so that ``launch`` can stop it and anything it starts as a whole),
    sends its stdout and stderr (C++ messages included) to its log file, and takes the launching
    process's current environment.
    """
    os.setsid()
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(Path(workdir) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    stale = [name for name in READ_AT_LOAD if os.environ.get(name) != env.get(name)]
    os.environ.clear()
    os.environ.update(env)
    os._exit(run(Path(workdir), rank, stale))


def main() -> None:
    """Entry point of a rank started as ``python -m course_utils.launcher.rank WORKDIR RANK``."""
    os._exit(run(Path(sys.argv[1]), int(sys.argv[2])))


def run(workdir: Path, rank: int, stale: list[str] | None = None) -> int:
    """Join the group, run ``fn``, write the result, tear down; return the exit code.

    ``stale``: variables of :data:`READ_AT_LOAD` whose value here differs from the launch's (a
    forked rank's); the rank fails with what to do rather than run with the old value.
    """
    _dump_stack_on_sigusr1(workdir, rank)
    result_path = workdir / f"rank{rank}.result"
    code = 0
    try:
        if stale:
            raise RuntimeError(
                f"{', '.join(stale)} changed after the fork server started, and torch reads it only "
                f"when it loads, so a forked rank cannot apply it: set it before this process's first "
                f"launch, or pass start='subprocess' to launch (fresh interpreters read it)")
        import torch
        import torch.distributed as dist

        from course_utils.devices import init_kwargs

        # Everything imported so far lives as long as the process: keep it out of the collector's
        # way, so that the gc.collect() before destroy (below, and in the rank functions) looks
        # only at what fn made, in milliseconds instead of 0.2 s a call.
        gc.freeze()
        _drain_before_destroy(dist)
        # torch.distributed read TORCH_DISTRIBUTED_DEBUG when it was imported: in a forked rank that
        # was the fork server's environment, not this launch's (set just before run)
        dist.set_debug_level_from_env()
        payload = pickle.loads((workdir / "payload.pkl").read_bytes())
        # the launching process's import path, as multiprocessing's spawn gives its children
        sys.path[:] = payload["sys_path"] + [p for p in sys.path if p not in payload["sys_path"]]
        fn, args = pickle.loads(payload["call"])
        torch.set_num_threads(payload["threads"])
        world_size, backend = payload["world_size"], payload["backend"]
        timeout = datetime.timedelta(seconds=payload["timeout_s"])
        # NCCL: bind this process to cuda:RANK before any CUDA work, and tell the group so
        bind = init_kwargs(backend, rank)
        if payload["init"] == "store":
            store = dist.FileStore(str(workdir / "rendezvous"), world_size)  # see launch's text
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, **bind)
            del store
        elif payload["init"] == "tcp":
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{payload['port']}",
                                    rank=rank, world_size=world_size, timeout=timeout, **bind)
        elif payload["init"] == "env":
            dist.init_process_group(backend, init_method="env://", timeout=timeout, **bind)
        value = fn(rank, world_size, *args)
        del payload, fn, args
        _write(result_path, RankResult(ok=True, finished_at=time.time(), value=value))
        del value
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 1
        _write(result_path, RankResult(ok=False, finished_at=time.time(), exc_type=type(exc).__name__,
                                       message=str(exc), traceback=traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        gc.collect()
        import torch.distributed as dist

        if dist.is_initialized():
            if code == 0:
                dist.barrier()  # nobody tears down while a peer still talks to it
            getattr(dist.destroy_process_group, "__wrapped__", dist.destroy_process_group)()
    except BaseException:  # noqa: BLE001 - the result is already written
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    main()
