"""The fork server that starts ``launch``'s ranks in a fraction of a second (notebook 05).

A fresh interpreter spends about 1.2 s importing torch, and DDP's first construction about 1.5 s
more importing ``torch._dynamo``. On Linux, ranks are therefore forked from a clean process that
``multiprocessing`` starts once, which imports those modules and does no torch compute, so forking
it is safe (fork after torch compute can deadlock the child). Its imports do not initialise CUDA
either: of ``torch.cuda`` they may call only ``_is_compiled``, which asks the build, not the driver
(``tests/test_preload_cuda.py`` watches every call they make), so a forked rank initialises CUDA
itself, as a fresh interpreter would: GPU machines fork their ranks too, NCCL's included (on
2026-11-27 every notebook and the gpu tests passed so on an H100, in about half the time they took
with fresh interpreters).

Where forking is unavailable (macOS, Windows), ranks start as fresh interpreters.
The environment variable ``COURSE_START=subprocess`` gives every launch that start on any machine,
so that a Linux machine can run the course as a Mac or Windows learner's machine starts its ranks
(``make stress`` runs every notebook so).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from typing import Any

from . import shared_server

__all__ = ["PRELOAD", "START_VARIABLE", "STARTS", "Forked", "RankProcess", "chosen_start",
           "forkserver_context", "fresh_starts", "internals_missing", "use_forkserver"]

#: How ``launch`` may start its ranks (its ``start=``).
STARTS = ("auto", "forkserver", "subprocess")
#: Set to ``subprocess`` to start the ranks of every launch that does not pass ``start=`` as fresh
#: interpreters, as they start off Linux (``forkserver`` and ``auto`` are accepted too).
START_VARIABLE = "COURSE_START"


#: What the fork server imports once, so that a forked rank need not: torch, c10d, what DDP's
#: first construction imports lazily (torch._dynamo, about 1.5 s on its own), and the course's
#: modules whose functions run on ranks. A forked rank that imports a module pays more than the
#: module's own import: every page of the server's memory the import writes to is copied first
#: (up to about 10 ms a rank for these, measured; 20 ms once, in the server). None of them
#: computes with torch when imported (forking after torch computed can deadlock the child).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.nn.parallel", "cloudpickle",
           "tomllib", "torch.distributed.algorithms.ddp_comm_hooks",
           "course_utils.launcher.rank", "course_utils.distributed", "course_utils.data",
           "course_utils.models", "course_utils.ddp.amp", "course_utils.ddp.by_hand_runs",
           "course_utils.ddp.by_hand_trials", "course_utils.ddp.demos", "course_utils.ddp.noise_scale",
           "course_utils.ddp.train", "course_utils.debugging.failure_zoo",
           "course_utils.debugging.training_bugs", "course_utils.exercises.all_reduces",
           "course_utils.exercises.answers", "course_utils.exercises.dispatched",
           "course_utils.exercises.nb06_ranks", "course_utils.exercises.nb10_between",
           "course_utils.exercises.nb12_ranks", "course_utils.exercises.on_ranks",
           "course_utils.faults.snapshots", "course_utils.faults.torchrun", "course_utils.sharding.runs"]


def chosen_start(start: str | None = None) -> str:
    """The start a launch uses: ``start`` when given, else the variable ``COURSE_START``, else ``"auto"``."""
    if start is None:
        start = os.environ.get(START_VARIABLE, "") or "auto"
        if start not in STARTS:
            raise ValueError(f"{START_VARIABLE} must be 'auto', 'forkserver' or 'subprocess', got {start!r}")
    elif start not in STARTS:
        raise ValueError(f"start must be 'auto', 'forkserver' or 'subprocess', got {start!r}")
    return start


def use_forkserver(start: str | None) -> bool:
    """Whether ``launch(start=start)`` forks its ranks from the fork server (any backend).

    ``start=None`` (launch's default) is ``COURSE_START``'s start, or ``"auto"`` without it.
    """
    start = chosen_start(start)
    available = "forkserver" in multiprocessing.get_all_start_methods()
    if start == "forkserver" and not available:
        raise ValueError("start='forkserver' is not available on this platform; use "
                         "start='subprocess'")
    missing = internals_missing() if available else []
    if start == "forkserver" and missing:
        raise ValueError(f"start='forkserver' needs multiprocessing internals this Python lacks "
                         f"({', '.join(missing)}); use start='subprocess'")
    if start != "auto":
        return start == "forkserver"
    # A script run by path keeps fresh interpreters under "auto", as it always has (ranks no
    # longer re-import it, see _RankPopen, so start="forkserver" suits it as well).
    main = sys.modules.get("__main__")
    main_is_safe = getattr(main, "__spec__", None) is not None or not hasattr(main, "__file__")
    # With a GPU too: the server never initialised CUDA, so each forked rank initialises it itself
    # (on the device that devices.init_kwargs binds it to), under gloo and NCCL alike.
    fork = available and sys.platform == "linux" and main_is_safe
    if fork and missing:
        _note_once(f"launch: this Python's multiprocessing lacks {', '.join(missing)}, which the fork "
                   f"server relies on; ranks start as fresh interpreters instead (same results, "
                   f"about a second slower each)")
        return False
    return fork


def fresh_starts() -> bool:
    """Whether a launch that passes no ``start=`` starts its ranks here as fresh interpreters, each
    importing torch first (a second or more per rank: what a limit on a launch must allow for)."""
    return not use_forkserver(None)


_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    if message not in _NOTED:
        _NOTED.add(message)
        print(message, file=sys.stderr, flush=True)


def internals_missing() -> list[str]:
    """The CPython internals of ``multiprocessing`` that :class:`RankProcess` relies on and this
    Python lacks (private names, which a Python release may change): empty where all are there."""
    if RankProcess is None:
        return ["multiprocessing.popen_forkserver"]
    popen = getattr(_popen_forkserver, "Popen", None)
    needed = {"multiprocessing.spawn.get_preparation_data": getattr(_spawn, "get_preparation_data", None),
              "multiprocessing.popen_forkserver.Popen._launch": getattr(popen, "_launch", None),
              "multiprocessing.context.ForkServerProcess": getattr(_mp_context, "ForkServerProcess", None)}
    return [name for name, found in needed.items() if not callable(found)]


def forkserver_context() -> Any:
    """multiprocessing's fork server, told to preload what a rank needs when it first starts.

    The server is one per process and shared with anything else that uses it (a ``DataLoader``
    with ``multiprocessing_context="forkserver"``, say). If it is already running, its preload
    list stays as it was: ranks then still work, and import the rest themselves.
    """
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


_PREPARING = threading.Lock()

try:  # the fork server exists on POSIX systems only; these are CPython internals (internals_missing)
    from multiprocessing import context as _mp_context
    from multiprocessing import popen_forkserver as _popen_forkserver
    from multiprocessing import spawn as _spawn
except ImportError:  # pragma: no cover - Windows
    RankProcess: Any = None
else:
    class _RankPopen(getattr(_popen_forkserver, "Popen", object)):  # type: ignore[misc]
        """Starts a fork-server child that does not re-import ``__main__``.

        multiprocessing's children import the parent's ``__main__`` again (a script run by path
        runs once more, as ``__mp_main__``; a kernel imports ``ipykernel_launcher``), so that
        functions pickled by reference from ``__main__`` can be found. A rank needs none of that:
        ``fn`` comes by value in ``payload.pkl``, and the target is ``rank.forked``. Leaving it
        out lets a script without an ``if __name__ == "__main__":`` guard run once, and saves the
        import. (The preparation data is built by ``spawn.get_preparation_data``; it is replaced
        for the moment of the start.)
        """

        def _launch(self, process_obj: Any) -> None:
            connect = shared_server.connector()  # a test session's one server, if it names one
            if connect is not None:
                try:
                    self._launch_with(process_obj, connect)
                    return
                except shared_server.Unreachable as error:  # this process starts a server of its own
                    shared_server.unreachable(error)
            self._launch_with(process_obj, None)

        def _launch_with(self, process_obj: Any, connect: Any) -> None:
            with _PREPARING:
                prepare = _spawn.get_preparation_data
                own = _popen_forkserver.forkserver.connect_to_new_process

                def without_main(name: str) -> dict:
                    data = prepare(name)
                    data.pop("init_main_from_path", None)
                    data.pop("init_main_from_name", None)
                    return data

                _spawn.get_preparation_data = without_main
                if connect is not None:
                    _popen_forkserver.forkserver.connect_to_new_process = connect
                try:
                    super()._launch(process_obj)
                finally:
                    _spawn.get_preparation_data = prepare
                    _popen_forkserver.forkserver.connect_to_new_process = own

    class RankProcess(getattr(_mp_context, "ForkServerProcess", object)):  # type: ignore[no-redef,misc]
        """A fork-server ``Process`` started by :class:`_RankPopen`."""

        @staticmethod
        def _Popen(process_obj: Any) -> _RankPopen:
            return _RankPopen(process_obj)


class Forked:
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
