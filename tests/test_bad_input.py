# ruff: noqa: E501 - one case per line reads better than wrapped calls
"""Bad input, everywhere: every public function of course_utils refuses wrong types, empty
inputs, impossible sizes and missing files with a ValueError, TypeError or FileNotFoundError
whose message says what was expected.

One row per case: a call, the exception it must raise, and the start of the message. Calls that
need a state rather than an argument (a process group, GPUs) raise RuntimeError and are tested
with their modules; the command-line entry points exit with argparse's usage message (below).
"""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from course_utils import (
    amp,
    bench,
    by_hand,
    cluster,
    collectives,
    data,
    ddp_train,
    debug_training,
    debugging,
    devices,
    distributed,
    env,
    exercises,
    fault_demos,
    gpu_check,
    memory,
    models,
    nbtools,
    parallel_criterion,
    show,
    snapshots,
    splits,
)
from course_utils.exercises import edition

lin = nn.Linear(4, 2)


def memory_spec():
    return memory.ModelSpec.linear()


CASES = [
    ('amp.autocast mode', lambda: amp.autocast("fp8"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('amp.autocast type', lambda: amp.autocast(16),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('amp.autocast device', lambda: amp.autocast("bf16", "tpu"),
     ValueError, "device_type must be 'cpu' or 'cuda'"),
    ('amp.grad_scaler mode', lambda: amp.grad_scaler("half"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('amp.output_dtypes model', lambda: amp.output_dtypes("x", torch.ones(2, 4), "bf16"),
     TypeError, 'model must be an nn.Module'),
    ('amp.output_dtypes inputs', lambda: amp.output_dtypes(lin, [1, 2], "bf16"),
     TypeError, 'inputs must be a tensor'),
    ('bench.measure_loader workers', lambda: bench.measure_loader((-1,)),
     ValueError, 'num_workers must be a non-empty list of ints'),
    ('bench.measure_loader empty', lambda: bench.measure_loader(()),
     ValueError, 'num_workers must be a non-empty list of ints'),
    ('bench.measure_loader work', lambda: bench.measure_loader((0,), work="gpu"),
     ValueError, "work must be 'io' or 'cpu'"),
    ('bench.measure_strategies size', lambda: bench.measure_strategies("huge"),
     ValueError, "size must be one of ['large', 'medium', 'smal"),
    ('bench.measure_strategies strategy', lambda: bench.measure_strategies(strategies=("zero",)),
     ValueError, 'strategies must be a non-empty list drawn fro'),
    ('bench.measure_strategies empty', lambda: bench.measure_strategies(strategies=()),
     ValueError, 'strategies must be a non-empty list drawn fro'),
    ('bench.measure_strategies steps', lambda: bench.measure_strategies(steps=0),
     ValueError, 'steps must be an int >= 1'),
    ('by_hand.DataParallelByHand module', lambda: by_hand.DataParallelByHand("m", [0]),
     TypeError, 'module must be an nn.Module'),
    ('by_hand.DataParallelByHand devices', lambda: by_hand.DataParallelByHand(lin, []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('by_hand.compare_training batches', lambda: by_hand.compare_training(lin, [], nn.functional.mse_loss, by_hand.sim_devices(2)),
     ValueError, 'batches is empty: give at least one (inputs,'),
    ('by_hand.course_devices', lambda: by_hand.course_devices(0),
     ValueError, 'n must be an int >= 1'),
    ('by_hand.data_parallel devices', lambda: by_hand.data_parallel(lin, torch.ones(4, 4), []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('by_hand.data_parallel small', lambda: by_hand.data_parallel(lin, torch.ones(1, 4), by_hand.sim_devices(2)),
     ValueError, 'a tensor of shape (1, 4) has 1 entries along'),
    ('by_hand.gather empty', lambda: by_hand.gather([], by_hand.sim_devices(1)[0]),
     ValueError, 'outputs must be a non-empty list, one entry p'),
    ('by_hand.gather dim', lambda: by_hand.gather([torch.ones(2), torch.ones(2)], by_hand.sim_devices(1)[0], dim=3),
     ValueError, 'dim=3 is out of range for outputs with 1 dime'),
    ('by_hand.parallel_apply mismatch', lambda: by_hand.parallel_apply([lin], [torch.ones(1, 4), torch.ones(1, 4)]),
     ValueError, '1 replicas but 2 inputs: they must match'),
    ('by_hand.parse_devices bad', lambda: by_hand.parse_devices(["gpu0"]),
     ValueError, "unknown device 'gpu0': expected an int, 'cuda"),
    ('by_hand.parse_devices dup', lambda: by_hand.parse_devices(["sim:0", "sim:0"]),
     ValueError, 'device_ids repeats a device'),
    ('by_hand.replicate module', lambda: by_hand.replicate("x", by_hand.sim_devices(2)),
     TypeError, 'module must be an nn.Module'),
    ('by_hand.scatter dim', lambda: by_hand.scatter(torch.ones(4, 2), by_hand.sim_devices(2), dim=5),
     ValueError, 'dim=5 is out of range for a tensor of shape ('),
    ('by_hand.scatter_kwargs kwargs', lambda: by_hand.scatter_kwargs((torch.ones(4),), [1], by_hand.sim_devices(2)),
     TypeError, 'kwargs must be a dict or None'),
    ('by_hand.sim_devices', lambda: by_hand.sim_devices(-1),
     ValueError, 'n must be an int >= 1'),
    ('by_hand.time_steps repeats', lambda: by_hand.time_steps(lin, torch.ones(4, 4), by_hand.sim_devices(2), repeats=0),
     ValueError, 'repeats must be an int >= 1'),
    ('cluster.slurm_script nodes', lambda: cluster.slurm_script(job_name="j", nodes=0, gpus_per_node=1, module="m"),
     ValueError, 'nodes must be an int >= 1'),
    ('cluster.slurm_script module', lambda: cluster.slurm_script(job_name="j", nodes=1, gpus_per_node=1, module="a b"),
     ValueError, "module must be a dotted module name such as '"),
    ('collectives.chunk_bounds', lambda: collectives.chunk_bounds(-1, 2),
     ValueError, 'numel must be >= 0'),
    ('collectives.ring_bytes_per_rank', lambda: collectives.ring_bytes_per_rank(10, 0),
     ValueError, 'world_size must be an int >= 1'),
    ('collectives.ring_all_reduce type', lambda: collectives.ring_all_reduce([1.0]),
     TypeError, 'tensor must be a torch.Tensor'),
    ('collectives.check_ring_all_reduce', lambda: collectives.check_ring_all_reduce(0, 2, []),
     ValueError, 'sizes is empty: give at least one tensor size'),
    ('collectives.SyncBatchNormByHand', lambda: collectives.SyncBatchNormByHand(0),
     ValueError, 'num_features must be an int >= 1'),
    ('data.RandomDataset', lambda: data.RandomDataset(0, 5),
     ValueError, 'size must be an int >= 1'),
    ('data.RandomDataset type', lambda: data.RandomDataset("5", 5),
     TypeError, 'size must be an int'),
    ('data.SlowDataset', lambda: data.SlowDataset(4, -1.0),
     ValueError, 'seconds must be a number >= 0'),
    ('data.SlowDataset work', lambda: data.SlowDataset(4, 0.1, work="x"),
     ValueError, "work must be 'io' or 'cpu'"),
    ('data.make_loader batch', lambda: data.make_loader(data.RandomDataset(5, 5), 0),
     ValueError, 'batch_size must be an int >= 1'),
    ('data.regression_dataset', lambda: data.regression_dataset(0, 2, 2),
     ValueError, 'n_samples must be an int >= 1'),
    ('data.regression_dataset noise', lambda: data.regression_dataset(4, 2, 2, noise=-1),
     ValueError, 'noise must be a number >= 0'),
    ('ddp_train.TrainConfig', lambda: ddp_train.TrainConfig(epochs=0),
     ValueError, 'epochs must be an int >= 1'),
    ('ddp_train.TrainConfig batch', lambda: ddp_train.TrainConfig(global_batch_size=7).per_rank_batch_size(2),
     ValueError, 'global_batch_size=7 does not divide into 2 ra'),
    ('ddp_train.TrainConfig amp', lambda: ddp_train.TrainConfig(amp="fp8"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('ddp_train.make_dataset', lambda: ddp_train.make_dataset({"a": 1}),
     TypeError, 'config must be a TrainConfig'),
    ('ddp_train.make_model', lambda: ddp_train.make_model(None),
     TypeError, 'config must be a TrainConfig'),
    ('ddp_train.train_reference ws', lambda: ddp_train.train_reference(ddp_train.TrainConfig(), 0),
     ValueError, 'world_size must be an int >= 1'),
    ('ddp_train.train_reference cfg', lambda: ddp_train.train_reference("cfg", 2),
     TypeError, 'config must be a TrainConfig'),
    ('distributed.choose_backend', lambda: distributed.choose_backend(0),
     ValueError, 'ranks_on_this_machine must be an int >= 1'),
    ('env.course_plan', lambda: env.course_plan(-1, True, True),
     ValueError, 'gpus must be an int >= 0'),
    ('devices.choose_backend', lambda: devices.choose_backend(2, gpus=-1),
     ValueError, 'gpus must be an int >= 0'),
    ('devices.device_for', lambda: devices.device_for("mpi", 0),
     ValueError, "backend must be 'gloo' or 'nccl'"),
    ('devices.device_for rank', lambda: devices.device_for("gloo", -1),
     ValueError, 'local_rank must be an int >= 0'),
    ('devices.init_kwargs', lambda: devices.init_kwargs("nccl", 1.5),
     ValueError, 'local_rank must be an int >= 0'),
    ('devices.emulated_node_env', lambda: devices.emulated_node_env(2, 2, 1),
     ValueError, 'node must be an int in [0, 2)'),
    ('devices.emulated_node_env gpus', lambda: devices.emulated_node_env(0, 2, 1, gpus="2"),
     ValueError, 'gpus must be an int >= 0'),
    ('devices.audited', lambda: devices.audited(0, 1, "fn"),
     TypeError, 'fn must be a rank function'),
    ('bench.devices_needed', lambda: bench.devices_needed("zero", 2),
     ValueError, 'strategy must be one of'),
    ('bench.strategy_placement', lambda: bench.strategy_placement(["dp"], 2, "tpu"),
     ValueError, "where must be 'auto', 'cpu' or 'gpu'"),
    ('bench.strategy_placement gpu', lambda: bench.strategy_placement(["dp"], 2, "gpu", gpus=1),
     ValueError, "where='gpu' needs 2 GPU(s)"),
    ('distributed.init_from_torchrun', lambda: distributed.init_from_torchrun("mpi"),
     ValueError, "backend must be 'gloo' or 'nccl'"),
    ('distributed.init_from_torchrun timeout', lambda: distributed.init_from_torchrun("gloo", 0),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('distributed.launch fn', lambda: distributed.launch("f", 2),
     TypeError, 'fn must be a function'),
    ('distributed.launch ws', lambda: distributed.launch(distributed.rank_print, 0),
     ValueError, 'world_size must be an int >= 1'),
    ('distributed.launch timeout', lambda: distributed.launch(distributed.rank_print, 1, timeout_s=-1),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('distributed.launch init', lambda: distributed.launch(distributed.rank_print, 1, init=True),
     ValueError, "init must be 'store', 'env', 'tcp' or False"),
    ('distributed.launch stacks', lambda: distributed.launch(distributed.rank_print, 1, stacks="on"),
     TypeError, 'stacks must be True or False'),
    ('distributed.launch args', lambda: distributed.launch(distributed.rank_print, 1, (x for x in "ab")),
     TypeError, 'cannot send the arguments for fn to the ranks: args[0] is a generator'),
    ('distributed.torchrun module', lambda: distributed.torchrun("", 2),
     TypeError, "module must be a module name such as 'course_"),
    ('distributed.torchrun n', lambda: distributed.torchrun("m", 0),
     ValueError, 'nproc_per_node must be an int >= 1'),
    ('distributed.torchrun timeout', lambda: distributed.torchrun("m", 1, timeout_s=0),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('distributed.torchrun_nodes', lambda: distributed.torchrun_nodes("m", 0, 1),
     ValueError, 'nnodes must be an int >= 1'),
    ('distributed.torchrun_nodes id', lambda: distributed.torchrun_nodes("m", 2, 1, job_id=""),
     ValueError, 'job_id must be a non-empty name of letters, d'),
    ('distributed.torchrun_nodes args', lambda: distributed.torchrun_nodes("m", 2, 1, launcher_args="--x"),
     TypeError, 'launcher_args must be a tuple of strings'),
    ('distributed.torchrun_nodes env', lambda: distributed.torchrun_nodes("m", 2, 1, env={"A": 1}),
     TypeError, 'env must be a dict of strings to strings'),
    ('env.pick_device', lambda: env.pick_device(-1),
     ValueError, 'index must be >= 0'),
    ('env.pick_device type', lambda: env.pick_device("0"),
     TypeError, 'index must be an int'),
    ('env.seed_everything', lambda: env.seed_everything("0"),
     TypeError, 'seed must be an int'),
    ('env.seed_everything neg', lambda: env.seed_everything(-1),
     ValueError, 'seed must be in [0, 2**32)'),
    ('fault_demos.train_in_process', lambda: fault_demos.train_in_process(0),
     ValueError, 'total_steps must be an int >= 1'),
    ('fault_demos.train_in_process restore', lambda: fault_demos.train_in_process(5, "x", resume=True, restore=("weights",)),
     ValueError, "restore takes names from ('optimizer', 'rng',"),
    ('fault_demos.train_in_process nopath', lambda: fault_demos.train_in_process(5, stop_after=2),
     ValueError, 'stop_after and resume need a snapshot path'),
    ('fault_demos.die_while_saving', lambda: fault_demos.die_while_saving(0, 1, "x", "softly"),
     ValueError, "how must be 'atomic' or 'in place'"),
    ('gpu_check.NotebookResult', lambda: gpu_check.NotebookResult("00.ipynb", True, -1.0),
     ValueError, 'seconds must be a number >= 0'),
    ('gpu_check.TestResult', lambda: gpu_check.TestResult("t", "xpassed"),
     ValueError, "outcome must be one of ('passed', 'failed', 'e"),
    ('gpu_check.allowed_skip', lambda: gpu_check.allowed_skip("t", 1),
     TypeError, 'test must be a TestResult'),
    ('gpu_check.allowed_skip gpus', lambda: gpu_check.allowed_skip(gpu_check.TestResult("t", "skipped"), -1),
     ValueError, 'gpus must be an int >= 0'),
    ('gpu_check.parse_junit', lambda: gpu_check.parse_junit("/nonexistent/junit.xml"),
     FileNotFoundError, 'no JUnit XML at /nonexistent/junit.xml'),
    ('gpu_check.render_report', lambda: gpu_check.render_report({"torch": "2.13.0"}, [], []),
     ValueError, "env lacks ['devices', 'cuda', 'nccl', 'tf32']"),
    ('gpu_check.run_gpu_tests', lambda: gpu_check.run_gpu_tests("/nonexistent"),
     FileNotFoundError, 'no tests/ folder in /nonexistent'),
    ('gpu_check.run_gpu_tests timeout', lambda: gpu_check.run_gpu_tests(gpu_check.ROOT, timeout_s=0),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('gpu_check.run_notebook', lambda: gpu_check.run_notebook("missing.ipynb"),
     FileNotFoundError, 'no notebook at missing.ipynb'),
    ('gpu_check.verdict', lambda: gpu_check.verdict(["00.ipynb"], [], 0),
     TypeError, 'notebooks must be a list of NotebookResult'),
    ('memory.ledger strategy', lambda: memory.ledger(memory_spec(), "zero", batch_size=4, num_devices=2),
     ValueError, "strategy must be one of ('dp', 'parallel_crit"),
    ('memory.ledger batch', lambda: memory.ledger(memory_spec(), "dp", batch_size=0, num_devices=2),
     ValueError, 'batch_size must be an int >= 1'),
    ('memory.ledger outdev', lambda: memory.ledger(memory_spec(), "dp", batch_size=4, num_devices=2, output_device=2),
     ValueError, 'output_device must be in 0..1'),
    ('memory.ledger optimizer', lambda: memory.ledger(memory_spec(), "dp", batch_size=4, num_devices=2, optimizer="lion"),
     ValueError, "optimizer must be one of ['adam', 'adamw', 's"),
    ('memory.ledger spec', lambda: memory.ledger("bert", "dp", batch_size=4, num_devices=2),
     TypeError, 'spec must be a ModelSpec'),
    ('memory.ledger dtype', lambda: memory.ledger(memory_spec(), "dp", batch_size=4, num_devices=2, dtype=torch.int8),
     TypeError, 'dtype must be a floating torch.dtype'),
    ('memory.ModelSpec', lambda: memory.ModelSpec("m", -1, 0, 0, 1, 4, 1, 1, 4, 0),
     ValueError, 'parameters must be an int >= 0'),
    ('memory.ModelSpec itemsize', lambda: memory.ModelSpec("m", 1, 0, 0, 1, 0, 1, 1, 4, 0),
     ValueError, 'input_itemsize must be an int >= 1'),
    ('memory.plot_ledgers', lambda: memory.plot_ledgers([]),
     ValueError, 'ledgers is empty'),
    ('memory.saved_tensor_bytes', lambda: memory.saved_tensor_bytes("f"),
     TypeError, 'fn must be a function of no arguments that ru'),
    ('models.BertLike', lambda: models.BertLike(10, 30, 1, 4, 8, 4),
     ValueError, 'hidden=30 must be a multiple of heads=4'),
    ('models.ImageClassifier', lambda: models.ImageClassifier(0),
     ValueError, 'num_classes must be an int >= 1'),
    ('models.ImageClassifier widths', lambda: models.ImageClassifier(10, ()),
     ValueError, 'widths must be a non-empty tuple of channel c'),
    ('models.Model', lambda: models.Model(0, 2),
     ValueError, 'input_size must be an int >= 1'),
    ('models.SequenceGRU', lambda: models.SequenceGRU(0),
     ValueError, 'input_size must be an int >= 1'),
    ('models.SmallCNN', lambda: models.SmallCNN(0),
     ValueError, 'num_classes must be an int >= 1'),
    ('nbtools.badge_markdown', lambda: nbtools.badge_markdown("x.py"),
     ValueError, "expected a notebook file name like '00_x.ipyn"),
    ('nbtools.execute_notebook', lambda: nbtools.execute_notebook("missing.ipynb"),
     FileNotFoundError, 'no notebook at missing.ipynb'),
    ('nbtools.hygiene_problems', lambda: nbtools.hygiene_problems("missing.ipynb"),
     FileNotFoundError, 'no notebook at missing.ipynb'),
    ('nbtools.sync_header', lambda: nbtools.sync_header("missing.ipynb"),
     FileNotFoundError, 'no notebook at missing.ipynb'),
    ('nbtools.clean_metadata', lambda: nbtools.clean_metadata({"cells": 3}),
     TypeError, 'nb must be a notebook read with nbformat'),
    ('parallel_criterion.DataParallelCriterion', lambda: parallel_criterion.DataParallelCriterion("f", by_hand.sim_devices(2)),
     TypeError, 'criterion must be callable'),
    ('parallel_criterion.DataParallelCriterion red', lambda: parallel_criterion.DataParallelCriterion(nn.MSELoss(), by_hand.sim_devices(2), reduction="median"),
     ValueError, "reduction must be 'mean' or 'sum' (from the c"),
    ('parallel_criterion.DataParallelModel', lambda: parallel_criterion.DataParallelModel(lin, []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('snapshots.SkipFirst', lambda: snapshots.SkipFirst(range(3), -1),
     ValueError, 'skip must be >= 0'),
    ('snapshots.SkipFirst sampler', lambda: snapshots.SkipFirst(5),
     TypeError, 'sampler must be a sampler (iterable with a le'),
    ('snapshots.load_snapshot missing', lambda: snapshots.load_snapshot("/nonexistent/s.pt", lin),
     FileNotFoundError, 'no snapshot at /nonexistent/s.pt'),
    ('snapshots.load_snapshot path', lambda: snapshots.load_snapshot(3, lin),
     TypeError, 'path must be a str or a path'),
    ('snapshots.save_snapshot folder', lambda: snapshots.save_snapshot("/nonexistent/s.pt", lin, epoch=0, step_in_epoch=0, global_step=0),
     FileNotFoundError, 'cannot save a snapshot in /nonexistent: no su'),
    ('snapshots.save_snapshot neg', lambda: snapshots.save_snapshot("s.pt", lin, epoch=-1, step_in_epoch=0, global_step=0),
     ValueError, 'epoch must be >= 0'),
    ('snapshots.save_snapshot extra', lambda: snapshots.save_snapshot("s.pt", lin, epoch=0, step_in_epoch=0, global_step=0, extra=[1]),
     TypeError, 'extra must be a dict or None'),
    ('snapshots.strip_module_prefix', lambda: snapshots.strip_module_prefix([("a", 1)]),
     TypeError, 'state must be a state dict (a dict)'),
    ('splits.epoch_splits', lambda: splits.epoch_splits(0, 2, 2),
     ValueError, 'data_size must be an int >= 1'),
    ('splits.plot_epoch_splits', lambda: splits.plot_epoch_splits(10, 0, 2),
     ValueError, 'batch_size must be an int >= 1'),
    ('splits.simulate_tutorial', lambda: splits.simulate_tutorial(0),
     ValueError, 'num_devices must be an int >= 1'),
    ('splits.split_sizes', lambda: splits.split_sizes(4.0, 2),
     TypeError, 'batch_size must be an int'),
    # exercises and show (the exercise format; showing the course's code in notebooks)
    ('exercises.Exercise', lambda: exercises.Exercise(key="5.1", kind="predict", title="t", answer="a", starter="a = ...", solution="a = 1", judge=print, wrong=()),
     ValueError, "key must look like '05.2'"),
    ('exercises.bank', lambda: exercises.bank("five"),
     ValueError, "notebook must be a number such as '05'"),
    ('exercises.bank missing', lambda: exercises.bank(99),
     ValueError, "notebook 99 has no exercises"),
    ('exercises.find', lambda: exercises.find("01.99"),
     ValueError, "notebook 01 has no exercise 01.99"),
    ('exercises.check', lambda: exercises.check(1.1, 3),
     ValueError, "key must look like '05.2'"),
    ('exercises.verdict', lambda: exercises.verdict("01", 3),
     ValueError, "key must look like '05.2'"),
    ('exercises.progress', lambda: exercises.progress(None),
     ValueError, "notebook must be a number such as '05'"),
    ('exercises.run_source', lambda: exercises.run_source("01.1", 2),
     TypeError, "src must be an answer cell's source (str), got int"),
    ('exercises.run_source name', lambda: exercises.run_source("01.1", "x = 2"),
     ValueError, "this source does not define 'same_objects'"),
    ('edition.build', lambda: edition.build([], "out"),
     TypeError, "out_dir must be a pathlib.Path, got str"),
    ('edition.build missing', lambda: edition.build([Path("no.ipynb")], Path("out")),
     FileNotFoundError, "no notebook at no.ipynb"),
    ('edition.answer_key', lambda: edition.answer_key({"metadata": {"tags": ["answer:01.1", "answer:01.2"]}}),
     ValueError, "a cell is tagged as the answer of several exercises"),
    ('edition.exercise_cells', lambda: edition.exercise_cells("01.1", " "),
     ValueError, "question must be the exercise's text"),
    ('show.show', lambda: show.show(3),
     TypeError, "obj must be a function, method, class or module, got int"),
    ('show.source', lambda: show.source(splits.split_sizes, "nowhere"),
     ValueError, "split_sizes has no region 'nowhere'"),
    ('show.source type', lambda: show.source(splits.split_sizes, 3),
     TypeError, "region must be a str"),
    ('show.regions', lambda: show.regions("splits"),
     TypeError, "obj must be a function, method, class or module, got str"),
    # notebook 10 (debugging, debug_training)
    ('debugging.where_stuck stacks', lambda: debugging.where_stuck(["  File x"]),
     TypeError, 'stacks must be a dict of rank -> stack lines'),
    ('debugging.where_stuck last', lambda: debugging.where_stuck({}, last=0),
     ValueError, 'last must be an int >= 1'),
    ('debugging.evaluation_set', lambda: debugging.evaluation_set(0),
     ValueError, 'size must be an int >= 1'),
    ('debug_training.accumulation_data', lambda: debug_training.accumulation_data(2, 0, 3, 1),
     ValueError, 'k must be an int >= 1'),
    ('debug_training.accumulation_reference', lambda: debug_training.accumulation_reference(2, 2, 3, 1.5),
     ValueError, 'steps must be an int >= 1'),
    ('debug_training.uneven_batches counts', lambda: debug_training.uneven_batches([3, 0], 0),
     ValueError, 'batches_per_rank must be a non-empty list of ints >= 1'),
    ('debug_training.uneven_batches rank', lambda: debug_training.uneven_batches([3, 2], 2),
     ValueError, 'rank must be an int in [0, 2)'),
    ('debug_training.uneven_reference mode', lambda: debug_training.uneven_reference([3, 2], "plain"),
     ValueError, "mode must be 'join' or 'equal'"),
    ('debug_training.uneven_reference empty', lambda: debug_training.uneven_reference([], "join"),
     ValueError, 'batches_per_rank must be a non-empty list'),
    ('debug_training.train_unused', lambda: debug_training.train_unused(0, 1, "ignore"),
     ValueError, "mode must be 'plain', 'debug', 'find_unused' or 'static_graph'"),
    ('debug_training.train_compressed', lambda: debug_training.train_compressed(0, 1, "int8"),
     ValueError, "hook must be one of ['bf16', 'fp16', 'fp32']"),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, error, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # calls that would write (a snapshot, say) write here

    with pytest.raises(error, match="^" + re.escape(message)):
        call()


def test_every_public_callable_has_a_bad_input_case():
    import importlib
    import inspect
    import pkgutil

    import course_utils

    tested = {name.split(" ")[0] for name, *_ in CASES}
    exempt = {
        # run inside a process group by launch(); tested with their modules
        *(f"ddp_demos.{n}" for n in importlib.import_module("course_utils.ddp_demos").__all__),
        "ddp_train.train_ddp", "collectives.ring_all_reduce", "memory.cuda_peak_bytes",
        # command-line entry points: argparse (test below)
        "ddp_train.main", "bench.main", "gpu_check.main", "edition.main",
        # no arguments, or plain records
        "bench.machine_description", "env.device_report", "gpu_check.environment", "fault_demos.demo_model", "env.in_colab", "distributed.free_port",
        "by_hand.record_memory", "distributed.rank_print", "distributed.LaunchTimeout",
        "distributed.RankError", "distributed.TorchrunResult", "by_hand.Equivalence",
        "by_hand.MemoryRecord", "by_hand.SimDevice", "env.DeviceReport", "memory.Ledger",
        "snapshots.SnapshotInfo", "exercises.Verdict",
        # no arguments, or a context manager (tests/test_devices.py)
        "devices.gpu_count", "devices.local_rank", "devices.rank_device", "devices.DeviceAudit",
        # notebook 10: rank functions and a DDP hook, run by launch() in tests/test_debugging.py;
        # models without arguments
        *(f"debugging.{n}" for n in importlib.import_module("course_utils.debugging").__all__
          if n not in ("where_stuck", "evaluation_set")),
        "debug_training.accumulate_step", "debug_training.accumulate_step_off_by_one",
        "debug_training.train_accumulating", "debug_training.train_uneven", "debug_training.different_seeds",
        "debug_training.wrapped_keys", "debug_training.bf16_compress_on_gloo", "debug_training.small_model",
        "debug_training.TwoHeads",
    }
    missing = []
    # the package's modules, and the modules of its subpackages (exercises.edition as "edition")
    names = [(i.name, f"course_utils.{i.name}") for i in pkgutil.iter_modules(course_utils.__path__)]
    names += [(i.name, f"course_utils.exercises.{i.name}") for i in pkgutil.iter_modules(exercises.__path__)
              if not i.name.startswith("nb") and i.name != "core"]  # core: re-exported by exercises
    for short, dotted in names:
        if short.startswith("_"):
            continue
        module = importlib.import_module(dotted)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            qualified = f"{short}.{name}"
            if callable(obj) and (inspect.isfunction(obj) or inspect.isclass(obj)) \
                    and qualified not in tested and qualified not in exempt:
                missing.append(qualified)
    assert missing == [], f"public callables without a bad-input case: {missing}"


@pytest.mark.parametrize(("main", "argv", "message"), [
    (ddp_train.main, ["--out", "p.pt", "--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
    (ddp_train.main, ["--epochs", "2"], "the following arguments are required: --out"),
    (bench.main, ["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (gpu_check.main, ["--timeout", "0"], "--timeout and --tests-timeout must be numbers of seconds > 0"),
    (edition.main, [], "the following arguments are required: out_dir"),
], ids=["ddp_train-type", "ddp_train-missing", "bench-unknown", "gpu_check-timeout", "edition-missing"])
def test_command_lines_refuse_bad_arguments_with_usage(main, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and message in err


def test_train_ddp_and_the_ring_need_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group"):
        ddp_train.train_ddp(0, 1)
    with pytest.raises(RuntimeError, match="needs a process group"):
        collectives.ring_all_reduce(torch.ones(2))
