"""What each rank of ``distributed.launch`` runs, in a process of its own.

A rank starts one of two ways: forked by the fork server (``forked``, the fast way on Linux),
or as a fresh interpreter, ``python -m course_utils._rank WORKDIR RANK`` (``main``). Either way
it reads the launch's payload, joins the process group, runs ``fn(rank, world_size, *args)`` and
writes ``("ok", value, None, None, time)`` or ``("error", type, message, traceback, time)`` to
``WORKDIR/rank{RANK}.result``, atomically. It then tears the group down, dropping every object
first (a DDP model alive at teardown can make gloo abort at exit), and leaves with ``os._exit`` so
that no interpreter shutdown runs after the result is safe.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import sys
import time
import traceback
from pathlib import Path


def _write(path: Path, record: tuple) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        data = pickle.dumps(record)
    except Exception as err:  # the return value cannot be sent back
        data = pickle.dumps(("error", "TypeError",
                             f"the return value of rank {os.environ.get('RANK')} cannot be sent "
                             f"back (it must be picklable): {err}", "", time.time()))
    tmp.write_bytes(data)
    os.replace(tmp, path)


def forked(workdir: str, rank: int, env: dict[str, str]) -> None:
    """Entry point of a rank forked by the fork server: become a rank of its own, then run.

    The server was started once, with the environment of that moment, and has imported torch (and
    done no torch compute, so forking it is safe). The rank takes a session of its own (so that
    ``launch`` can stop it and anything it starts as a whole), sends its stdout and stderr (C++
    messages included) to its log file, and takes the launching process's current environment.
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
    os.environ.clear()
    os.environ.update(env)
    os._exit(run(Path(workdir), rank))


def main() -> None:
    """Entry point of a rank started as ``python -m course_utils._rank WORKDIR RANK``."""
    os._exit(run(Path(sys.argv[1]), int(sys.argv[2])))


def run(workdir: Path, rank: int) -> int:
    """Join the group, run ``fn``, write the result, tear down; return the exit code."""
    result_path = workdir / f"rank{rank}.result"
    code = 0
    try:
        import torch
        import torch.distributed as dist

        from course_utils.devices import init_kwargs

        payload = pickle.loads((workdir / "payload.pkl").read_bytes())
        torch.set_num_threads(payload["threads"])
        world_size, backend = payload["world_size"], payload["backend"]
        timeout = datetime.timedelta(seconds=payload["timeout_s"])
        # NCCL: bind this process to cuda:RANK before any CUDA work, and tell the group so
        bind = init_kwargs(backend, rank)
        if payload["init"] == "store":
            store = dist.TCPStore("127.0.0.1", payload["port"], None, False, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout, **bind)
            del store
        elif payload["init"] == "tcp":
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{payload['port']}",
                                    rank=rank, world_size=world_size, timeout=timeout, **bind)
        else:
            dist.init_process_group(backend, init_method="env://", timeout=timeout, **bind)
        value = payload["fn"](rank, world_size, *payload["args"])
        del payload
        _write(result_path, ("ok", value, None, None, time.time()))
        del value
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 1
        _write(result_path, ("error", type(exc).__name__, str(exc), traceback.format_exc(),
                             time.time()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        gc.collect()
        import torch.distributed as dist

        if dist.is_initialized():
            if code == 0:
                dist.barrier()  # nobody tears down while a peer still talks to it
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the result is already written
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    main()
