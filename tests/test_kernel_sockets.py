"""The course's notebook runs reach their kernels through socket files (course_utils/tools/kernels.py):
over TCP, a port that another connection takes between Jupyter's choice and the kernel's bind kills
the kernel, and nbval reports "Kernel died before replying to kernel_info"."""

import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import nbval.kernel
import pytest
import zmq
from jupyter_client import AsyncKernelManager, KernelManager
from jupyter_client.provisioning import local_provisioner

from course_utils.tools import kernels, nbtools

needs_socket_files = pytest.mark.skipif(sys.platform == "win32" or not zmq.has("ipc"),
                                        reason="Windows, or a ZeroMQ without Unix sockets: TCP kernels")


def _shut(manager, client=None):
    if client is not None:
        client.stop_channels()
    if manager.has_kernel:
        manager.shutdown_kernel(now=True)


@needs_socket_files
def test_nbval_and_the_course_tools_make_kernels_that_use_socket_files():
    blocking, asynchronous = kernels.kernel_manager_class(asynchronous=False), kernels.kernel_manager_class()
    assert nbval.kernel.KernelManager is blocking  # tests/conftest.py (and tests/early_plugin.py) set it
    assert issubclass(blocking, KernelManager) and issubclass(asynchronous, AsyncKernelManager)
    managers = [cls(kernel_name="python3") for cls in (blocking, blocking, asynchronous)]
    assert [m.transport for m in managers] == ["ipc"] * 3
    assert len({m.ip for m in managers}) == 3  # no two kernels pick from the same names
    for manager in managers:
        assert manager.ip.startswith(os.path.join(tempfile.gettempdir(), kernels.SOCKET_PREFIX))


def test_over_tcp_a_port_taken_before_the_kernel_binds_it_kills_the_kernel(monkeypatch):
    """What the socket files avoid: Jupyter chooses the ports first, the kernel binds them later."""
    start, taken = local_provisioner.launch_kernel, socket.socket()

    def launch_kernel(cmd, **kwargs):  # between the choice and the kernel's bind, a connection takes one
        info = json.loads(Path(cmd[cmd.index("-f") + 1]).read_text())
        taken.bind((info["ip"], info["shell_port"]))
        taken.listen()
        return start(cmd, **kwargs)

    monkeypatch.setattr(local_provisioner, "launch_kernel", launch_kernel)
    manager, client = KernelManager(kernel_name="python3"), None
    try:
        manager.start_kernel()
        client = manager.client()
        client.start_channels()
        with pytest.raises(RuntimeError, match="Kernel died before replying to kernel_info"):
            client.wait_for_ready(timeout=60)
    finally:
        taken.close()
        _shut(manager, client)


@needs_socket_files
def test_a_kernel_over_socket_files_runs_a_notebook_and_leaves_no_file_behind(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    client = NotebookClient(nb, kernel_manager_class=kernels.kernel_manager_class(), kernel_name="python3",
                            timeout=60, resources={"metadata": {"path": str(tmp_path)}})
    seen = {}

    def while_it_runs(**_):  # the kernel's sockets are files of its own name
        seen["transport"], seen["ip"] = client.km.get_connection_info()["transport"], client.km.ip
        seen["files"] = sorted(glob.glob(client.km.ip + "-*"))

    client.on_cell_executed = while_it_runs
    client.execute()  # nbclient made the kernel, and stops it at the end
    assert nb.cells[0].outputs[0]["text"] == "42\n"
    assert seen["transport"] == "ipc" and len(seen["files"]) == 5, seen
    assert glob.glob(seen["ip"] + "-*") == []  # removed when the kernel shut down


@needs_socket_files
def test_make_execute_compat_and_gpu_check_start_their_kernels_so(tmp_path, monkeypatch):
    """nbtools.run_in_memory (make compat, make gpu-check) and nbtools.execute_notebook (make execute)."""
    made = []
    cls = kernels.kernel_manager_class()

    class Recording(cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            made.append(self)

    monkeypatch.setattr(nbtools, "kernel_manager_class", lambda: Recording)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('ran')")])
    error, _ = nbtools.run_in_memory(nb, tmp_path, 60)
    path = tmp_path / "one.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('ran')")]), path)
    nbtools.execute_notebook(path, timeout=60)
    assert error == "" and "ran" in nbformat.read(path, as_version=4).cells[0].outputs[0]["text"]
    assert [m.transport for m in made] == ["ipc", "ipc"]
    assert [glob.glob(m.ip + "-*") for m in made] == [[], []]  # nbclient stopped them: files removed



def test_the_hook_loads_when_pytest_runs_from_outside_the_repository(tmp_path):
    """As make compat runs its launch tests (from the temporary folder, the repository named by
    -c and --rootdir): tests/conftest.py must find tests/early_plugin.py there too."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                           "-c", str(root / "pyproject.toml"), "--rootdir", str(root),
                           str(root / "tests" / "test_kernel_sockets.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "INTERNALERROR" not in done.stdout, done.stdout[-2000:]
