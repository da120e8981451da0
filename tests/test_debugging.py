"""Notebook 12's zoo: every broken program fails the way the notebook says (hang, error, wrong
value), every fix equals its single-process reference, and a hang is reported with the stacks of
the stuck ranks. The exercises' solutions and wrong answers are tested in test_exercises_nb11.py.
"""

import os
import socket
import sys
import types

import pytest
import torch
from conftest import stopped_once_hung

from course_utils.debugging import failure_zoo, flight_recorder, gradient_compression, hangs, training_bugs
from course_utils.debugging.hangs import where_stuck
from course_utils.distributed import RankError, launch

pytestmark = pytest.mark.usefixtures("nothing_left_behind")

HANG_S = 3


def assert_params_equal(got, reference, exact=False):
    assert set(got) == set(reference)
    for name, value in reference.items():
        if exact:
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value)


def stuck(fn, *args, hung_in, world_size=2):
    """The LaunchTimeout of ``fn``'s hang, and where_stuck's lines: first tried with HANG_S, longer
    if a rank had not reached its hang yet (``hung_in``: see tests/conftest.py)."""
    error, _, _ = stopped_once_hung(lambda t: launch(fn, world_size, *args, timeout_s=t, echo=False),
                                    HANG_S, hung_in)
    return error, where_stuck(error.stacks)


# ----------------------------------------------------------------------------- no_sync and Join

@pytest.mark.parametrize(("world_size", "k"), [(2, 4), (3, 2), (2, 1)])
def test_no_sync_accumulation_equals_one_big_batch(world_size, k):
    reference = training_bugs.accumulation_reference(world_size, k, 3, 3)
    ranks = launch(training_bugs.train_accumulating, world_size, training_bugs.accumulate_step, k, 3, 3,
                   echo=False)
    for params in ranks:
        assert_params_equal(params, reference)
        assert_params_equal(params, ranks[0], exact=True)  # every rank bitwise the same


def test_off_by_one_accumulation_lets_the_ranks_drift_apart():
    reference = training_bugs.accumulation_reference(2, 4, 3, 3)
    ranks = launch(training_bugs.train_accumulating, 2, training_bugs.accumulate_step_off_by_one, 4, 3, 3,
                   echo=False)
    assert not torch.allclose(ranks[0]["0.weight"], ranks[1]["0.weight"])
    assert not torch.allclose(ranks[0]["0.weight"], reference["0.weight"])


@pytest.mark.parametrize("batches", [[3, 2], [1, 4], [2, 2, 5]])
@pytest.mark.parametrize("mode", ["join", "equal"])
def test_join_and_equal_shards_equal_their_references(batches, mode):
    results = launch(training_bugs.train_uneven, len(batches), batches, mode, echo=False)
    reference = training_bugs.uneven_reference(batches, mode)
    expected_steps = batches if mode == "join" else [min(batches)] * len(batches)
    assert [r["steps"] for r in results] == expected_steps
    for result in results:
        assert_params_equal(result["params"], reference)


def test_join_reference_differs_from_dropping_batches():
    """The Join reference counts the extra batches: it is not the equal-shards one in disguise."""
    join, equal = (training_bugs.uneven_reference([3, 2], mode) for mode in ("join", "equal"))
    assert not torch.allclose(join["0.weight"], equal["0.weight"])


# ----------------------------------------------------------------------------- the hangs

@pytest.mark.stress  # notebook 12 shows the same stuck lines under nbval in make test
def test_uneven_inputs_without_join_hang_in_backward():
    err, where = stuck(training_bugs.train_uneven, [3, 2], "plain", hung_in={0: "backward"})
    assert list(err.stacks) == [0]  # rank 1 finished its two batches
    assert where[0].startswith("backward -> backward") and "at: F.mse_loss" in where[0]


@pytest.mark.stress  # notebook 12 shows the same stuck lines under nbval in make test
def test_evaluation_on_rank_0_only_hangs_in_all_reduce_and_the_fix_finishes():
    _, where = stuck(failure_zoo.eval_on_rank_0_only, hung_in={0: "all_reduce"})
    assert where == {0: "eval_on_rank_0_only -> evaluate_everywhere -> all_reduce  at: "
                        "dist.all_reduce(counts)  # every rank must get here"}
    assert launch(failure_zoo.evaluate_everywhere, 2, echo=False) == pytest.approx([0.6, 0.6])


@pytest.mark.stress  # notebook 12 shows the same stuck lines under nbval in make test
def test_collectives_out_of_order_hang_and_detail_names_them():
    _, where = stuck(failure_zoo.collectives_out_of_order, hung_in={0: "all_reduce", 1: "broadcast"})
    assert where[0].startswith("collectives_out_of_order -> all_reduce")
    assert where[1].startswith("collectives_out_of_order -> broadcast")
    found = launch(failure_zoo.collectives_out_of_order, 2, True, timeout_s=20, echo=False)
    assert found == ["rank 0 runs ALLREDUCE; rank 1 runs BROADCAST"] * 2
    assert launch(failure_zoo.collectives_in_order, 3, echo=False) == [[3.0, 0.0]] * 3


def test_where_stuck_keeps_function_names_and_the_waiting_line():
    torch_dir = f"/v/site-packages{os.sep}torch{os.sep}distributed"
    stacks = {1: ['  File "/x/mine.py", line 3, in step', "    helper()",
                  '  File "/x/mine.py", line 9, in helper', "    dist.barrier()",
                  f'  File "{torch_dir}/c10d_logger.py", line 8, in wrapper', "    return func(*args)",
                  f'  File "{torch_dir}/distributed_c10d.py", line 5, in barrier', "    work.wait()"]}
    assert where_stuck(stacks) == {1: "step -> helper -> barrier  at: dist.barrier()"}
    assert where_stuck(stacks, last=1) == {1: "barrier  at: dist.barrier()"}
    assert where_stuck({0: []}) == {0: "(no Python frame)"}


# ----------------------------------------------------------------------------- the others

def test_set_epoch_changes_the_order_and_forgetting_it_does_not():
    for set_epoch in (False, True):
        orders = launch(failure_zoo.sampler_orders, 2, 8, 3, set_epoch, echo=False)
        assert (orders[0][0] == orders[0][1] == orders[0][2]) is not set_epoch
        for epoch in range(3):
            assert sorted(orders[0][epoch] + orders[1][epoch]) == list(range(8))


def test_padding_inflates_accuracy_and_the_all_gather_removes_it():
    truth = launch(failure_zoo.evaluate_everywhere, 1, 10, echo=False)[0]
    padded = launch(failure_zoo.padded_accuracy, 4, 10, echo=False)
    exact = launch(failure_zoo.exact_accuracy, 4, 10, echo=False)
    assert truth == pytest.approx(0.6)
    assert padded[0]["accuracy"] == pytest.approx(8 / 12)  # rows 0 and 1 (both right) twice
    assert all(r == {"counted": 10, "accuracy": pytest.approx(truth)} for r in exact)


def test_unused_parameters_fail_named_under_debug_and_train_with_either_fix():
    with pytest.raises(RankError, match="Expected to have finished reduction"):
        launch(training_bugs.train_unused, 2, "plain", echo=False)
    with pytest.raises(RankError,
                       match=r"did not receive grad for rank \d: unused_head.bias, unused_head.weight"):
        launch(training_bugs.train_unused, 2, "debug", echo=False)
    found = launch(training_bugs.train_unused, 2, "find_unused", echo=False)
    static = launch(training_bugs.train_unused, 2, "static_graph", echo=False)
    assert found == static and len(found[0]) == 3


def test_ddp_broadcasts_weights_but_not_random_state():
    r0, r1 = launch(training_bugs.different_seeds, 2, echo=False)
    assert r0["before"] != r1["before"] and r0["after"] == r1["after"] == r0["before"]
    assert r0["data order"] != r1["data order"]
    assert sorted(r0["sampler order"] + r1["sampler order"]) == list(range(8))


def test_saving_without_a_barrier_races_and_with_one_loads_everywhere(tmp_path):
    with pytest.raises(RankError) as info:
        launch(failure_zoo.save_then_load, 2, str(tmp_path / "a.pt"), False, echo=False)
    assert (info.value.rank, info.value.exc_type) == (1, "FileNotFoundError")
    weights = launch(failure_zoo.save_then_load, 2, str(tmp_path / "b.pt"), True, echo=False)
    assert weights[0] == weights[1] and len(weights[0]) == 2


def test_a_port_in_use_fails_the_rendezvous_and_launch_is_not_affected():
    with socket.socket() as leftover:
        leftover.bind(("127.0.0.1", 0))
        leftover.listen()
        with pytest.raises(RankError, match="EADDRINUSE") as info:
            launch(failure_zoo.rendezvous_at, 2, leftover.getsockname()[1], init="none", timeout_s=20,
                   echo=False)
        assert info.value.rank == 0
        assert launch(failure_zoo.collectives_in_order, 2, echo=False) == [[2.0, 0.0]] * 2


def test_compression_hooks_halve_the_bytes_and_keep_ranks_identical():
    runs = {hook: launch(gradient_compression.train_compressed, 2, hook, 5, echo=False)
            for hook in ("fp32", "fp16", "bf16")}
    fp32_bytes = runs["fp32"][0]["bytes_per_step"]
    assert fp32_bytes == 4 * sum(p.numel() for p in training_bugs.small_model().parameters())
    for hook in ("fp16", "bf16"):
        assert runs[hook][0]["bytes_per_step"] == fp32_bytes / 2
        for name, value in runs[hook][0]["params"].items():
            assert torch.equal(value, runs[hook][1]["params"][name])
            torch.testing.assert_close(value, runs["fp32"][0]["params"][name], atol=1e-2, rtol=0)
        fp32 = runs["fp32"][0]["params"]
        assert any(not torch.equal(v, fp32[n]) for n, v in runs[hook][0]["params"].items())  # lossy


def test_wrapped_keys_nest_in_the_order_of_wrapping_and_get_model_state_dict_drops_them():
    keys = launch(training_bugs.wrapped_keys, 1, echo=False)[0]
    assert keys["state_dict"] == {
        "model": ["weight", "bias"], "DDP(model)": ["module.weight", "module.bias"],
        "torch.compile(model)": ["_orig_mod.weight", "_orig_mod.bias"],
        "DDP(torch.compile(model))": ["module._orig_mod.weight", "module._orig_mod.bias"],
        "torch.compile(DDP(model))": ["_orig_mod.module.weight", "_orig_mod.module.bias"],
        "model.compile(); DDP(model)": ["module.weight", "module.bias"]}  # compile adds no prefix
    assert keys["get_model_state_dict"] == dict.fromkeys(keys["state_dict"], ["weight", "bias"])


# ----------------------------------------------------------------------------- the zoo on gloo

def test_run_broken_runs_on_gloo_where_launch_would_pick_nccl(monkeypatch, capsys):
    """A machine with GPUs: launch's own choice would be NCCL. The zoo must still run on gloo,
    where a hang waits at the collective that does not match (notebook 12, section 13)."""
    from course_utils import distributed

    monkeypatch.setattr(distributed, "choose_backend", lambda *args, **kwargs: "nccl")
    # launch's own choice would be NCCL, which binds a GPU this machine lacks
    with pytest.raises(RankError, match="cuda"):
        launch(failure_zoo.collectives_in_order, 2, timeout_s=20, echo=False, start="forkserver")
    backends = []

    def spy(*args, **kwargs):
        backends.append(kwargs.get("backend"))
        return launch(*args, **kwargs)

    monkeypatch.setattr(hangs, "launch", spy)
    hang = hangs.run_broken(failure_zoo.eval_on_rank_0_only)
    assert backends and set(backends) == {"gloo"} == {hangs.ZOO_BACKEND}  # the warm-up, then the program
    assert list(hang.stacks) == [0]  # rank 0 stuck in all_reduce, rank 1 finished
    assert "rank 0 was in eval_on_rank_0_only -> evaluate_everywhere -> all_reduce" in capsys.readouterr().out
    assert flight_recorder.first_disagreement(hang.flight_records) == (  # rank 1 never called it
        "group 0, collective #1: rank 0 ran gloo:all_reduce [[2]] NOT DONE; rank 1 ran (nothing)")


def test_a_run_stopped_before_the_ranks_entered_the_program_is_run_again_longer(monkeypatch, capsys):
    """Slow is not stuck: a rank still starting (importing torch) when the limit comes is not
    where the program hangs, nor is one whose Flight Recorder still watches (it began too late for
    its dump to be final). run_broken then runs the program again with twice the limit,
    HANG_TRIES runs at most, and reports the run that counted. The runs are stood in for here."""
    frame = '  File "zoo.py", line 3, in {}'
    starting = hangs.Hang({0: [frame.format("eval_on_rank_0_only")], 1: [frame.format("<module>")]}, {})
    watching = hangs.Hang({0: ["  (another thread)", frame.format("_dump_when_stuck"),
                               frame.format("eval_on_rank_0_only"), frame.format("all_reduce")]}, {})
    inside = hangs.Hang({0: [frame.format("eval_on_rank_0_only"), frame.format("all_reduce")]}, {})
    runs = [starting, watching, inside]
    limits = []

    def stand_in(limit, fn, args, world_size):
        limits.append(limit)
        return f"within {limit:g} s", runs[len(limits) - 1]

    monkeypatch.setattr(hangs, "_stopped_after", stand_in)
    monkeypatch.setattr(hangs, "launch", lambda *args, **kwargs: [0, 1])  # the warm-up
    assert hangs.run_broken(failure_zoo.eval_on_rank_0_only) is inside
    first = hangs.hang_limit()
    assert limits == [first, 2 * first, 4 * first] and hangs.HANG_TRIES == 3
    assert capsys.readouterr().out.splitlines() == [
        f"LaunchTimeout: within {4 * first:g} s", "  rank 0 was in eval_on_rank_0_only -> all_reduce"]
    limits.clear()  # the last run is reported even if a rank is still starting: it is evidence too
    monkeypatch.setattr(hangs, "HANG_TRIES", 2)
    assert hangs.run_broken(failure_zoo.eval_on_rank_0_only) is watching and len(limits) == 2
    runs[0] = hangs.Hang({0: []}, {})  # a stack that came back empty says nothing either
    limits.clear()
    assert hangs.run_broken(failure_zoo.eval_on_rank_0_only) is watching and len(limits) == 2


def test_the_hang_limit_is_longer_where_ranks_are_fresh_interpreters(monkeypatch):
    from course_utils.launcher import forkserver

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # as in a kernel
    monkeypatch.setenv(forkserver.START_VARIABLE, "subprocess")  # as off Linux
    assert hangs.hang_limit() == hangs.HANG_FRESH_S >= 3 * 4.7  # 3x the slowest measured
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.delenv(forkserver.START_VARIABLE)
    assert hangs.hang_limit() == hangs.HANG_FRESH_S
    monkeypatch.setattr(sys, "platform", "linux")  # with a GPU or without: ranks are forked
    assert hangs.hang_limit() == hangs.HANG_S == 2


def test_a_collective_of_ones_own_inside_join_is_not_shadowed_and_after_the_loop_is_fine():
    with pytest.raises(RankError) as info:
        launch(training_bugs.train_joined_logging, 2, [3, 2], True, timeout_s=60, echo=False,
               backend="gloo")  # an error, not a hang: a busy machine must not turn it into a timeout
    assert info.value.rank == 1 and info.value.exc_type == "ProcessDied"  # gloo aborted it
    assert any("Is there a distributed collective mismatch" in line for line in info.value.output)
    logged = launch(training_bugs.train_joined_logging, 2, [3, 2], False, echo=False)
    assert logged[0] == logged[1] and logged[0]["batches"] == 5


def test_ddp_checks_bf16_compress_hook_against_the_build_not_the_backend():
    with pytest.raises(RankError, match="BF16 all reduce communication hook required") as info:
        launch(gradient_compression.torch_bf16_hook, 2, "a CPU build", echo=False, backend="gloo")
    assert info.value.exc_type == "TypeError"
    cuda = launch(gradient_compression.torch_bf16_hook, 2, "a CUDA build with NCCL 2.21", echo=False,
                  backend="gloo")
    ours = launch(gradient_compression.train_compressed, 2, "bf16", echo=False, backend="gloo")
    for name, value in ours[0]["params"].items():  # the course's hook is PyTorch's, bit for bit
        assert torch.equal(cuda[0]["params"][name], value) and torch.equal(cuda[1]["params"][name], value)
    # and this machine's own build decides for real: refused exactly where torch has no CUDA+NCCL
    refused = torch.version.cuda is None and torch.version.hip is None
    try:
        launch(gradient_compression.torch_bf16_hook, 2, None, 2, echo=False, backend="gloo")
        assert not refused
    except RankError as err:
        assert refused and err.exc_type == "TypeError"


def test_built_as_restores_what_it_changed():
    before = (torch.version.cuda, torch.distributed.is_nccl_available())
    with gradient_compression.built_as("12.8", (2, 21, 5)):
        assert torch.version.cuda == "12.8" and torch.distributed.is_nccl_available()
        assert torch.cuda.nccl.version() == (2, 21, 5)
    assert (torch.version.cuda, torch.distributed.is_nccl_available()) == before


# ----------------------------------------------------------------------------- the Flight Recorder

@pytest.fixture(scope="module")
def out_of_order():
    """The out-of-order hang as notebook 12 runs it, with every rank's Flight Recorder dump."""
    return hangs.run_broken(failure_zoo.collectives_out_of_order)


def test_the_flight_recorder_dumps_each_stuck_rank_from_a_thread(out_of_order):
    records = out_of_order.flight_records
    assert sorted(records) == [0, 1]
    for rank, op in ((0, "gloo:all_reduce"), (1, "gloo:broadcast")):
        first, last = records[rank]["entries"][-2:]
        assert (first["profiling_name"], first["retired"]) == ("gloo:all_reduce", True)  # matched
        assert (last["profiling_name"], last["collective_seq_id"], last["retired"]) == (op, 2, False)
        assert last["frames"][2]["name"] == "collectives_out_of_order"  # the stack that called it
        # the table of groups is filled in, as the analyzer needs it
        assert records[rank]["pg_config"][last["process_group"][0]]["ranks"] == "[0, 1]"
    # the recorder's thread had ended and its frame is gone when launch took the stacks
    for lines in out_of_order.stacks.values():
        assert "(another thread)" not in lines and not any("_with_flight_recorder" in x for x in lines)
    assert hangs.where_stuck(out_of_order.stacks)[1].startswith("collectives_out_of_order -> broadcast")


def test_the_dumps_side_by_side_show_where_the_ranks_parted(out_of_order):
    table = flight_recorder.flight_table(out_of_order.flight_records)
    assert table[1].split() == ["group", "1,", "#1", "gloo:all_reduce", "[[1]]", "done",
                                "gloo:all_reduce", "[[1]]", "done"]
    assert "gloo:all_reduce [[4]] NOT DONE" in table[2] and "gloo:broadcast [[1]] NOT DONE" in table[2]
    assert flight_recorder.first_disagreement(out_of_order.flight_records) == (
        "group 1, collective #2: rank 0 ran gloo:all_reduce [[4]] NOT DONE; "
        "rank 1 ran gloo:broadcast [[1]] NOT DONE")


def test_torchs_analyzer_names_the_mismatch_and_leaves_no_trace(out_of_order, capfd):
    import gc

    verdicts = flight_recorder.analyze_flight_records(out_of_order.flight_records)
    assert verdicts == [
        "collective #2 of group 1 (gloo:all_reduce on ranks [0, 1]): culprit rank 1, Error type: "
        "COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' does not match found "
        "collective type: 'broadcast'"]
    assert capfd.readouterr() == ("", "")  # its log (local paths) stays out of a notebook
    assert gc.isenabled()  # the analyzer turns the collector off as it reads


def test_the_analyzer_needs_the_groups_gloo_leaves_out_of_its_dumps(out_of_order):
    records = {rank: {**record, "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}}
               for rank, record in out_of_order.flight_records.items()}  # as gloo writes them
    with pytest.raises(KeyError):
        flight_recorder.analyze_flight_records(records)


def _all_reduce_late(rank, world_size, delay_s):
    import time

    time.sleep(delay_s)
    torch.distributed.all_reduce(torch.ones(3))
    return rank


def test_no_dump_is_kept_from_after_the_launch_stopped_the_ranks(tmp_path):
    """A rank whose collective fails when launch stops its peer may return and dump: that dump
    would show the stop, not the hang, so nothing is written after ``until``."""
    import time

    late, on_time = tmp_path / "late", tmp_path / "on_time"
    for folder, until in ((late, time.time() + 0.3), (on_time, time.time() + 60)):
        folder.mkdir()
        launch(flight_recorder.recording_flight(_all_reduce_late, str(folder), until), 2, 0.6,
               echo=False, backend="gloo", timeout_s=30)
    assert flight_recorder.read_flight_records(str(late)) == {}
    records = flight_recorder.read_flight_records(str(on_time))
    assert [[e["input_sizes"] for e in records[r]["entries"]] for r in (0, 1)] == [[[[3]]]] * 2


@pytest.mark.stress  # notebook 12 shows the same stuck lines under nbval in make test
def test_under_nccl_the_hang_surfaces_where_the_result_is_read():
    hang = hangs.run_broken(failure_zoo.out_of_order_as_on_nccl)
    where = hangs.where_stuck(hang.stacks)
    assert sorted(where) == [0, 1]
    assert all(w.startswith("out_of_order_as_on_nccl  at: work.wait()") for w in where.values())
    assert flight_recorder.first_disagreement(hang.flight_records).startswith(
        "group 0, collective #1: rank 0 ran gloo:all_reduce")
