"""A check's time limit: the learner's code is stopped once it has run an exercise's
``time_limit`` (SIGALRM in the main thread, else a watchdog thread), and what a judge wraps in
:func:`untimed` (the course's own reference computations, ranks with their launch timeout) does
not count. ``core.verdict`` runs every judge through :func:`_within_limit`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["untimed"]


class _Stopped(BaseException):
    """Raised inside the learner's code when a check's time runs out. A BaseException, so that an
    answer's own ``except Exception`` does not swallow it."""


class _Limit:
    """The time limit of the check in progress: a clock that ``untimed`` can pause."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.used = 0.0  # timed seconds so far
        self.paused = 0  # depth of untimed blocks
        self.since = 0.0  # when the clock last started
        self.armed = False  # while True, running out raises _Stopped in the learner's code
        self.alarm = False  # SIGALRM does the stopping (else a watchdog, see _run_in_thread)
        self.thread = threading.get_ident()  # the thread that runs the judge
        self.pid = os.getpid()  # a process forked by the answer (a loader's worker) is not checked

    def mine(self) -> bool:
        """Whether the code running now is the check's: its process, and the judge's thread."""
        return os.getpid() == self.pid and threading.get_ident() == self.thread

    def left(self) -> float:
        running = 0.0 if self.paused else time.monotonic() - self.since
        return self.seconds - self.used - running

    def start(self) -> None:
        self.since = time.monotonic()
        if self.alarm:
            # repeat every 0.2 s: an answer that catches the first stop is stopped again
            signal.setitimer(signal.ITIMER_REAL, max(self.left(), 0.001), 0.2)

    def stop(self) -> None:
        if self.alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        self.used += time.monotonic() - self.since


_LIMIT: _Limit | None = None  # the check in progress (checks run one at a time)
_LAST: _Limit | None = None  # the last check's clock (the tests read how long it took)


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Inside a judge: what runs in this block does not count against the check's time limit.

    For work that needs no limit: the course's own reference computations, and ranks, which
    ``run_on_ranks`` runs with the launch timeout. Never wrap the learner's code in it.
    """
    limit = _LIMIT
    if limit is None or not limit.armed or not limit.mine():
        yield  # no check in progress, or another thread (a replica's, the kernel's) or process
        return
    if not limit.paused:
        limit.stop()
    limit.paused += 1
    try:
        yield
    finally:
        limit.paused -= 1
        if not limit.paused:
            limit.start()


def _guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: the one frame under which a check's time limit may stop the code running."""
    return fn(*args)


def _on_alarm(signum: int, frame: Any) -> None:
    """SIGALRM: raise _Stopped, but only inside the judge's call (never in the check's own clean-up,
    whatever instruction the signal lands on)."""
    limit = _LIMIT
    if limit is None or not limit.armed or limit.paused or os.getpid() != limit.pid:
        return
    while frame is not None:
        if frame.f_code is _guarded.__code__:
            raise _Stopped
        frame = frame.f_back


def _alarm_usable() -> bool:
    """SIGALRM can stop the answer: POSIX, the main thread (where Python runs signal handlers; a
    Jupyter kernel runs cells there), and nobody else's alarm or handler in place."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return False
    return (signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None))


def _run_in_thread(limit: _Limit, fn: Callable[..., Any], *args: Any) -> Any:
    """Where signals cannot stop the answer (Windows, or a check called outside the main thread):
    run it in a thread and, when the time runs out, raise _Stopped in that thread between two of
    its Python instructions. An answer stuck inside one long C call (a huge matrix product, a
    blocking read) cannot be stopped that way: the check still comes back with its hint, and the
    thread finishes in the background."""
    import ctypes

    outcome: dict[str, Any] = {}

    def target() -> None:
        limit.thread = threading.get_ident()
        try:
            outcome["value"] = _guarded(fn, *args)
        except BaseException as err:  # noqa: BLE001 - handed to the caller as it is
            outcome["error"] = err

    worker = threading.Thread(target=target, name="exercise-check", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.02)
        if worker.is_alive() and not limit.paused and limit.left() <= 0:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident),
                                                       ctypes.py_object(_Stopped))
            worker.join(1.0)
            raise _Stopped
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _within_limit(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, stopped with _Stopped once it has run ``seconds`` (untimed blocks excluded)."""
    global _LIMIT, _LAST
    import builtins

    limit = _LIMIT = _LAST = _Limit(seconds)
    limit.alarm = _alarm_usable()
    previous = signal.signal(signal.SIGALRM, _on_alarm) if limit.alarm else None
    real_import = builtins.__import__

    def untimed_import(*args: Any, **kwargs: Any) -> Any:
        """Imports are not the learner's code, and a stop in the middle of one would leave a module
        half-initialised for the rest of the session: they run untimed."""
        with untimed():
            return real_import(*args, **kwargs)

    builtins.__import__ = untimed_import
    try:
        limit.armed = True
        limit.start()
        if limit.alarm:
            return _guarded(fn, *args)
        return _run_in_thread(limit, fn, *args)
    finally:
        limit.armed = False
        if limit.alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        if builtins.__import__ is untimed_import:
            builtins.__import__ = real_import
        if not limit.paused:
            limit.used += time.monotonic() - limit.since
        _LIMIT = None
