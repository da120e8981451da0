"""The kernel manager of the course's own notebook runs: ``make test``, ``make stress`` and ``make
nbval`` (nbval's kernels, through ``tests/early_plugin.py``), ``make execute``, ``make compat`` and
``make gpu-check`` (nbclient's, through :mod:`.nbtools`). JupyterLab's kernels are left as they are.

Jupyter reaches a kernel over five TCP ports by default, and chooses them before the kernel starts:
it binds each to port 0, reads the number the system gave and closes it; the kernel binds the same
numbers again once it has started, a second or more later. Those numbers come from the range that
every outgoing connection of the machine takes its local port from, and while the notebooks run,
gloo's ranks open many connections. If one of them takes a kernel's number in that second, the
kernel cannot bind it and exits, and nbval reports "Kernel died before replying to kernel_info"
(``tests/test_kernel_sockets.py`` takes a port so and gets that error). ``make stress`` reported
exactly that once, on 2026-11-28, for notebook 00 of its fresh-interpreter pass while other
notebooks' ranks ran; the kernel's own error was not kept, and a taken port is the cause known
to end a kernel there. On Linux and macOS, where ZeroMQ has Unix sockets, these kernels use them
instead: each kernel's sockets are files under a name of its own, which no connection can take.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import uuid
from typing import Any

__all__ = ["SOCKET_PREFIX", "kernel_manager_class"]

#: the start of each kernel's socket files' names, in the temporary folder
SOCKET_PREFIX = "course-kernel-"
#: a Unix socket's path holds at most 107 bytes on Linux and 103 on macOS, with "-N" appended here
_MAX_PATH = 100


def _socket_base() -> str:
    """A path that no other kernel uses: ZeroMQ appends "-1" to "-5" for the kernel's sockets."""
    return os.path.join(tempfile.gettempdir(), f"{SOCKET_PREFIX}{uuid.uuid4().hex[:16]}")


@functools.cache
def kernel_manager_class(asynchronous: bool = True) -> type[Any]:
    """jupyter_client's ``AsyncKernelManager`` (nbclient's; with ``asynchronous=False`` the
    blocking ``KernelManager``, nbval's), whose kernels use Unix sockets (ZeroMQ's ``ipc``
    transport) named by :func:`_socket_base`. The class itself (TCP) on Windows, where ZeroMQ has
    no Unix sockets, or where the temporary folder's path is too long for one. nbclient needs the
    asynchronous one: with a blocking client, waiting for a kernel's output holds its event loop,
    and a notebook's time limit never fires."""
    import zmq
    from jupyter_client.manager import AsyncKernelManager, KernelManager
    from traitlets import default

    base = AsyncKernelManager if asynchronous else KernelManager
    if sys.platform == "win32" or not zmq.has("ipc") or len(_socket_base()) > _MAX_PATH:
        return base

    class SocketFileKernelManager(base):  # type: ignore[misc,valid-type]
        """A kernel reached through socket files of its own, not through TCP ports."""

        @default("transport")
        def _default_transport(self) -> str:
            return "ipc"

        def _ip_default(self) -> str:  # jupyter_client's default is "kernel-ipc" in the current folder
            return _socket_base()

    return SocketFileKernelManager
