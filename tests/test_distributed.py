"""The launcher's contract, the ring all-reduce, and DDP training three ways (real gloo processes)."""

import functools
import importlib.util
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest
import torch
from conftest import stopped_once_hung

from course_utils.ddp import demos
from course_utils.ddp.collectives import check_ring_all_reduce, chunk_bounds, ring_bytes_per_rank
from course_utils.ddp.train import TrainConfig, train_ddp, train_reference
from course_utils.devices import choose_backend
from course_utils.distributed import LaunchTimeout, RankError, free_port, launch
from course_utils.faults.torchrun import torchrun
from course_utils.launcher import shared_server

pytestmark = pytest.mark.usefixtures("nothing_left_behind")


# Fresh interpreters (the start on GPU machines and off Linux) cost about 2 s more per launch:
# make test checks the fork-server start, make stress (and CI) both.
STARTS = pytest.mark.parametrize("start", ["forkserver",
                                           pytest.param("subprocess", marks=pytest.mark.stress)])


@STARTS
def test_returns_values_in_rank_order_and_echoes_rank_by_rank(capsys, start):
    results = launch(demos.hello, 3, start=start)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["world_size"] for r in results} == {3}
    assert results[0]["backend"] == choose_backend(3)
    assert capsys.readouterr().out.splitlines() == [
        f"[rank {r}] hello from rank {r} of 3" for r in range(3)]


def test_all_reduce_reaches_every_rank():
    assert launch(demos.all_reduce_sum, 4, echo=False) == [[10.0]] * 4


def _frozen_and_collectable(rank, world_size):
    import gc

    return gc.get_freeze_count(), gc.collect() >= 0


@STARTS
def test_a_rank_freezes_its_imports_so_the_collect_before_destroy_is_cheap(start):
    """What a rank imported before fn runs is frozen (gc.freeze): the gc.collect() before
    destroy_process_group then looks only at what fn made, not at torch's many objects."""
    for frozen, collected in launch(_frozen_and_collectable, 2, start=start, echo=False):
        assert frozen > 10_000 and collected  # torch alone accounts for far more than 10k objects


@STARTS
def test_a_raising_rank_raises_here_with_its_traceback(start):
    began = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(demos.raise_on_rank, 3, 2, "rank two is unhappy", start=start)
    # reported when it happens, long before the 120 s timeout: three fresh interpreters first import
    # torch, which on a busy machine (CI's make stress beside two other jobs) takes a while
    assert time.monotonic() - began < (30 if start == "forkserver" else 90)
    err = info.value
    assert (err.rank, err.exc_type, err.message) == (2, "ValueError", "rank two is unhappy")
    assert "raise ValueError(message)" in err.rank_traceback
    assert str(err).startswith("rank 2 raised ValueError: rank two is unhappy")


@STARTS
def test_a_rank_that_dies_without_an_exception_is_reported(start):
    with pytest.raises(RankError, match=r"rank 1 raised ProcessDied: the process exited with code 7"):
        launch(exit_abruptly, 2, 1, 7, start=start)


@STARTS
def test_a_hanging_rank_is_stopped_at_the_timeout_and_says_where_it_waits(start):
    first_s = 4 if start == "forkserver" else 8  # fresh interpreters: time to reach the hang
    error, timeout_s, wall_s = stopped_once_hung(
        lambda t: launch(demos.block_in_collective, 2, 1, timeout_s=t, start=start),
        first_s, {0: "all_reduce", 1: "block_in_collective"})
    message, stacks = str(error), error.stacks
    assert re.search(rf"did not finish within {timeout_s} s: rank\(s\) \[0, 1\]", message)
    assert wall_s < timeout_s + 15
    # rank 0 waits in the all_reduce that rank 1, asleep, never joins: each stack says so
    assert "--- where rank 0 was (most recent call last) ---" in message
    assert "in block_in_collective\n    dist.all_reduce(t)" in "\n".join(stacks[0])
    assert stacks[0][-2].endswith("in all_reduce")  # the innermost Python frame: c10d's
    assert stacks[1][-1] == "    time.sleep(3600)" and stacks[1][-2].endswith("in block_in_collective")
    assert "launcher/rank.py" not in message  # the launcher's own frames are left out


def test_stacks_can_be_left_out_of_a_timeout():
    with pytest.raises(LaunchTimeout) as info:
        launch(demos.block_in_collective, 2, 1, timeout_s=2, stacks=False)
    assert info.value.stacks == {} and "where rank" not in str(info.value)


def test_repeated_launches_leave_no_port_or_process_group_behind():
    import torch.distributed as dist

    for _ in range(4):
        assert launch(demos.all_reduce_sum, 2, echo=False) == [[3.0], [3.0]]
    assert not dist.is_initialized()


def default_store(rank, world_size):
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    return type(getattr(store, "underlying_store", store)).__name__


@STARTS
def test_the_ranks_meet_through_a_file_so_no_name_lookup_can_stall_them(start):
    # a TCPStore makes torch look up the name of each peer that connects: a name server that drops
    # the query costs that rank 5 s (seen on CI machines), long enough to look like a hang
    assert launch(default_store, 2, echo=False, start=start) == ["FileStore"] * 2


@pytest.mark.parametrize("init", ["env", "tcp"])
def test_env_and_tcp_rendezvous(init):
    assert [r["rank"] for r in launch(demos.hello, 2, init=init, echo=False)] == [0, 1]


def local_function(rank, world_size):
    return rank


@pytest.mark.parametrize("fn", [lambda rank, world_size: rank, functools.partial(local_function)],
                         ids=["lambda", "partial"])
def test_lambdas_and_partials_reach_the_ranks(fn):
    assert launch(fn, 2, echo=False) == [0, 1]


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be a function"):
        launch("hello", 2)


def test_a_function_defined_in_main_is_sent_by_value(monkeypatch):
    monkeypatch.setattr(local_function, "__module__", "__main__")  # as if defined in a notebook
    assert launch(local_function, 2, echo=False) == [0, 1]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"world_size": 0}, ValueError, "world_size"),
    ({"world_size": 2.0}, TypeError, "world_size"),
    ({"timeout_s": 0}, ValueError, "timeout_s"),
    ({"init": "file"}, ValueError, "init must be one of 'store', 'env', 'tcp', 'none'"),
    ({"init": False}, ValueError, "init must be one of 'store', 'env', 'tcp', 'none'"),
    ({"init": True}, ValueError, "init must be one of 'store', 'env', 'tcp', 'none'"),
    ({"init": 0}, ValueError, "init must be one of 'store', 'env', 'tcp', 'none'"),
    ({"stacks": "yes"}, TypeError, "stacks must be True or False"),
    ({"backend": "mpi"}, ValueError, "backend must be"),
    ({"threads_per_rank": 0}, ValueError, "threads_per_rank"),
    ({"start": "fork"}, ValueError, "start must be 'auto', 'forkserver' or 'subprocess'"),
])
def test_bad_launch_arguments(kwargs, error, message):
    args = {"world_size": 2, **kwargs}
    world_size = args.pop("world_size")
    with pytest.raises(error, match=message):
        launch(demos.hello, world_size, **args)


def report_environment(rank, world_size, name):
    """A rank for the test below: print on both streams; say what this process sees."""
    import sys

    print(f"stdout of rank {rank}")
    print(f"stderr of rank {rank}", file=sys.stderr)
    return {"value": os.environ.get(name), "rank_env": os.environ["RANK"], "pid": os.getpid(),
            "own_session": os.getsid(0) == os.getpid()}


def test_forked_ranks_take_the_current_environment_and_log_both_streams(monkeypatch, capsys):
    # the fork server was started earlier, with the environment of that moment; a rank must
    # still see the variables as they are now, at the launch
    launch(demos.hello, 2, echo=False, start="forkserver")
    monkeypatch.setenv("COURSE_PROBE", "set after the server started")
    results = launch(report_environment, 2, "COURSE_PROBE", start="forkserver")
    assert [r["value"] for r in results] == ["set after the server started"] * 2
    assert [r["rank_env"] for r in results] == ["0", "1"]
    assert all(r["own_session"] for r in results)
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3
    assert capsys.readouterr().out.splitlines() == [
        "[rank 0] stdout of rank 0", "[rank 0] stderr of rank 0",
        "[rank 1] stdout of rank 1", "[rank 1] stderr of rank 1"]


def exit_abruptly(rank, world_size, bad_rank, code):
    """``bad_rank`` ends its process at once, with no Python exception (a crash, in effect)."""
    if rank == bad_rank:
        os._exit(code)
    torch.distributed.barrier()
    return rank


def unpicklable_result(rank, world_size):
    """Returns something that cannot travel back to the launcher (a lock; a lambda now can)."""
    return threading.Lock()


def _parent_pid(rank, world_size):
    return os.getppid()


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used on Linux only")
def test_auto_start_forks_ranks_from_the_server_on_a_cpu_linux_machine(monkeypatch):
    """Who a rank's parent is shows how it started: this process (a fresh interpreter) or the
    fork server. COURSE_START=subprocess gives every launch without ``start=`` fresh interpreters;
    a ``start=`` passed still wins."""
    me = os.getpid()
    monkeypatch.setenv("COURSE_START", "subprocess")
    assert launch(_parent_pid, 1, echo=False) == [me]  # a fresh interpreter: about a second of CPU a rank
    forked = launch(_parent_pid, 2, start="forkserver", echo=False)
    assert me not in forked and len(set(forked)) == 1  # both from the one server
    monkeypatch.delenv("COURSE_START")
    assert launch(_parent_pid, 2, echo=False) == forked


def test_the_start_switch_overrides_auto_only(monkeypatch):
    from course_utils.launcher import forkserver

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # as in a kernel
    monkeypatch.delenv("COURSE_START", raising=False)
    assert forkserver.chosen_start() == "auto"
    auto_forks = forkserver.use_forkserver(None)
    assert auto_forks == (sys.platform == "linux") and forkserver.fresh_starts() is not auto_forks
    for value, start in (("", "auto"), ("subprocess", "subprocess"), ("forkserver", "forkserver"),
                         ("auto", "auto")):
        monkeypatch.setenv("COURSE_START", value)
        assert forkserver.chosen_start() == start
        assert forkserver.chosen_start("forkserver") == "forkserver"  # passed: it wins
    monkeypatch.setenv("COURSE_START", "subprocess")
    assert forkserver.use_forkserver(None) is False and forkserver.fresh_starts()
    assert forkserver.use_forkserver("auto") is auto_forks  # start="auto" passed: the rule
    if auto_forks:
        assert forkserver.use_forkserver("forkserver") is True
    monkeypatch.setenv("COURSE_START", "spawn")
    with pytest.raises(ValueError, match="COURSE_START must be 'auto', 'forkserver' or 'subprocess', "
                                         "got 'spawn'"):
        launch(_parent_pid, 2)
    assert forkserver.use_forkserver("subprocess") is False  # a start passed: not read


def test_auto_start_forks_on_linux_with_or_without_a_gpu_but_not_for_a_script(monkeypatch):
    """The fork server never initialises CUDA (tests/test_preload_cuda.py), so a GPU changes
    nothing: the decision does not even ask torch whether one is there."""
    import torch

    from course_utils.launcher import forkserver

    def asked():
        raise AssertionError("use_forkserver asked torch about CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setattr(torch.cuda, "device_count", asked)
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # as in a kernel
    monkeypatch.delenv("COURSE_START", raising=False)
    assert forkserver.use_forkserver("auto") is (sys.platform == "linux")
    assert forkserver.use_forkserver("subprocess") is False
    script = types.ModuleType("__main__")
    script.__file__ = "train.py"  # `python train.py`: a fork-server child would import it again
    script.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert forkserver.use_forkserver("auto") is False


def run_python(*args, cwd=None, env=None):
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from course_utils.ddp import demos\n"
                      "from course_utils.distributed import launch\n"
                      "print('the script body ran')\n"
                      "print(launch(demos.all_reduce_sum, 1, echo=False))\n")  # one fresh interpreter
    assert run_python(str(script), cwd=tmp_path) == ["the script body ran", "[[1.0]]"]


def test_a_fork_server_started_by_someone_else_works_and_ends_with_its_parent():
    code = ("import multiprocessing, os, psutil\n"
            "multiprocessing.set_forkserver_preload([])\n"
            "p = multiprocessing.get_context('forkserver').Process(target=os.getpid)\n"
            "p.start(); p.join()\n"
            "from course_utils.ddp import demos\n"
            "from course_utils.distributed import launch\n"
            "print(launch(demos.all_reduce_sum, 1, echo=False, start='forkserver'))\n"
            "print(*[c.pid for c in psutil.Process().children(recursive=True)])\n")
    # without the session's shared fork server (tests/conftest.py): this process's own is the point
    alone = {k: v for k, v in os.environ.items() if k != shared_server.VARIABLE}
    result, helpers = run_python("-c", code, env=alone)
    assert result == "[[1.0]]"  # one rank: it imports torch itself (the server preloaded nothing)
    helpers = [int(pid) for pid in helpers.split()]
    assert len(helpers) == 2  # the fork server and its resource tracker, nothing else
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in helpers):
        time.sleep(0.05)
    assert not any(psutil.pid_exists(pid) for pid in helpers)


def _not_imported(rank, world_size, names):
    return [name for name in names if name not in sys.modules]


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used on Linux only")
def test_the_fork_server_preloads_every_module_it_lists():
    """multiprocessing's fork server skips a preload module it cannot import, and says nothing: a
    module renamed or moved would only make every forked rank import it again, slower."""
    from course_utils.launcher.forkserver import PRELOAD

    assert [name for name in PRELOAD if importlib.util.find_spec(name) is None] == []
    assert launch(_not_imported, 2, PRELOAD, start="forkserver", echo=False) == [[], []]


def test_unpicklable_arguments_and_results():
    with pytest.raises(TypeError, match=r"args\[1\] is a _thread.lock, which cannot be pickled"):
        launch(demos.raise_on_rank, 2, 0, threading.Lock())
    with pytest.raises(RankError, match=r"the return value of rank \d \(a _thread.lock\) cannot be "
                                        r"sent back \(it must be picklable\)"):
        launch(unpicklable_result, 2)


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ------------------------------------------------------------------------------ ring all-reduce


def test_chunk_bounds():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert chunk_bounds(0, 2) == [(0, 0), (0, 0)]
    with pytest.raises(ValueError):
        chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        chunk_bounds(4, 0)


def test_ring_bytes_formula():
    assert ring_bytes_per_rank(1000, 1) == 0
    assert ring_bytes_per_rank(1000, 2) == 1000
    assert ring_bytes_per_rank(1000, 4) == 1500


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_matches_dist_all_reduce(world_size):
    sizes = [1, 2, 3, 5, 7, 64, 1000, 1001, 4099]
    per_rank = launch(check_ring_all_reduce, world_size, sizes, echo=False)
    for records in per_rank:
        for record in records:
            assert record["max_diff"] < 1e-5, record
    # bytes: each rank sends every chunk but one, twice; for sizes divisible by N that is the formula
    for record in per_rank[0]:
        if record["size"] % world_size == 0:
            assert record["bytes_sent"] == record["formula"]


# ------------------------------------------------------------------------------ DDP training


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_equals_one_process_with_the_global_batch(world_size):
    config = TrainConfig()
    results = launch(train_ddp, world_size, config, echo=False)
    reference = train_reference(config, world_size)
    for name, value in reference["params"].items():
        torch.testing.assert_close(results[0]["params"][name], value)
        for other in results[1:]:
            assert torch.equal(other["params"][name], results[0]["params"][name])
    shards = [set(r["seen"][0]) for r in results]
    assert set().union(*shards) == set(range(config.data_size))


@pytest.mark.stress  # notebook 05 asserts the same under nbval in `make test`
def test_torchrun_path_equals_launch_path(tmp_path):
    config = TrainConfig(epochs=1)
    out = tmp_path / "params.pt"
    job = torchrun("course_utils.ddp.train", 2, "--out", str(out), "--epochs", "1")
    assert job.returncode == 0, "\n".join(job.lines + job.log_lines)
    assert any("parameters saved" in line for line in job.lines)
    saved = torch.load(out)
    launched = launch(train_ddp, 2, config, echo=False)[0]["params"]
    for name, value in launched.items():
        torch.testing.assert_close(saved[name], value)


def test_train_config_checks():
    with pytest.raises(ValueError, match="does not divide into 5 ranks"):
        TrainConfig(global_batch_size=24).per_rank_batch_size(5)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0)
    with pytest.raises(TypeError, match="epochs"):
        TrainConfig(epochs=1.5)
    with pytest.raises(ValueError, match="process group has not been initialized"):
        train_ddp(0, 1)  # torch's own words: a rank function carries no guard of its own


def test_find_unused_parameters_error_then_fix():
    with pytest.raises(RankError, match="Expected to have finished reduction in the prior iteration"):
        launch(demos.unused_parameters, 2, False, echo=False)
    losses = launch(demos.unused_parameters, 2, True, echo=False)
    assert len(losses[0]) == 3


def test_batchnorm_differs_and_sync_batchnorm_by_hand_matches():
    reference = demos.batchnorm_reference(2)
    plain = launch(demos.batchnorm_under_ddp, 2, False, echo=False)
    synced = launch(demos.batchnorm_under_ddp, 2, True, echo=False)
    plain_out = torch.cat([r["output"] for r in plain])
    synced_out = torch.cat([r["output"] for r in synced])
    assert (plain_out - reference["output"]).abs().max() > 1e-2
    torch.testing.assert_close(synced_out, reference["output"])
    torch.testing.assert_close(synced[0]["grad"], reference["grad"])
    torch.testing.assert_close(synced[1]["running_mean"], reference["running_mean"])


def test_rank_zero_saves_and_everyone_reads(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    results = launch(demos.save_on_rank_0, 2, path, echo=False)
    assert all(r["matches_my_copy"] for r in results)
    assert results[0]["wrapped_keys"] == ["module.weight", "module.bias"]
    assert results[0]["saved_keys"] == ["weight", "bias"]
    assert os.path.exists(path)


def test_the_rank_blamed_is_the_cause_not_a_peer_that_lost_it():
    """A rank that raises may tear its group down before its own error is written; the peers
    waiting for it then fail first, with a transport error. The launch still blames the cause."""
    from course_utils.launcher.processes import RankResult
    from course_utils.launcher.waiting import _cause

    closed = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321"
    echo = RankResult(ok=False, finished_at=1.0, exc_type="RuntimeError", message=closed)
    cause = RankResult(ok=False, finished_at=2.0, exc_type="ValueError", message="rank two is unhappy")
    assert _cause({0: echo, 1: echo, 2: cause}) == 2
    assert _cause({0: echo, 1: RankResult(ok=False, finished_at=0.5, exc_type="RuntimeError",
                                          message="Connection reset by peer")}) == 1  # only echoes: the first
    assert _cause({0: RankResult(ok=True, finished_at=0.1), 1: cause, 2: echo}) == 1
    own = RankResult(ok=False, finished_at=0.2, exc_type="KeyError", message="'step'")
    assert _cause({0: cause, 1: own}) == 1  # two causes: the earlier


def _start_a_child_and(rank, world_size, pid_file, then):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).with_suffix(f".{rank}").write_text(str(child.pid))
    if then == "hang":
        time.sleep(600)
    return child.pid


def _dead(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("then", ["return", "hang"])
def test_launch_stops_the_processes_its_ranks_started(tmp_path, then):
    pid_file = tmp_path / "child"
    written = [pid_file.with_suffix(f".{rank}") for rank in range(2)]
    if then == "hang":
        for timeout_s in (3, 6, 12):  # slow is not stuck: a rank stopped before it wrote its
            for path in written:  # child's pid says nothing; try again, longer
                path.unlink(missing_ok=True)
            with pytest.raises(LaunchTimeout):
                launch(_start_a_child_and, 2, str(pid_file), then, timeout_s=timeout_s, echo=False,
                       stacks=False)
            if all(path.exists() and path.read_text() for path in written):
                break
        else:
            pytest.fail("no try let both ranks start their child and write its pid")
    else:
        launch(_start_a_child_and, 2, str(pid_file), then, echo=False)
    pids = [int(path.read_text()) for path in written]
    deadline = time.monotonic() + 5
    while not all(_dead(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_dead(pid) for pid in pids), pids


class _Writes:
    def __init__(self):
        self.calls = []

    def write(self, text):
        self.calls.append(text)

    def flush(self):
        pass


def test_rank_print_writes_each_line_at_once(monkeypatch):
    # torchrun's workers share one unbuffered pipe: print()'s separate writes of the text and the
    # newline once let rank 0's line land inside rank 1's (CI, test_restarts)
    from course_utils.distributed import rank_print

    out = _Writes()
    monkeypatch.setattr(sys, "stdout", out)
    rank_print("step", 3, "done", rank=1)
    rank_print("rank 0 only", rank=1, only_rank=0)
    rank_print("rank 0 only", rank=0, only_rank=0)
    assert out.calls == ["step 3 done\n", "rank 0 only\n"]
