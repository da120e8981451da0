"""One fork server for a whole test session: its pytest workers and notebook kernels fork from it.

Each process that launches forked ranks starts a fork server of its own, which imports torch and
the modules of ``PRELOAD`` (about 3 CPU-s). A learner's kernel starts one; ``make test`` started
about fourteen (one per pytest worker and per notebook kernel), some 45 CPU-s on 2 cores. So the
test session's first process calls :func:`publish`: it starts its fork server and names it in the
variable ``COURSE_FORKSERVER``, which every process started from it inherits. A launch in such a
process (see ``forkserver._RankPopen``) asks that server for its ranks instead of starting its own.

A rank forked so is the same as one forked by a server of its own: ``launch`` sends it its
environment, ``sys.path`` and working folder, and it makes a session of its own. Its parent is the
shared server, not the launching process. Nothing here runs for a learner, unless the variable is
set by hand. If the named server cannot be reached, the launch says so once (on stderr) and starts
a server of its own.

The client speaks ``multiprocessing``'s own protocol, through its ``ForkServer`` class given the
published server's address (and its key, on a Python whose server has one): CPython internals,
checked by :func:`available` like those of ``forkserver.internals_missing``, and tried on the
pinned Python 3.11 only.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["VARIABLE", "Unreachable", "available", "connector", "publish", "unreachable"]

#: The variable that names the shared fork server (JSON: its address, key, pid, Python and course_utils).
VARIABLE = "COURSE_FORKSERVER"


class Unreachable(Exception):
    """The named server did not take a connection (it ended, or the name is stale)."""


_LOCK = threading.Lock()
_CLIENT: dict[str, Any] = {}  # the variable's value -> the client made for it (None: unreachable)


def available() -> bool:
    """Whether this Python's ``multiprocessing`` has the internals a shared server relies on."""
    try:
        from multiprocessing import forkserver, resource_tracker
    except ImportError:  # pragma: no cover - Windows
        return False
    server = getattr(forkserver, "_forkserver", None)
    return (sys.platform != "win32" and callable(getattr(forkserver, "ForkServer", None))
            and callable(getattr(resource_tracker, "ensure_running", None))
            and all(hasattr(server, name) for name in ("_forkserver_address", "_forkserver_pid",
                                                       "_forkserver_alive_fd", "ensure_running")))


def publish(preload: list[str]) -> bool:
    """Start this process's fork server (preloading ``preload``) and name it in ``COURSE_FORKSERVER``
    for the processes started from here; returns whether it did. A server already named there is
    kept (a pytest started by a test of the session, say)."""
    if os.environ.get(VARIABLE) or not available():
        return False
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(preload)
    forkserver.ensure_running()
    server = forkserver._forkserver
    key = getattr(server, "_forkserver_authkey", None)
    os.environ[VARIABLE] = json.dumps({"address": server._forkserver_address,
                                       "key": key.hex() if key else None,
                                       "pid": server._forkserver_pid, **_interpreter()})
    return True


def _interpreter() -> dict[str, str]:
    """What a process must share with the server to fork from it: the same Python, and the same
    course_utils (a rank uses the server's imported modules, torch's release included)."""
    import course_utils

    return {"python": os.path.realpath(sys.executable),
            "course_utils": os.path.realpath(os.path.dirname(course_utils.__file__))}


def connector() -> Callable[[list[int]], tuple[int, int]] | None:
    """``connect_to_new_process`` of the server that ``COURSE_FORKSERVER`` names, or None where
    none is named, this Python lacks the internals, or the server was found unreachable."""
    value = os.environ.get(VARIABLE, "")
    if not value:
        return None
    with _LOCK:
        if value not in _CLIENT:
            _CLIENT[value] = _client(value)
        client = _CLIENT[value]
    if client is None:
        return None

    def connect(fds: list[int]) -> tuple[int, int]:
        try:
            return client.connect_to_new_process(fds)
        except OSError as error:  # before anything was sent: the launch can start its own server
            raise Unreachable(f"{type(error).__name__}: {error}") from error

    return connect


def unreachable(error: Unreachable) -> None:
    """Note that the named server did not answer; later launches of this process start their own."""
    with _LOCK:
        for value in _CLIENT:
            _CLIENT[value] = None
    print(f"launch: the fork server named in {VARIABLE} did not answer ({error}); this process "
          f"starts a fork server of its own", file=sys.stderr, flush=True)


def _client(value: str) -> Any:
    if not available():
        return None
    try:
        named = json.loads(value)
        address, key, pid = named["address"], named.get("key"), int(named["pid"])
    except (ValueError, KeyError, TypeError):
        print(f"launch: {VARIABLE} is not a fork server's name ({value[:80]!r}); ignored",
              file=sys.stderr, flush=True)
        return None
    if any(named.get(name, found) != found for name, found in _interpreter().items()):
        return None  # another Python or another course_utils (make compat's releases): its own server
    from multiprocessing import forkserver, resource_tracker

    class Client(forkserver.ForkServer):  # type: ignore[misc, valid-type]
        """The published server, seen from a process that did not start it."""

        def ensure_running(self) -> None:  # the server is not this process's child: no waitpid
            resource_tracker.ensure_running()

    client = Client()
    client._forkserver_address = address
    client._forkserver_pid = pid
    # the server hands this descriptor to each rank as its own "alive" pipe, which a rank never
    # uses unless it starts a fork server itself; the owner's pipe is what keeps the server alive
    client._forkserver_alive_fd = os.open(os.devnull, os.O_WRONLY)
    if key:
        client._forkserver_authkey = bytes.fromhex(key)
    return client
