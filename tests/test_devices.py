"""One place decides each rank's backend and device (course_utils.devices), and every rank
function of the course obeys it: checked on the CPU with a device audit, so that code which would
fail under NCCL (CPU tensors in a collective, a model left on the CPU) fails here first."""

import importlib
import inspect
import pkgutil

import pytest
import torch
from conftest import rank_processes, recording_ranks
from device_audit import DeviceAudit, audited
from torch import nn

import course_utils
from course_utils import devices
from course_utils.ddp.by_hand_runs import VERSIONS
from course_utils.ddp.train import TrainConfig
from course_utils.debugging import training_bugs
from course_utils.distributed import launch
from course_utils.sharding.strategies import STRATEGIES, strategy_placement
from course_utils.tools import bench


@pytest.fixture(autouse=True)
def no_backend_override(monkeypatch):
    monkeypatch.delenv(devices.BACKEND_VARIABLE, raising=False)


# --------------------------------------------------------------------------- the decisions


@pytest.mark.parametrize(("ranks", "gpus", "nccl", "expected"), [
    (1, 0, True, "gloo"),    # no GPU
    (1, 1, True, "nccl"),    # one rank, one GPU
    (2, 1, True, "gloo"),    # two ranks cannot share one GPU under NCCL
    (2, 2, True, "nccl"),
    (8, 4, True, "gloo"),
    (2, 2, False, "gloo"),   # a build without NCCL
])
def test_choose_backend(ranks, gpus, nccl, expected):
    assert devices.choose_backend(ranks, gpus=gpus, nccl_available=nccl) == expected


def test_choose_backend_on_this_machine_and_the_override(monkeypatch):
    assert devices.choose_backend(1) == ("nccl" if devices.gpu_count() and
                                          torch.distributed.is_nccl_available() else "gloo")
    monkeypatch.setenv(devices.BACKEND_VARIABLE, "gloo")
    assert devices.choose_backend(1, gpus=8, nccl_available=True) == "gloo"
    monkeypatch.setenv(devices.BACKEND_VARIABLE, "mpi")
    with pytest.raises(ValueError, match="COURSE_BACKEND must be 'gloo' or 'nccl', got 'mpi'"):
        devices.choose_backend(1)


def test_device_for_and_init_kwargs():
    assert devices.device_for("nccl", 3) == torch.device("cuda", 3)
    assert devices.device_for("gloo", 3) == torch.device("cpu")
    assert devices.init_kwargs("gloo", 0) == {}


def test_rank_device_outside_a_group_is_the_cpu():
    assert devices.rank_device() == torch.device("cpu")


def test_local_rank_reads_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert devices.local_rank() == 0


@pytest.mark.parametrize(("gpus", "visible", "expected"), [
    (1, "", [{"COURSE_BACKEND": "gloo"}] * 2),         # one GPU: two nodes would share it
    (2, "", [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]),
    (2, "4,5", [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "5"}]),
    (0, "", [{"COURSE_BACKEND": "gloo"}] * 2),
])
def test_emulated_nodes_never_share_a_gpu(monkeypatch, gpus, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert [devices.emulated_node_env(n, 2, 1, gpus=gpus) for n in range(2)] == expected


def test_emulated_nodes_with_two_ranks_each_get_two_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [devices.emulated_node_env(n, 2, 2, gpus=4) for n in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert devices.emulated_node_env(1, 2, 2, gpus=3) == {"COURSE_BACKEND": "gloo"}


@pytest.mark.parametrize(("strategies", "gpus", "nccl", "where", "expected"), [
    (STRATEGIES, 0, True, "auto", "cpu"),
    (STRATEGIES, 1, True, "auto", "cpu"),    # one GPU: dp and ddp_2 need two, so all on the CPU
    (("single", "ddp_1"), 1, True, "auto", "gpu"),
    (STRATEGIES, 2, True, "auto", "gpu"),
    (STRATEGIES, 2, False, "auto", "cpu"),   # DDP on GPUs needs NCCL
    (("single", "dp"), 2, False, "auto", "gpu"),   # ... DataParallel does not
    (STRATEGIES, 8, True, "cpu", "cpu"),
])
def test_strategy_placement_compares_like_with_like(strategies, gpus, nccl, where, expected):
    assert strategy_placement(strategies, 2, where, gpus=gpus, nccl=nccl) == expected


def test_bench_figures_all_run_on_the_cpu_with_gloo(monkeypatch, capsys):
    """make bench compares ranks with ranks: on a GPU machine too, every launch it makes is gloo."""
    from course_utils import distributed
    from course_utils.faults import torchrun as torchrun_module

    calls = []

    def fake_launch(fn, world_size, *args, **kwargs):
        calls.append((fn.__name__, kwargs))
        if fn.__name__ == "_harness_rank":
            return [{"step_time_s": 1.0, "memory_mb": [1.0], "state_mb": 1.0, "on_gpu": False,
                     "where": "cpu"}] * world_size
        if fn.__name__ == "_ring_rank":
            return [{mb: (1.0, 1.0) for mb in args[0]}] * world_size
        if fn.__name__ == "step_times_rank":
            return [{"step_s": dict.fromkeys(VERSIONS, 1.0),
                     "buckets": {"bucketed": 1, "torch_ddp": 1}}] * world_size
        return list(range(world_size))

    class FakeJob:
        returncode, lines, log_lines = 0, [], []

    def fake_torchrun(module, n, *script_args, **kwargs):
        calls.append(("torchrun", kwargs))
        return FakeJob()

    monkeypatch.setattr(distributed, "launch", fake_launch)
    monkeypatch.setattr(torchrun_module, "torchrun", fake_torchrun)
    monkeypatch.setattr(bench, "_dp_overhead", lambda *a: (1.0, 1.0))
    bench.main(["--repeats", "5"])
    assert calls and all(kw.get("backend") == "gloo" for name, kw in calls if name != "torchrun")
    assert all(kw["env"] == {devices.BACKEND_VARIABLE: "gloo"} for name, kw in calls if name == "torchrun")
    assert "every figure runs on the CPU with the gloo backend" in capsys.readouterr().out


# ------------------------------------------------------------------------------- the audit


def test_the_audit_flags_what_would_fail_under_nccl():
    with DeviceAudit(torch.device("cpu")) as audit:
        model = nn.Linear(4, 2)
        model(torch.randn(3, 4))
    assert audit.violations == [
        "Linear input: a (3, 4) torch.float32 tensor was never put on the rank's device",
        "Linear parameter or buffer: a (2, 4) torch.float32 tensor was never put on the rank's device",
        "Linear parameter or buffer: a (2,) torch.float32 tensor was never put on the rank's device",
    ]


def test_the_audit_accepts_placed_tensors_and_what_is_computed_from_them():
    device = torch.device("cpu")
    with DeviceAudit(device) as audit:
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).to(device)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)).to(device)
        y = model(torch.cat([x, torch.ones(1, 4, device=device)]) * 2)
        model[0](y.new_zeros(3, 4))
        y.sum().backward()
    assert audit.violations == []


def test_the_audit_follows_a_tensor_through_operations():
    with DeviceAudit(torch.device("cpu")) as audit:
        model = nn.Linear(4, 2).to("cpu")
        model((torch.randn(3, 4) * 2)[1:])  # computed from an unplaced tensor: still unplaced
    assert len(audit.violations) == 1 and audit.violations[0].startswith("Linear input: a (2, 4)")


def _flat_collectives_unplaced(rank, world_size):
    """A rank that hands the flat collectives tensors it never put on its device, under 2.13's
    names (through compat, as ZeRO by hand does) and under the older ones."""
    import torch.distributed as dist

    from course_utils import compat

    with DeviceAudit() as audit:
        compat.reduce_scatter_single(torch.empty(2), torch.ones(2 * world_size))
        compat.all_gather_single(torch.empty(2 * world_size), torch.ones(2))
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world_size))
        dist.all_gather_into_tensor(torch.empty(2 * world_size), torch.ones(2))
    return [v.split(":")[0] for v in audit.violations]


def test_the_audit_checks_the_flat_collectives_under_both_releases_names():
    for found in launch(_flat_collectives_unplaced, 2, echo=False, backend="gloo"):
        assert found == ["dist.reduce_scatter_single"] * 2 + ["dist.all_gather_single"] * 2 + [
            "dist.reduce_scatter_tensor"] * 2 + ["dist.all_gather_into_tensor"] * 2


def _rank_functions() -> dict[str, object]:
    """Every function of course_utils that takes (rank, world_size, ...): what launch runs."""
    found = {}
    # the lessons' modules (every wing and the shared ground) and the tools (make bench runs ranks);
    # not the launcher's machinery nor the exercises' judges, which this audit has never covered
    for info in pkgutil.walk_packages(course_utils.__path__, "course_utils."):
        if info.name.startswith(("course_utils.launcher", "course_utils.exercises")):
            continue
        module = importlib.import_module(info.name)
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                params = list(inspect.signature(fn).parameters)
                if params[:2] == ["rank", "world_size"]:
                    found[f"{info.name.removeprefix('course_utils.')}.{name}"] = fn
    return found


TINY = TrainConfig(data_size=16, global_batch_size=8, epochs=1)
BERT = {"vocab": 32, "hidden": 16, "layers": 1, "heads": 2, "intermediate": 32, "max_len": 8}

#: name -> (world size, arguments after rank and world_size), chosen so that nothing fails or
#: hangs on purpose: the audit needs the function to finish.
CASES = {
    "sharding.strategies._harness_rank single": (1, ("single", 16, 8, 2, 1)),
    "sharding.strategies._harness_rank dp": (1, ("dp", 16, 8, 2, 1)),
    "sharding.strategies._harness_rank parallel_criterion": (1, ("parallel_criterion", 16, 8, 2, 1)),
    "sharding.strategies._harness_rank ddp_2": (2, ("ddp_2", 16, 8, 2, 1)),
    "sharding.strategies._harness_rank ddp_2_amp": (2, ("ddp_2_amp", 16, 8, 2, 1)),
    "sharding.strategies._harness_rank zero1_2": (2, ("zero1_2", 16, 8, 2, 1)),
    "sharding.strategies._harness_rank fsdp_2": (2, ("fsdp_2", 16, 8, 2, 1)),
    "tools.bench._ring_rank": (2, ([1], 1)),
    "tools.bench._noop_rank": (2, ()),
    "ddp.collectives.check_ring_all_reduce": (3, ([1, 7, 64],)),
    "ddp.demos.hello": (2, ()),
    "ddp.demos.all_reduce_sum": (2, ()),
    "ddp.demos.raise_on_rank": (2, (99, "nobody raises")),
    "ddp.demos.block_in_collective": (2, (99,)),
    "ddp.demos.unused_parameters": (2, (True, 2)),
    "ddp.demos.batchnorm_under_ddp plain": (2, (False,)),
    "ddp.demos.batchnorm_under_ddp sync": (2, (True,)),
    "ddp.demos.torch_sync_batchnorm_on_cpu": (2, ()),
    "ddp.demos.save_on_rank_0": (2, ("{tmp}/model.pt",)),
    "ddp.demos.ddp_buckets": (2, (0.25, 2)),
    "ddp.demos.mismatched_all_reduce": (2, (True,)),
    "ddp.train.train_ddp": (2, (TINY,)),
    "ddp.train.train_resumable": (2, (TINY,)),
    "dataparallel.memory._ddp_peak_rank": (2, (BERT, 2)),
    "sharding.runs.zero_by_hand_rank": (2, ()),
    "sharding.runs.api_rank": (2, (2, 8, 1e-2, "{tmp}/ckpt")),
    "sharding.mesh.mesh_rank": (4, (2,)),
    # notebook 12: the zoo's rank functions, each in a form that finishes
    "debugging.failure_zoo.sampler_orders": (2, (8, 2, True)),
    "debugging.failure_zoo.eval_on_rank_0_only": (1, ()),  # one rank: nobody else to wait for
    "debugging.failure_zoo.evaluate_everywhere": (2, ()),
    "debugging.failure_zoo.padded_accuracy": (2, (5,)),
    "debugging.failure_zoo.exact_accuracy": (2, (5,)),
    "debugging.failure_zoo.collectives_out_of_order": (1, ()),
    "debugging.failure_zoo.collectives_in_order": (2, ()),
    "debugging.failure_zoo.save_then_load": (2, ("{tmp}/checkpoint.pt", True)),
    "debugging.failure_zoo.out_of_order_as_on_nccl": (1, ()),
    "debugging.training_bugs.train_accumulating": (2, (training_bugs.accumulate_step, 2, 3, 1)),
    "debugging.training_bugs.train_uneven join": (2, ([3, 2], "join")),
    "debugging.training_bugs.train_uneven equal": (2, ([3, 2], "equal")),
    "debugging.training_bugs.train_unused": (2, ("static_graph", 2)),
    "debugging.training_bugs.different_seeds": (2, ()),
    "debugging.gradient_compression.train_compressed": (2, ("bf16", 2)),
    "debugging.training_bugs.wrapped_keys": (1, ()),
    "debugging.training_bugs.train_joined_logging": (2, ([3, 2], False)),
    "debugging.gradient_compression.torch_bf16_hook": (2, ("a CUDA build with NCCL 2.21", 2)),
    # notebook 06: DDP by hand, every version, and make bench's step times
    "ddp.by_hand_runs.train_rank after_backward": (2, ("after_backward",)),
    "ddp.by_hand_runs.train_rank per_parameter": (2, ("per_parameter",)),
    "ddp.by_hand_runs.train_rank bucketed": (2, ("bucketed", 0.0015)),
    "ddp.by_hand_runs.train_rank torch_ddp": (2, ("torch_ddp",)),
    "ddp.by_hand_timing.step_times_rank": (2, (64, 8, 0.01, 1)),
    "ddp.by_hand_runs.train_versions": (2, ([("per_parameter", None), ("bucketed", 0.001),
                                             ("torch_ddp", None)], {"steps": 1, "tied": True})),
    "ddp.by_hand_timing.timelines_rank": (2, (32, 4, 0.01, 2, 1)),
    "ddp.by_hand_trials.trial_rank": (2, ("lesson", "no_sync", 0.0005, 1)),
    "ddp.by_hand_trials.trials_rank": (2, ([("routed", "steps", None)], 1)),
    "ddp.by_hand_trials.routed_orders_rank": (2, ()),
    "ddp.by_hand_trials.torch_bucket_counts_rank": (2, (32, 0.01)),
    "ddp.by_hand_trials.comm_hook_rank": (2, (1,)),
    "ddp.by_hand_arming.arming_rank": (2, ()),
    # notebook 07: what the global batch does to training
    "ddp.batch_size_runs.two_ways_rank": (2, (8, 4, 2, 0.1)),
    "ddp.batch_size_runs.gradient_draws_rank": (2, (torch.zeros(8), [1, 4], 3)),
    "ddp.batch_size_runs.sweep_point_rank": (2, (8, 0.1, 1, 2, 2)),
    "ddp.batch_size_runs.noise_scale_rank": (2, (4, 0.1, 2)),
    "ddp.accumulation.accumulation_rank": (2, (2, 4, 2, 0.1)),
    "ddp.accumulation.accumulation_runs": (2, ([(2, 4, "no_sync"), (2, 4, "sync every micro-batch")], 2,
                                               0.1)),
}
#: Rank functions that cannot finish under the audit, and why that is safe.
EXEMPT = {
    "faults.crashes.die_while_saving": "kills itself with SIGKILL mid-save by design; it calls no "
                                    "module and no collective, so it has no device to get wrong",
    "ddp.job.build_job": "train_ddp and train_resumable build their job with it (audited above)",
    "sharding.runs.dcp_load_rank": "needs the checkpoint that sharding.runs.api_rank writes (audited above); "
                                  "tests/test_sharding.py runs the two in turn",
    "debugging.failure_zoo.rendezvous_at": "makes its own process group (launch(init='none')) and computes "
                                 "nothing: no tensor, no module",
    "debugging.hangs._started": "starts the fork server before a broken program's clock runs; no "
                                "process group, no tensor",
}


def test_every_rank_function_has_an_audit_case():
    found = set(_rank_functions())
    covered = {name.split(" ")[0] for name in CASES} | set(EXEMPT)
    assert found - covered == set(), "rank functions without a device-audit case"
    assert covered - found == set(), "audit cases for functions that are gone"


def _audit_cases(rank, world_size, cases):
    """Run every case, one after another in this group, each under its own audit."""
    import torch.distributed as dist

    found = {}
    for case, fn, args in cases:
        try:
            found[case] = audited(rank, world_size, fn, *args)
        except Exception as err:  # reported per case below
            found[case] = {"error": f"{type(err).__name__}: {err}"}
        dist.barrier()  # every rank finishes a case before the next begins
    return found


@pytest.fixture(scope="module")
def audits(tmp_path_factory):
    """The audit of every case: one launch per world size (a launch per case costs a group set-up
    and teardown each), with no process left behind."""
    tmp = tmp_path_factory.mktemp("audit")
    functions = _rank_functions()
    results = {}
    before = {p.pid for p in rank_processes()}
    with recording_ranks() as started:
        for world_size in sorted({n for n, _ in CASES.values()}):
            cases = [(case, functions[case.split(" ")[0]],
                      tuple(a.format(tmp=tmp) if isinstance(a, str) else a for a in args))
                     for case, (n, args) in CASES.items() if n == world_size]
            per_rank = launch(_audit_cases, world_size, cases, echo=False, backend="gloo", timeout_s=300)
            for case, _, _ in cases:
                results[case] = [ranks[case] for ranks in per_rank]
    assert [p for p in rank_processes() if p.pid not in before] + started.alive() == []
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_function_keeps_its_tensors_on_the_rank_device(case, audits):
    results = audits[case]
    assert [r.get("error") for r in results] == [None] * len(results)
    assert [r["device"] for r in results] == ["cpu"] * len(results)
    assert [r["violations"] for r in results] == [[]] * len(results)


def test_under_nccl_a_rank_binds_its_gpu_before_cuda_work_and_tells_the_group(monkeypatch):
    """init_kwargs makes cuda:LOCAL_RANK current and passes device_id, so that NCCL's barrier()
    knows its device (no "using the device under current context" warning in stored outputs)."""
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    assert devices.init_kwargs("nccl", 1) == {"device_id": torch.device("cuda", 1)}
    assert bound == [torch.device("cuda", 1)]
