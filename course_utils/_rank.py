"""The program each rank runs: ``python -m course_utils._rank WORKDIR RANK`` (see distributed.launch).

It reads the launch's payload, joins the process group, runs ``fn(rank, world_size, *args)`` and
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


def main() -> None:
    workdir, rank = Path(sys.argv[1]), int(sys.argv[2])
    result_path = workdir / f"rank{rank}.result"
    code = 0
    try:
        import torch
        import torch.distributed as dist

        payload = pickle.loads((workdir / "payload.pkl").read_bytes())
        torch.set_num_threads(payload["threads"])
        world_size, backend = payload["world_size"], payload["backend"]
        timeout = datetime.timedelta(seconds=payload["timeout_s"])
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if payload["init"] == "store":
            store = dist.TCPStore("127.0.0.1", payload["port"], None, False, timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
            del store
        elif payload["init"] == "tcp":
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{payload['port']}",
                                    rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
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
    os._exit(code)


if __name__ == "__main__":
    main()
