"""A notebook's Jupyter kernel forked from the test session's fork server (``make test``).

A kernel that starts fresh imports torch and the course's modules before its first cell finishes:
about 3 CPU-s, and ``make test`` starts some eighteen kernels (a notebook each, and the tests that
run one). The session's fork server (``shared_server``) has imported them already. So in a test
session, ``tests/conftest.py`` has Jupyter run ``python -m course_utils.launcher.kernel`` where it
would run ``python -m ipykernel_launcher`` (:func:`command`). That process (the *stand-in*, which
imports neither torch nor ipykernel) asks the server to fork the kernel, hands it its standard
streams, its environment, ``sys.path`` and folder, and then stands in for it: it passes every signal
Jupyter sends on to the kernel's process group (an interrupt is SIGINT), and exits as the kernel
exits. If the stand-in dies (Jupyter kills its process group when a kernel will not shut down),
the kernel sees its pipe close and kills its own process group, as that kill would have.

The kernel itself runs ``ipykernel_launcher`` as ``python -m`` would, in a session of its own, with
NumPy's global random generator seeded afresh. What differs from a fresh kernel: the server's
modules (torch, the course's rank modules, pytest and psutil) are loaded before the first cell and
frozen out of the collector's way (``gc.freeze``), and the kernel shares the server's seed for
string hashes. A learner never gets one: nothing outside a test session names a server, and with
no server named, or fresh starts asked for (``COURSE_START=subprocess``: ``make stress`` validates
every notebook so, in fresh kernels), the stand-in becomes an ordinary kernel (it ``exec``\\ s
``ipykernel_launcher``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from typing import Any

__all__ = ["MODULE", "command", "main"]

#: The stand-in's module: ``python -m course_utils.launcher.kernel -f CONNECTION_FILE``.
MODULE = "course_utils.launcher.kernel"

#: The signals the stand-in passes on (Jupyter interrupts with SIGINT and ends with SIGTERM).
FORWARDED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT",
                                                     "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


def command(cmd: list[str]) -> list[str]:
    """The command a test session starts for the kernel command ``cmd``: the stand-in, where
    ``cmd`` runs ``ipykernel_launcher`` in this Python; else ``cmd`` unchanged."""
    if len(cmd) < 3 or list(cmd[1:3]) != ["-m", "ipykernel_launcher"]:
        return list(cmd)
    found = shutil.which(cmd[0])
    # the same folder, not the same file: another venv's python links to the same interpreter
    here = os.path.dirname(os.path.abspath(sys.executable))
    if found is None or os.path.dirname(os.path.abspath(found)) != here:
        return list(cmd)
    return [sys.executable, "-m", MODULE, *cmd[3:]]


class _Fd:
    """A descriptor that travels to the forked kernel (through the fork server's socket)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        from multiprocessing import reduction

        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _fresh(args: list[str]) -> None:
    """Become an ordinary kernel, started as Jupyter would have started it."""
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *args])


def main(args: list[str]) -> int:
    """The stand-in: fork the kernel from the session's server, pass signals on, exit as it exits."""
    from . import forkserver, shared_server

    if forkserver.RankProcess is None or forkserver.fresh_starts() or shared_server.connector() is None:
        _fresh(args)
        return 1  # execv does not return
    alive_r, alive_w = os.pipe()  # the kernel's end closes for good only when this process ends
    streams = [_Fd(fd) if _is_open(fd) else None for fd in (0, 1, 2)]
    kernel = forkserver.RankProcess(target=_kernel, name="kernel",
                                    args=(args, dict(os.environ), streams, _Fd(alive_r)))
    kernel.start()
    os.close(alive_r)

    def forward(signum: int, frame: Any) -> None:
        try:
            os.killpg(kernel.pid, signum)  # the kernel's group: the kernel and what it started
        except ProcessLookupError:
            try:  # before the kernel made its session
                os.kill(kernel.pid, signum)
            except ProcessLookupError:
                pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    parent = os.getppid()
    while kernel.exitcode is None:
        kernel.join(1.0)
        if os.getppid() != parent:  # Jupyter's process ended: a fresh kernel's poller would see it
            return 1  # and so does the kernel, as this process ends (``_die_with``)
    code = kernel.exitcode
    if code < 0:  # killed by a signal: so is the stand-in, for whoever waits on it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _die_with(alive: int) -> None:
    """The kernel's watch on its stand-in: when the stand-in ends, so does the kernel's group."""
    while os.read(alive, 1):
        pass
    os.killpg(0, signal.SIGKILL)


def _kernel(args: list[str], env: dict[str, str], streams: list[int | None], alive: int) -> None:
    """In the forked process: become the kernel that ``python -m ipykernel_launcher`` would be."""
    import atexit
    import gc
    import itertools
    import multiprocessing.process
    import runpy
    import threading

    os.setsid()
    for target, fd in enumerate(streams):
        if fd is None:  # closed in the stand-in: the kernel gets /dev/null there
            fd = os.open(os.devnull, os.O_RDWR)
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - multiprocessing left /dev/null there
    os.environ.clear()
    os.environ.update(env)
    threading.Thread(target=_die_with, args=(alive,), name="kernel-stand-in-watch", daemon=True).start()
    # a process of its own, as a fresh kernel is: not multiprocessing's child, and not the server's
    # NumPy random state (Python's own reseeds itself after a fork)
    me = multiprocessing.process.current_process()  # named and numbered as a main process
    me._identity, me._name, me._parent_pid, me._parent_name = (), "MainProcess", None, None
    multiprocessing.process._parent_process = None
    multiprocessing.process._children = set()
    multiprocessing.process._process_counter = itertools.count(1)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    # the server's modules (about 300,000 objects) stay for the kernel's life: out of its collector's
    # way, or each full collection spends some 0.15 CPU-s on them (measured), and writes to their pages
    gc.freeze()
    sys.argv = [sys.argv[0], *args]
    code: Any = 0
    try:
        runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001 - what an interpreter prints before it exits with 1
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":
    from course_utils.launcher import kernel  # by its name: the kernel's function travels by reference

    code = kernel.main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: multiprocessing's exit handler would wait for the kernel
