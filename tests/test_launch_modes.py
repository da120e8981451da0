"""launch's newer modes: functions sent by value (defined in __main__, in a test, in a closure) and
ranks that make their own process group (``init="none"``), under both start methods.

The launch contract of tests/test_distributed.py (results in rank order, echo rank by rank, a
RankError with the traceback for a raise and for a crash, a LaunchTimeout for a hang, nothing left
behind) is checked again here for each mode.
"""

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import stopped_once_hung
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import distributed
from course_utils.distributed import RankError, free_port, launch
from course_utils.launcher.pickling import serialise_call

pytestmark = pytest.mark.usefixtures("nothing_left_behind")


# Fresh interpreters (the start on GPU machines and off Linux) cost about 2 s more per launch:
# make test checks the fork-server start, make stress (and CI) both.
STARTS = pytest.mark.parametrize("start", ["forkserver",
                                           pytest.param("subprocess", marks=pytest.mark.stress)])
MODES = pytest.mark.parametrize("mode", ["by_value", "init_none"])


def describe(rank, world_size):
    """A module-level helper that rank functions defined in the tests call (sent by reference)."""
    return f"rank {rank} of {world_size}"


def contract_functions(mode):
    """The contract's rank functions, defined here, so sent by value.

    With ``mode="init_none"`` each makes its own process group from torchrun's environment, as a
    torchrun script does, and destroys it at the end.
    """

    def own_group(body):
        if mode == "by_value":
            return body

        def wrapped(rank, world_size, *args):
            dist.init_process_group("gloo")
            try:
                return body(rank, world_size, *args)
            finally:
                dist.destroy_process_group()

        return wrapped

    def hello(rank, world_size):
        print(f"hello from {describe(rank, world_size)}")
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.item()}

    def raise_on_rank(rank, world_size, bad_rank, message):
        if rank == bad_rank:
            raise ValueError(message)
        dist.barrier()
        return rank

    def exit_abruptly(rank, world_size, bad_rank, code):
        if rank == bad_rank:
            os._exit(code)
        dist.barrier()
        return rank

    def block_in_collective(rank, world_size, sleeping_rank):
        if rank == sleeping_rank:
            time.sleep(3600)
        dist.all_reduce(torch.ones(1))
        return rank

    fns = {f.__name__: own_group(f) for f in (hello, raise_on_rank, exit_abruptly, block_in_collective)}
    return fns, ("none" if mode == "init_none" else "store")


@MODES
@STARTS
def test_contract_results_in_rank_order_and_echo_rank_by_rank(capsys, mode, start):
    fns, init = contract_functions(mode)
    results = launch(fns["hello"], 3, init=init, start=start)
    assert results == [{"rank": r, "world_size": 3, "sum": 6.0} for r in range(3)]
    assert capsys.readouterr().out.splitlines() == [
        f"[rank {r}] hello from rank {r} of 3" for r in range(3)]


@MODES
@STARTS
def test_contract_a_raising_rank_raises_here_with_its_traceback(mode, start):
    fns, init = contract_functions(mode)
    with pytest.raises(RankError) as info:
        launch(fns["raise_on_rank"], 3, 2, "rank two is unhappy", init=init, start=start)
    err = info.value
    assert (err.rank, err.exc_type, err.message) == (2, "ValueError", "rank two is unhappy")
    assert "raise ValueError(message)" in err.rank_traceback


@MODES
@STARTS
def test_contract_a_rank_that_dies_is_reported(mode, start):
    fns, init = contract_functions(mode)
    with pytest.raises(RankError, match=r"rank 1 raised ProcessDied: the process exited with code 7"):
        launch(fns["exit_abruptly"], 2, 1, 7, init=init, start=start)


@MODES
@STARTS
def test_contract_a_hang_is_stopped_at_the_timeout_with_stacks(mode, start):
    fns, init = contract_functions(mode)
    first_s = 4 if start == "forkserver" else 8  # fresh interpreters: time to reach the hang
    error, timeout_s, wall_s = stopped_once_hung(
        lambda t: launch(fns["block_in_collective"], 2, 1, init=init, start=start, timeout_s=t),
        first_s, {0: "all_reduce", 1: "block_in_collective"})
    assert re.search(rf"did not finish within {timeout_s} s: rank\(s\) \[0, 1\]", str(error))
    assert wall_s < timeout_s + 15
    stacks = error.stacks
    assert "in block_in_collective" in "\n".join(stacks[0]) and stacks[0][-2].endswith("in all_reduce")
    assert stacks[1][-1] == "    time.sleep(3600)"


# ------------------------------------------------------------------------------ by value

SCRIPT = '''\
import sys

import torch
import torch.distributed as dist

from course_utils.distributed import launch

OFFSET = 10.0
print("the script body ran", flush=True)


def scaled(x):  # a module-level helper that the rank functions call
    return 2 * x + OFFSET


def make_adder(extra):
    def add(rank, world_size, k):  # a closure, defined in __main__
        t = torch.tensor([scaled(rank) + extra + k(rank)])
        dist.all_reduce(t)
        print(f"sum {t.item():g}")
        return t.item()
    return add


def root(rank, world_size):
    import math  # an import inside the function

    return math.sqrt(scaled(rank) + 6)


start = sys.argv[1]  # no `if __name__ == "__main__":` guard: the ranks must not run this again
for n in (2, 3):
    print(launch(root, n, start=start, echo=False))
    launch(make_adder(0.5), n, lambda r: 100 * r, start=start)
'''


@STARTS
def test_a_script_runs_functions_defined_in_its_main_once(tmp_path, start):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "train.py", start], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "the script body ran",
        "[4.0, 4.242640687119285]",
        "[rank 0] sum 123", "[rank 1] sum 123",
        "[4.0, 4.242640687119285, 4.47213595499958]",
        "[rank 0] sum 337.5", "[rank 1] sum 337.5", "[rank 2] sum 337.5",
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_local_functions_closures_and_lambdas_run_by_value(world_size):
    scale = 3.0

    class Box:  # a local class: its instances travel by value too
        def __init__(self, value):
            self.value = value

    def rank_fn(rank, world_size, box, transform):
        t = torch.tensor([scale * rank + box.value])
        dist.all_reduce(t)
        return describe(rank, world_size), transform(t.item()), Box(rank), lambda: rank

    assert "<locals>" in rank_fn.__qualname__
    results = launch(rank_fn, world_size, Box(1.0), lambda x: x / 2, echo=False)
    total = sum(scale * r + 1.0 for r in range(world_size))
    assert [r[:2] for r in results] == [(describe(r, world_size), total / 2) for r in range(world_size)]
    # what the ranks returned came back by value: a local class's instance, a lambda
    assert [r[2].value for r in results] == list(range(world_size))
    assert [r[3]() for r in results] == list(range(world_size))


def test_importable_functions_travel_by_reference_and_the_rest_by_value():
    import pickle

    from course_utils.ddp import demos

    def local(rank, world_size):
        return rank

    assert pickle.loads(serialise_call(demos.hello, ()))[0] is demos.hello
    assert len(serialise_call(demos.hello, ())) < 120  # a name, not code
    copy = pickle.loads(serialise_call(local, ()))[0]
    assert copy is not local and copy(3, 4) == 3


@pytest.fixture
def no_rank_may_start(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(distributed.subprocess, "Popen", refuse)
    monkeypatch.setattr(distributed, "RankProcess", refuse)
    monkeypatch.setattr(distributed.tempfile, "mkdtemp", refuse)


LOCK = threading.Lock()


def unshippable_cases(tmp_path):
    log = open(tmp_path / "log.txt", "w")  # the point is an open file
    lock = threading.Lock()

    def helper():  # a local helper, so sent by value, with the global it uses
        with LOCK:
            return 1

    def writes_to_log(rank, world_size):
        log.write(f"rank {rank}\n")

    def takes_lock(rank, world_size):
        with lock:
            return rank

    def calls_helper(rank, world_size):
        return helper()

    def gets_args(rank, world_size, *args):
        return rank

    return log, [
        (writes_to_log, (), "its closure variable 'log' is a _io.TextIOWrapper", "an open file"),
        (takes_lock, (), "its closure variable 'lock' is a _thread.lock", "cannot pickle '_thread.lock'"),
        (calls_helper, (), "its closure variable 'helper', whose global 'LOCK' is a _thread.lock",
         "_thread.lock"),
        (gets_args, (1, lock), r"args\[1\] is a _thread.lock", "_thread.lock"),
        (gets_args, ((i for i in range(3)),), r"args\[0\] is a generator", "'generator'"),
        (gets_args, (socket.socket(),), r"args\[0\] is a socket.socket", "socket"),
        (gets_args, (torch.ones(2, device="meta"),), r"args\[0\] is a torch.Tensor",
         r"a tensor on meta cannot be sent to other processes: pass it on the CPU"),
        (gets_args, (lambda: log,), r"args\[0\], whose closure variable 'log' is a _io.TextIOWrapper",
         "an open file"),
    ]


def test_what_cannot_travel_is_named_before_any_rank_starts(tmp_path, no_rank_may_start):
    log, cases = unshippable_cases(tmp_path)
    try:
        for fn, args, where, why in cases:
            with pytest.raises(TypeError, match=rf"^cannot send .* to the ranks: {where}.*{why}") as info:
                launch(fn, 2, *args)
            assert "create open files, locks, sockets" in str(info.value)
    finally:
        log.close()
        for _, args, *_ in cases:
            for arg in args:
                if isinstance(arg, socket.socket):
                    arg.close()


def test_a_result_that_cannot_travel_back_is_a_clear_error():
    def returns_a_lock(rank, world_size):
        return threading.Lock()

    with pytest.raises(RankError, match=r"the return value of rank \d \(a _thread.lock\) cannot be "
                                        r"sent back"):
        launch(returns_a_lock, 2)


# ------------------------------------------------------------------------------ init="none"


class ToyModel(nn.Module):
    """The PyTorch DDP tutorial's model."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def tutorial_demo(port, destroy=True):
    """The PyTorch DDP tutorial's ``demo_basic``, with its setup and cleanup, on a fixed port."""

    def setup(rank, world_size):
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    def cleanup():
        dist.destroy_process_group()

    def demo_basic(rank, world_size):
        print(f"Running basic DDP example on rank {rank}.")
        setup(rank, world_size)
        torch.manual_seed(0)
        model = ToyModel()
        ddp_model = DDP(model)
        loss_fn = nn.MSELoss()
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=torch.Generator().manual_seed(rank)))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()
        weight = model.net1.weight.detach().clone()
        if destroy:
            cleanup()
        print(f"Finished running basic DDP example on rank {rank}.")
        return weight

    return demo_basic


@STARTS
def test_the_tutorials_demo_basic_runs_twice_on_its_fixed_port(capsys, start):
    port = free_port()
    for _ in range(2):  # the port must be free again: the group destroyed, the store closed
        weights = launch(tutorial_demo(port), 2, init="none", start=start)
        assert torch.equal(weights[0], weights[1])  # DDP kept the replicas in step
        assert capsys.readouterr().out.splitlines() == [
            "[rank 0] Running basic DDP example on rank 0.",
            "[rank 0] Finished running basic DDP example on rank 0.",
            "[rank 1] Running basic DDP example on rank 1.",
            "[rank 1] Finished running basic DDP example on rank 1."]


def from_torchruns_environment(gpu, ngpus_per_node, args):
    """``mp.spawn``'s worker signature; ``init_process_group`` from the environment alone."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    seen = {name: os.environ[name] for name in names}
    dist.init_process_group("gloo")
    t = torch.tensor([float(gpu)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"gpu": gpu, "ngpus": ngpus_per_node, "args": args, "sum": t.item(), **seen}


@STARTS
def test_a_torchrun_style_function_finds_its_environment_twice_in_a_row(start):
    for _ in range(2):
        results = launch(from_torchruns_environment, 3, {"lr": 0.1}, init="none", start=start,
                         echo=False)
        assert [(r["gpu"], r["RANK"], r["LOCAL_RANK"]) for r in results] == [
            (r, str(r), str(r)) for r in range(3)]
        for r in results:
            assert (r["ngpus"], r["args"], r["sum"]) == (3, {"lr": 0.1}, 3.0)
            assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["MASTER_ADDR"]) == ("3", "3", "127.0.0.1")
        assert len({r["MASTER_PORT"] for r in results}) == 1


@STARTS
def test_a_group_left_open_is_destroyed_and_its_port_freed(start):
    port = free_port()
    for _ in range(2):
        weights = launch(tutorial_demo(port, destroy=False), 2, init="none", start=start, echo=False)
        assert torch.equal(weights[0], weights[1])
    with socket.socket() as s:  # rank 0's store no longer listens (TIME_WAIT may remain, as
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # c10d's own store allows)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_a_taken_port_is_a_clear_error_not_a_hang():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        began = time.monotonic()
        with pytest.raises(RankError, match=r"rank 0 raised DistNetworkError: .*port: \d+.*EADDRINUSE"):
            launch(tutorial_demo(taken.getsockname()[1]), 2, init="none", timeout_s=60, echo=False)
        assert time.monotonic() - began < 30


def test_without_init_there_is_no_group_unless_fn_makes_one():
    def sees(rank, world_size):
        return dist.is_initialized()

    assert launch(sees, 2, init="none", echo=False) == [False, False]
    assert launch(sees, 2, echo=False) == [True, True]
