"""The test session's one fork server (course_utils/launcher/shared_server.py, tests/conftest.py):
the session's processes fork their ranks from it, each rank with its own launcher's environment,
path and folder; a name that does not answer gives a launch a server of its own, and a note."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from course_utils import distributed
from course_utils.distributed import LaunchTimeout, RankError, launch
from course_utils.launcher import forkserver, shared_server, waiting

pytestmark = [pytest.mark.usefixtures("nothing_left_behind"),
              pytest.mark.skipif(sys.platform != "linux", reason="ranks are forked on Linux only")]


def _sleep(rank, world_size, seconds):
    time.sleep(seconds)


def _who(rank, world_size):
    import torch.distributed as dist

    return {"parent": os.getppid(), "probe": os.environ.get("COURSE_PROBE"), "cwd": os.getcwd(),
            "on_path": "/course-probe-path" in sys.path, "debug": str(dist.get_debug_level())}


def _fresh_python(code, env=None):
    """``code`` in a fresh interpreter, without this session's name unless ``env`` gives one."""
    base = {k: v for k, v in os.environ.items() if k != shared_server.VARIABLE}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          env={**base, **(env or {})}, cwd=os.getcwd())
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_this_session_forks_every_rank_from_the_server_its_first_process_named(monkeypatch, tmp_path):
    """make test's workers and kernels inherit the name from conftest's pytest_configure, and a rank
    still gets what its launcher has now, not what the server had when it started."""
    assert shared_server.VARIABLE in os.environ, "tests/conftest.py named no shared fork server"
    named = json.loads(os.environ[shared_server.VARIABLE])["pid"]
    monkeypatch.setenv("COURSE_PROBE", "set after the server started")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # which torch reads once, at import
    monkeypatch.syspath_prepend("/course-probe-path")
    monkeypatch.chdir(tmp_path)
    ranks = launch(_who, 2, start="forkserver", echo=False)
    assert [r["parent"] for r in ranks] == [named, named]
    assert {r["probe"] for r in ranks} == {"set after the server started"}
    assert {r["debug"] for r in ranks} == {"DebugLevel.DETAIL"}  # not the server's (OFF)
    assert {r["cwd"] for r in ranks} == {str(tmp_path)} and all(r["on_path"] for r in ranks)
    assert forkserver.use_forkserver(None)  # a launch that does not ask forks too


def test_a_variable_torch_reads_as_it_loads_set_after_the_server_started_fails_a_forked_rank_clearly(
        monkeypatch):
    """The server's torch read it when it loaded; a forked rank would run with the old value."""
    from course_utils.launcher.rank import READ_AT_LOAD

    assert shared_server.VARIABLE in os.environ, "tests/conftest.py named no shared fork server"
    assert "TORCH_SHOW_CPP_STACKTRACES" in READ_AT_LOAD
    value = "0" if os.environ.get("TORCH_SHOW_CPP_STACKTRACES") == "1" else "1"
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", value)
    with pytest.raises(RankError, match="TORCH_SHOW_CPP_STACKTRACES changed after the fork server "
                                        "started.*pass start='subprocess'"):
        launch(_who, 1, start="forkserver", echo=False)
    # a fresh interpreter (this process its parent) reads it as torch loads: it runs
    assert launch(_who, 1, start="subprocess", echo=False)[0]["parent"] == os.getpid()


def test_the_first_name_is_kept_and_the_server_ends_with_the_process_that_named_it():
    code = ("import json, os\n"
            "from course_utils.launcher import shared_server\n"
            "assert shared_server.publish([])\n"  # nothing preloaded: this server forks nothing
            "first = os.environ[shared_server.VARIABLE]\n"
            "assert not shared_server.publish([]) and os.environ[shared_server.VARIABLE] == first\n"
            "print(json.loads(first)['pid'])\n")
    server = int(_fresh_python(code).stdout)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(server)


def test_a_name_that_is_not_one_or_does_not_answer_gives_a_server_of_its_own_and_a_note(tmp_path):
    """Another interpreter's server (make compat's releases) is not used either, without a note."""
    stale = json.dumps({"address": str(tmp_path / "gone"), "key": None, "pid": 1})
    other = json.dumps({**json.loads(os.environ[shared_server.VARIABLE]), "python": "/another/python"})
    code = ("import json, os\n"
            "from tests.test_shared_server import _who\n"
            "from course_utils.distributed import launch\n"
            "from course_utils.launcher import shared_server\n"
            "first = launch(_who, 1, start='forkserver', echo=False)\n"  # the name is not JSON
            f"os.environ[shared_server.VARIABLE] = {stale!r}\n"
            "second = launch(_who, 1, start='forkserver', echo=False)\n"  # no server at that address
            "third = launch(_who, 1, start='forkserver', echo=False)\n"
            f"os.environ[shared_server.VARIABLE] = {other!r}\n"  # another Python's: not used, no note
            "fourth = launch(_who, 1, start='forkserver', echo=False)\n"
            "print(json.dumps([r['parent'] for r in first + second + third + fourth]))\n")
    done = _fresh_python(code, env={shared_server.VARIABLE: "not a name"})
    parents = json.loads(done.stdout)
    assert len(set(parents)) == 1 and parents[0] != 1  # one server, that process's own
    notes = [line for line in done.stderr.splitlines() if shared_server.VARIABLE in line]
    assert len(notes) == 2, done.stderr  # one for each bad name, none for a repeat or another Python's
    assert "COURSE_FORKSERVER is not a fork server's name ('not a name'); ignored" in notes[0]
    assert "COURSE_FORKSERVER did not answer (FileNotFoundError" in notes[1]


def test_a_forked_rank_left_running_is_seen_though_it_descends_from_the_server_not_this_process(
        monkeypatch):
    """What nothing_left_behind relies on (tests/conftest.py): a launch that did not stop its rank
    (stop() made a no-op here, in launch and in its wait) leaves a process that the scan of this
    worker's descendants cannot see, and that the record of started ranks finds."""
    from conftest import rank_processes, ranks_left_on, recording_ranks

    assert shared_server.VARIABLE in os.environ, "tests/conftest.py named no shared fork server"
    named = json.loads(os.environ[shared_server.VARIABLE])["pid"]
    monkeypatch.setattr(distributed, "stop", lambda ranks: None)
    monkeypatch.setattr(waiting, "stop", lambda ranks: None)
    with recording_ranks() as ranks, pytest.raises(LaunchTimeout):
        launch(_sleep, 1, 60, start="forkserver", timeout_s=0.5, stacks=False, echo=False)
    alive = ranks.alive()
    try:
        assert [p.ppid() for p in alive] == [named]  # the rank, still sleeping, forked by the server
        assert not [p for p in rank_processes() if p.pid in {q.pid for q in alive}]  # the blind spot
        # what the session's end checks (other workers' ranks may be running there too)
        assert {p.pid for p in alive} <= {p.pid for p in ranks_left_on(named, 0)}
    finally:
        for p in alive:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                if os.getsid(p.pid) == p.pid:  # the rank leads its own session: all of it goes
                    os.killpg(p.pid, signal.SIGKILL)
                else:  # forked, not yet in its own session: its group is not the rank's to kill
                    p.kill()
    deadline = time.monotonic() + 10
    while ranks.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ranks.alive() == []


def test_the_session_end_check_lists_running_children_not_zombies_or_grandchildren():
    """tests/conftest.py's ranks_left_on, on a plain process tree: a "server" that forks a child,
    which forks a grandchild; the child is listed while it runs, not once it is a zombie."""
    from conftest import ranks_left_on

    code = ("import os, sys, time\n"
            "child = os.fork()\n"
            "if child == 0:\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "    time.sleep(60)\n"
            "    os._exit(0)\n"
            "print(child, flush=True)\n"
            "time.sleep(60)\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = int(server.stdout.readline())
        left = ranks_left_on(server.pid, 0.2)
        assert [p.pid for p in left] == [child]
        os.kill(child, signal.SIGKILL)  # the "server" never reaps it: a zombie
        deadline = time.monotonic() + 10
        while psutil.Process(child).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ranks_left_on(server.pid, 0) == []
        assert ranks_left_on(2**22 + 12345, 0) == []  # a server that is gone: nothing to check
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        server.stdout.close()
