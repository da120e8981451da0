"""The test session's notebook kernels fork from its fork server (course_utils/launcher/kernel.py):
each behaves as a fresh kernel does to whoever starts, interrupts, stops or kills it, and leaves
nothing behind."""

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from jupyter_client import KernelManager
from jupyter_client.provisioning import local_provisioner

from course_utils.launcher import kernel, shared_server

PROBE = ("import gc, json, os, sys, multiprocessing as mp\n"
         "print(json.dumps({'torch': 'torch' in sys.modules, 'ppid': os.getppid(), 'pid': os.getpid(),"
         " 'frozen': gc.get_freeze_count(),"
         " 'leads_session': os.getsid(0) == os.getpid(), 'name': mp.current_process().name,"
         " 'parent': mp.parent_process() is not None, 'path': sys.path, 'cwd': os.getcwd(),"
         " 'argv0': os.path.basename(sys.argv[0]), 'mark': os.environ.get('KERNEL_TEST_MARK'),"
         " 'numpy_draw': __import__('numpy').random.randint(2**31)}))")


def _run(client, code, timeout=60):
    out, errors = [], []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            errors.append(msg["content"]["ename"])

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    return "".join(out), errors, reply["content"]["status"]


@pytest.fixture
def started(tmp_path, monkeypatch):
    """Start kernels as nbval does (here, in tmp_path); shut down whatever a test left running."""
    managers = []
    monkeypatch.setenv("KERNEL_TEST_MARK", "passed on")

    def start(cwd=tmp_path):
        manager = KernelManager(kernel_name="python3")
        manager.start_kernel(cwd=str(cwd))
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        managers.append((manager, client))
        return manager, client

    yield start
    for manager, client in managers:
        client.stop_channels()
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)


def _mine(msg, msg_id, kind):
    return msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == kind


def _gone(pid, timeout=15.0):
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def test_only_this_python_s_ipykernel_is_replaced(tmp_path):
    rest = ["-f", "{connection_file}"]
    other_env = tmp_path / "python"  # another venv's python: a link to the same interpreter
    other_env.symlink_to(os.path.realpath(sys.executable))
    assert kernel.command([str(other_env), "-m", "ipykernel_launcher", *rest])[0] == str(other_env)
    assert kernel.command([sys.executable, "-m", "ipykernel_launcher", *rest]) == [
        sys.executable, "-m", kernel.MODULE, *rest]
    assert kernel.command(["/no/such/python", "-m", "ipykernel_launcher", *rest])[0] == "/no/such/python"
    assert kernel.command([sys.executable, "-m", "other_kernel", *rest])[1:3] == ["-m", "other_kernel"]
    assert kernel.command(["R", "--slave"]) == ["R", "--slave"]


def test_the_session_forks_its_kernels():
    """make test's processes name a server and start the stand-in (tests/conftest.py)."""
    assert os.environ.get(shared_server.VARIABLE), "make test names its fork server"
    assert getattr(local_provisioner.launch_kernel, "forks_kernels", False)


def test_a_forked_kernel_looks_to_its_cells_as_a_fresh_one_does(started, tmp_path):
    manager, client = started()
    out, errors, status = _run(client, PROBE)
    assert (errors, status) == ([], "ok")
    seen = json.loads(out)
    server = json.loads(os.environ[shared_server.VARIABLE])["pid"]
    stand_in = manager.provisioner.process.pid
    assert seen["torch"] and seen["ppid"] == server and seen["pid"] != stand_in  # forked: torch loaded
    assert seen["frozen"] > 100_000  # the server's objects, frozen out of the kernel's collector
    assert seen["leads_session"] and seen["name"] == "MainProcess" and not seen["parent"]
    assert seen["cwd"] == str(tmp_path) and seen["mark"] == "passed on"
    assert seen["argv0"] == "ipykernel_launcher.py"
    # the path of a fresh interpreter started in that folder, less the folder itself, which
    # ipykernel_launcher takes off (IPython then adds '' in a fresh kernel and a forked one alike)
    fresh = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                           cwd=tmp_path, capture_output=True, text=True, check=True)
    expected = json.loads(fresh.stdout)
    assert [p for p in seen["path"] if p][:len(expected)] == expected, (seen["path"], expected)
    assert str(tmp_path) not in seen["path"]
    out, errors, status = _run(client, "import numpy, matplotlib.pyplot as plt\nprint(plt.get_backend())")
    assert (errors, status) == ([], "ok") and "inline" in out
    # a second kernel forked from the same server draws other numbers from NumPy's global generator
    _, other = started()
    assert json.loads(_run(other, PROBE)[0])["numpy_draw"] != seen["numpy_draw"]


def test_an_interrupt_reaches_the_kernel_and_it_goes_on(started):
    manager, client = started()
    # stop_on_error=False, as nbval sends every cell: with True, ipykernel 7 sends the error reply
    # and only then starts aborting queued requests, so a next request that arrives in between is
    # answered 'aborted' (seen once in CI under load). That window is ipykernel's, forked or fresh.
    msg_id = client.execute("import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.01)",
                            stop_on_error=False)
    while not _mine(client.get_iopub_msg(timeout=60), msg_id, "stream"):
        pass  # the cell runs: interrupt it now (get_iopub_msg raises once 60 s pass without a message)
    manager.interrupt_kernel()
    while not _mine(reply := client.get_shell_msg(timeout=60), msg_id, "execute_reply"):
        pass  # earlier replies (kernel_info's, from the start) are not this cell's
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    out, errors, status = _run(client, "print(6 * 7)")
    assert (out.strip(), errors, status) == ("42", [], "ok")


def test_a_kernel_that_ends_or_is_shut_down_or_killed_leaves_nothing_behind(started):
    manager, client = started()
    pid = json.loads(_run(client, PROBE)[0])["pid"]
    stand_in = manager.provisioner.process
    client.execute("import os\nos._exit(3)")  # the kernel ends: its stand-in with the same code
    assert _gone(pid) and stand_in.wait(30) == 3

    manager, client = started()  # killed (the system's out-of-memory killer, say): its stand-in too
    pid = json.loads(_run(client, PROBE)[0])["pid"]
    stand_in = manager.provisioner.process
    client.execute("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert _gone(pid) and stand_in.wait(30) == -signal.SIGKILL

    manager, client = started()
    pid = json.loads(_run(client, PROBE)[0])["pid"]
    stand_in = manager.provisioner.process
    manager.shutdown_kernel()  # a request, then (on a machine too busy to answer in time) a kill
    assert _gone(pid) and stand_in.wait(30) is not None

    manager, client = started()
    pid = json.loads(_run(client, PROBE)[0])["pid"]
    out, _, _ = _run(client, "import subprocess, sys\n"
                     "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
                     "print(child.pid)")
    child = int(out)
    manager.shutdown_kernel(now=True)  # Jupyter's kill: SIGKILL to the stand-in's process group
    assert _gone(pid) and _gone(child), "the kernel, or what it started, outlived the kill"


def test_a_kernel_ends_when_the_process_that_started_it_dies(tmp_path):
    script = ("import json, sys, time\n"
              "from jupyter_client import KernelManager\n"
              "import tests.conftest as conftest\n"
              "conftest._fork_kernels()\n"
              "manager = KernelManager(kernel_name='python3')\n"
              "manager.start_kernel()\n"
              "client = manager.client(); client.start_channels(); client.wait_for_ready(timeout=60)\n"
              "client.execute_interactive('import os; print(os.getpid())', timeout=60,\n"
              "    output_hook=lambda m: m['msg_type'] == 'stream' and print(m['content']['text'].strip(),"
              " flush=True))\n"
              "time.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(__file__)), stderr=subprocess.DEVNULL)
    try:
        pid = int(owner.stdout.readline())
        assert psutil.pid_exists(pid)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert _gone(pid, timeout=30), "the kernel outlived the process that started it"


def test_without_a_named_server_the_stand_in_becomes_a_fresh_kernel(monkeypatch):
    monkeypatch.delenv(shared_server.VARIABLE)
    became = []
    monkeypatch.setattr(os, "execv", lambda path, argv: became.append(argv))
    kernel.main(["-f", "connection.json"])
    assert became == [[sys.executable, "-m", "ipykernel_launcher", "-f", "connection.json"]]
    monkeypatch.setenv(shared_server.VARIABLE, os.environ.get(shared_server.VARIABLE, "x"))
    monkeypatch.setenv("COURSE_START", "subprocess")  # fresh starts asked for: a fresh kernel too
    kernel.main(["-f", "other.json"])
    assert became[-1][-1] == "other.json"
