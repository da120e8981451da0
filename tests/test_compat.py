"""What differs between torch releases goes through course_utils.compat, and works on either side.

The release before 2.13 is imitated on the pinned one by deleting 2.13's names inside the ranks
(forked or fresh processes, so the parent's torch is untouched); ``make compat`` runs the same code
on a real older release.
"""

import pytest
import torch
import torch.distributed as dist

from course_utils import compat
from course_utils.distributed import launch
from course_utils.exercises import run_source
from course_utils.exercises.together import run_sources


def _as_before_2_13() -> None:
    for name in compat.COLLECTIVE_NAMES:
        if hasattr(dist, name):
            delattr(dist, name)


def _flat_collectives(rank: int, world_size: int, old_release: bool) -> tuple[list, list, list]:
    if old_release:
        _as_before_2_13()
    names = [compat.collective_name(n) for n in compat.COLLECTIVE_NAMES]
    full = torch.arange(4.0 * world_size) * (rank + 1)
    mine = torch.empty(4)
    compat.reduce_scatter_single(mine, full)
    gathered = torch.empty(4 * world_size)
    compat.all_gather_single(gathered, torch.full((4,), float(rank)))
    return names, mine.tolist(), gathered.tolist()


#: True on torch 2.13 and later (the pin); False on Colab's 2.11 (make compat runs these tests there)
NEW_NAMES = hasattr(dist, "reduce_scatter_single")


def test_the_flat_collectives_use_whichever_name_the_release_has():
    assert NEW_NAMES == (compat.torch_release() >= (2, 13))
    this_release = list(compat.COLLECTIVE_NAMES) if NEW_NAMES else list(compat.COLLECTIVE_NAMES.values())
    for old_release, expected in ((False, this_release), (True, list(compat.COLLECTIVE_NAMES.values()))):
        results = launch(_flat_collectives, 2, old_release, echo=False, timeout_s=60, backend="gloo")
        for rank, (names, mine, gathered) in enumerate(results):
            assert names == expected
            # each rank's slice of sum_r (r + 1) * arange(8) is 3 * its slice of arange(8)
            assert mine == [3.0 * v for v in range(4 * rank, 4 * rank + 4)]
            assert gathered == [0.0] * 4 + [1.0] * 4


def test_collective_name_prefers_the_new_name_and_falls_back(monkeypatch):
    if not NEW_NAMES:  # imitate 2.13 on an older release
        monkeypatch.setattr(dist, "all_gather_single", dist.all_gather_into_tensor, raising=False)
    assert compat.collective_name("all_gather_single") == "all_gather_single"
    monkeypatch.delattr(dist, "all_gather_single")
    assert compat.collective_name("all_gather_single") == "all_gather_into_tensor"


def test_torch_release_reads_the_running_version(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    assert compat.torch_release() == (2, 11)


_STEP = '''
def zero1_step(flat_param, flat_grad, shard, optimizer):
    {prelude}
    grad = torch.empty_like(shard)
    {reduce_scatter}(grad, flat_grad)
    shard.grad = grad / dist.get_world_size()
    optimizer.step()
    {all_gather}(flat_param, shard.detach().clone())
'''


def test_exercise_08_2_accepts_either_release_names_and_compat():
    names = [("compat.reduce_scatter_single", "compat.all_gather_single"),
             ("dist.reduce_scatter_tensor", "dist.all_gather_into_tensor")]  # every release has these
    if NEW_NAMES:
        names.append(("dist.reduce_scatter_single", "dist.all_gather_single"))
    sources = [_STEP.format(prelude="pass", reduce_scatter=reduce_scatter, all_gather=all_gather)
               for reduce_scatter, all_gather in names]
    for (reduce_scatter, _), result in zip(names, run_sources("10.2", sources), strict=True):  # together
        assert result.right, (reduce_scatter, str(result))


def test_exercise_08_2_names_the_release_when_a_name_is_missing():
    # torch 2.11 has no dist.reduce_scatter_single: imitated by deleting it in the rank
    prelude = ("del dist.reduce_scatter_single, dist.all_gather_single" if NEW_NAMES else "pass")
    source = _STEP.format(prelude=prelude, reduce_scatter="dist.reduce_scatter_single",
                          all_gather="dist.all_gather_single")
    result = run_source("10.2", source)
    assert result.status == "not yet"
    assert "has no dist.reduce_scatter_single" in result.hint and "compat." in result.hint, result.hint


def _forked_from_a_server(rank: int, world_size: int) -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is not None


def test_launch_falls_back_to_fresh_interpreters_without_the_fork_servers_internal(monkeypatch, capsys):
    import multiprocessing.spawn
    import sys
    import types

    import pytest

    from course_utils.launcher import forkserver

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # as in a kernel
    monkeypatch.setattr(forkserver, "_NOTED", set())
    monkeypatch.delenv("COURSE_START", raising=False)  # make stress's switch: this is "auto"
    assert forkserver.internals_missing() == []
    assert forkserver.use_forkserver("auto")
    assert launch(_forked_from_a_server, 2, echo=False, timeout_s=60, backend="gloo") == [True, True]

    monkeypatch.delattr(multiprocessing.spawn, "get_preparation_data")  # as a later Python might
    assert forkserver.internals_missing() == ["multiprocessing.spawn.get_preparation_data"]
    capsys.readouterr()
    assert launch(_forked_from_a_server, 2, echo=False, timeout_s=60, backend="gloo") == [False, False]
    assert not forkserver.use_forkserver("auto")  # the next launch's decision: no second note
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks multiprocessing.spawn.get_preparation_data" in err, err
    assert "Traceback" not in err
    with pytest.raises(ValueError, match="internals this Python lacks"):
        launch(_forked_from_a_server, 2, start="forkserver")


# ----------------------------------------------------------------------------- the Flight Recorder

def _as_2_11_dumps(rank: int, world_size: int) -> tuple[str | None, str | None, list[str]]:
    """In a rank: 2.11's dump functions (it has both names; 2.13 only the new one)."""
    import torch._C._distributed_c10d as c10d

    c10d._dump_nccl_trace = c10d._dump_fr_trace
    name = compat.flight_recorder_dump_name()
    t = torch.ones(1)
    dist.all_reduce(t)
    del c10d._dump_fr_trace  # a release with only the older name
    entries = compat.dump_flight_recorder()["entries"]
    return name, compat.flight_recorder_dump_name(), [e["profiling_name"] for e in entries]


def test_the_flight_recorder_is_dumped_under_whichever_name_the_release_has():
    for name, older_name, ops in launch(_as_2_11_dumps, 2, echo=False, timeout_s=60, backend="gloo"):
        assert (name, older_name) == compat.FLIGHT_RECORDER_DUMPS  # the new name first, else the old
        assert ops == ["gloo:all_reduce"]  # gloo's collectives are recorded


def test_under_nccl_the_dump_reads_nccls_own_buffer(monkeypatch):
    """A CUDA build keeps NCCL's collectives apart from gloo's (measured on an H100): under NCCL the
    dump asks _dump_nccl_trace first; under gloo, or outside a group, the release's usual function."""
    import pickle

    import torch._C._distributed_c10d as c10d

    for name, entries in (("_dump_nccl_trace", ["nccl's"]), ("_dump_fr_trace", ["gloo's"])):
        monkeypatch.setattr(c10d, name, lambda entries=entries, **_: pickle.dumps({"entries": entries}),
                            raising=False)
    assert compat.flight_recorder_dump_name("nccl") == "_dump_nccl_trace"
    assert compat.flight_recorder_dump_name("gloo") == compat.flight_recorder_dump_name() == "_dump_fr_trace"
    assert compat.dump_flight_recorder()["entries"] == ["gloo's"]  # outside a process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert compat.dump_flight_recorder()["entries"] == ["nccl's"]
    monkeypatch.delattr(c10d, "_dump_nccl_trace")
    assert compat.dump_flight_recorder()["entries"] == ["gloo's"]  # a release with one function


def test_without_a_dump_function_there_is_no_dump(monkeypatch):
    import torch._C._distributed_c10d as c10d

    for name in compat.FLIGHT_RECORDER_DUMPS:
        monkeypatch.delattr(c10d, name, raising=False)
    assert compat.flight_recorder_dump_name() is None and compat.dump_flight_recorder() is None
    from course_utils.debugging import flight_recorder
    assert flight_recorder.flight_table({}) == ["(no Flight Recorder dump: this torch cannot take one)"]


def test_an_analyzer_that_refuses_gloo_is_reported_not_raised(monkeypatch):
    """Torch 2.11's analyzer stops at gloo's entries; the course says so instead."""
    from torch.distributed.flight_recorder.components import types

    from course_utils.debugging import flight_recorder

    assert compat.analyzer_reads_gloo() == (compat.torch_release() >= (2, 13))  # 2.11's refuses them
    original = types.Op.__init__

    def as_in_2_11(self, event, memberships, pg_name):
        backend = event["profiling_name"].split(":")[0]
        assert backend in ["nccl", "xccl"], f"name formatting error? {backend} != 'nccl' or 'xccl'"
        original(self, event, memberships, pg_name)

    monkeypatch.setattr(types.Op, "__init__", as_in_2_11)
    assert not compat.analyzer_reads_gloo()
    records = {0: {"version": "2.10", "pg_config": {}, "entries": [{"profiling_name": "gloo:barrier"}]}}
    assert flight_recorder.analyze_flight_records(records) == [
        f"(torch {torch.__version__.split('+')[0]}'s analyzer reads NCCL's dumps, not gloo's; torch "
        "2.13's reads both)"]


def test_the_release_check_runs_from_an_empty_folder_of_its_own(monkeypatch, tmp_path):
    """The course must come from the installed package: the inner run starts in a new empty
    folder (a `course_utils` left in the temp folder itself would otherwise be imported)."""
    import io
    import tempfile
    from pathlib import Path

    from course_utils.tools import compat_check

    seen = {}

    class FakeRun:
        def __init__(self, command, cwd, **kwargs):
            seen["cwd"], seen["empty"] = cwd, not any(Path(cwd).iterdir())
            self.stderr = io.StringIO("")

        def wait(self):
            return 0

    monkeypatch.setattr(compat_check, "ROOT", tmp_path)
    monkeypatch.setattr(compat_check, "prepare", lambda release, log: Path("/no/such/python"))
    monkeypatch.setattr(compat_check.subprocess, "Popen", FakeRun)
    assert compat_check.main(["--torch", compat_check.DEFAULT_TORCH]) == 0
    assert seen["empty"] and Path(seen["cwd"]) != Path(tempfile.gettempdir())
    assert not Path(seen["cwd"]).exists()  # removed afterwards


# ----------------------------------------------------------------------------- Windows: no libuv
# Windows' torch builds lack libuv, which a TCPStore uses by default. Windows itself is not run
# here: the platform is faked where the course decides, and the stores are checked on Linux.

def test_stores_ask_for_libuv_only_where_torch_has_it(monkeypatch):
    import sys

    assert compat.tcp_store_options() == {}
    monkeypatch.setattr(sys, "platform", "win32")
    assert compat.tcp_store_options() == {"use_libuv": False}


def test_on_windows_torchrun_runs_the_agent_without_libuv(monkeypatch):
    import sys

    from course_utils.faults import torchrun as tr

    monkeypatch.delenv("USE_LIBUV", raising=False)
    linux = tr._torchrun_command("course_utils.ddp.train", 2, ("--epochs", "1"), ("--standalone",))
    assert linux[1:3] == ["-m", "torch.distributed.run"] and "USE_LIBUV" not in tr._agent_env()
    monkeypatch.setattr(sys, "platform", "win32")
    windows = tr._torchrun_command("course_utils.ddp.train", 2, ("--epochs", "1"), ("--standalone",))
    assert windows[1:3] == ["-c", tr.WINDOWS_AGENT] and windows[3:] == linux[3:]
    assert tr._agent_env()["USE_LIBUV"] == "0"
    assert tr._agent_env({"USE_LIBUV": "1"})["USE_LIBUV"] == "1"  # a learner's own choice stays


_STORES = """
import datetime, torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous
from course_utils import compat
compat.stores_without_libuv()
compat.stores_without_libuv()  # twice: no second layer
_, rendezvous = c10d_rendezvous_backend.create_backend(
    RendezvousParameters("c10d", "127.0.0.1:0", "job", 1, 1, is_host=True))
agent = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)  # dynamic_rendezvous's
asked = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
print(rendezvous.libuvBackend, agent.libuvBackend, asked.libuvBackend,
      static_tcp_rendezvous.TCPStore is dist.TCPStore, type(agent).__mro__[1].__name__)
"""


def test_torchruns_rendezvous_stores_leave_libuv_out_once_patched():
    """The patch that the Windows agent applies, applied on Linux (in a process of its own)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _STORES], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True", "True", "TCPStore"], done.stdout


@pytest.mark.stress  # a torchrun job: about 10 s, 20 s on 2 busy cores
def test_the_windows_agent_trains_as_torchrun_does(monkeypatch, tmp_path):
    """notebook 05's torchrun job through the Windows agent (platform faked in this process only:
    the agent runs on Linux, with its rendezvous stores made without libuv)."""
    import sys

    from course_utils.faults.torchrun import torchrun

    monkeypatch.setattr(sys, "platform", "win32")
    job = torchrun("course_utils.ddp.train", 2, "--out", str(tmp_path / "w.pt"), "--epochs", "1")
    monkeypatch.undo()
    assert job.command[1:3] == ["-c", "from course_utils.compat import run_torchrun_without_libuv; "
                                      "run_torchrun_without_libuv()"]
    assert job.returncode == 0, "\n".join(job.lines + job.log_lines)
    trained = torch.load(tmp_path / "w.pt")
    assert trained and all(torch.isfinite(v).all() for v in trained.values()), trained


def test_every_torch_nn_parallel_name_the_gpu_branches_call_exists():
    """CI has no GPU, so DataParallel's GPU branch never runs here: a name it calls that torch does
    not have (``torch.nn.parallel.scatter_kwargs`` did not exist; it lives in ``scatter_gather``)
    fails only on a learner's GPU. Every ``torch.nn.parallel.NAME`` in the package must resolve."""
    import re
    from pathlib import Path

    import course_utils

    root = Path(course_utils.__file__).parent
    names = {(path.name, name) for path in root.rglob("*.py")
             for name in re.findall(r"torch\.nn\.parallel\.(\w+)\(", path.read_text(encoding="utf-8"))}
    assert names, "the pattern found no call at all"
    missing = [(file, name) for file, name in sorted(names) if not hasattr(torch.nn.parallel, name)]
    assert missing == []


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="CUDA has started in this process: nothing is queued")
def test_what_torch_queues_for_the_gpus_before_cuda_starts_is_found_and_put_back():
    """compat reaches into torch.cuda's private queue of seeds (env.random_state_kept): make compat
    runs this on each release, so a release that keeps it elsewhere fails here, not silently."""
    def latest():
        return [id(call) for call in torch.cuda._lazy_seed_tracker.call_order]

    torch.manual_seed(3)  # queues a seed for every GPU, even without one
    pending = compat.pending_gpu_generators()
    assert pending is not None
    kept = latest()
    torch.manual_seed(4)
    torch.cuda.manual_seed(5)
    assert latest() != kept
    compat.restore_gpu_generators(*pending)
    assert latest() == kept
