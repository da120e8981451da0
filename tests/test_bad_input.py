# ruff: noqa: E501 - one case per line reads better than wrapped calls
"""Bad input where learners type values: the entry points a learner calls with values of their own
(``ENTRY_POINTS``, the one list) refuse wrong types, empty inputs, impossible sizes and missing
files with a ValueError, TypeError or FileNotFoundError whose message says what was expected and
what came. The command lines (``python -m course_utils.X``, which the make targets run) exit with
argparse's usage message (below).

The rule stops there on purpose: rank functions, model factories, the course's own plumbing and
every function a notebook shows (tests/test_show.py) carry no argument checks, so that the code
learners read is the lesson.

One row per case: a call, the exception it must raise, and the start of the message.
"""

import re

import pytest
import torch
from torch import nn

from course_utils import (
    amp,
    by_hand,
    cluster,
    collectives,
    data,
    ddp_train,
    devices,
    diagrams,
    distributed,
    dp_evidence,
    env,
    exercises,
    hangs,
    memory,
    models,
    parallel_criterion,
    sharding,
    show,
    simulated,
    snapshots,
    splits,
    strategy_harness,
    torchrun,
    training_bugs,
    zero,
)
from course_utils.exercises import edition
from course_utils.tools import bench, compat_check, gpu_check

lin = nn.Linear(4, 2)


def memory_spec():
    return memory.ModelSpec.linear()


#: The entry points a learner calls with values of their own: the notebooks' imports, snapshot
#: I/O and exercise checks. Every one has a case below, and only these do.
ENTRY_POINTS = (
    "amp.autocast", "amp.grad_scaler", "amp.output_dtypes", "amp.train_step",
    "strategy_harness.measure_loader", "strategy_harness.measure_strategies",
    "by_hand.DataParallelByHand", "by_hand.data_parallel",
    "cluster.slurm_script",
    "collectives.ring_bytes_per_rank", "collectives.check_ring_all_reduce",
    "data.RandomDataset", "data.make_loader", "data.regression_dataset",
    "ddp_train.TrainConfig", "ddp_train.train_reference",
    "devices.choose_backend", "devices.emulated_node_env",
    "diagrams.dataparallel_steps", "diagrams.draw_dataparallel", "diagrams.draw_ddp_overlap", "diagrams.ring_schedule", "diagrams.draw_ring",
    "distributed.launch",
    "dp_evidence.compare_training", "dp_evidence.time_steps",
    "env.pick_device", "env.seed_everything",
    "exercises.check", "exercises.progress",
    "memory.ModelSpec", "memory.ledger", "memory.plot_ledgers",
    "models.BertLike", "models.ImageClassifier", "models.Model", "models.SequenceGRU", "models.SmallCNN",
    "parallel_criterion.DataParallelCriterion", "parallel_criterion.DataParallelModel",
    "sharding.sharded_bytes", "sharding.sharded_ledger", "sharding.comm_bytes_per_step",
    "show.show",
    "simulated.sim_devices", "simulated.course_devices",
    "snapshots.save_snapshot", "snapshots.load_snapshot", "snapshots.strip_module_prefix", "snapshots.state_copy",
    "splits.split_sizes", "splits.epoch_splits", "splits.simulate_tutorial", "splits.plot_epoch_splits",
    "torchrun.torchrun", "torchrun.torchrun_nodes", "torchrun.init_from_torchrun",
    "zero.ZeroByHand",
    "hangs.where_stuck",
    "training_bugs.uneven_batches",
)

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
    ('strategy_harness.measure_loader workers', lambda: strategy_harness.measure_loader((-1,)),
     ValueError, 'num_workers must be a non-empty list of ints'),
    ('strategy_harness.measure_loader empty', lambda: strategy_harness.measure_loader(()),
     ValueError, 'num_workers must be a non-empty list of ints'),
    ('strategy_harness.measure_loader work', lambda: strategy_harness.measure_loader((0,), work="gpu"),
     ValueError, "work must be 'io' or 'cpu'"),
    ('strategy_harness.measure_strategies size', lambda: strategy_harness.measure_strategies("huge"),
     ValueError, "size must be one of ['large', 'medium', 'smal"),
    ('strategy_harness.measure_strategies strategy', lambda: strategy_harness.measure_strategies(strategies=("zero",)),
     ValueError, 'strategies must be a non-empty list drawn fro'),
    ('strategy_harness.measure_strategies empty', lambda: strategy_harness.measure_strategies(strategies=()),
     ValueError, 'strategies must be a non-empty list drawn fro'),
    ('strategy_harness.measure_strategies steps', lambda: strategy_harness.measure_strategies(steps=0),
     ValueError, 'steps must be an int >= 1'),
    ('by_hand.DataParallelByHand module', lambda: by_hand.DataParallelByHand("m", [0]),
     TypeError, 'module must be an nn.Module'),
    ('by_hand.DataParallelByHand devices', lambda: by_hand.DataParallelByHand(lin, []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('dp_evidence.compare_training batches', lambda: dp_evidence.compare_training(lin, [], nn.functional.mse_loss, simulated.sim_devices(2)),
     ValueError, 'batches is empty: give at least one (inputs,'),
    ('simulated.course_devices', lambda: simulated.course_devices(0),
     ValueError, 'n must be an int >= 1'),
    ('by_hand.data_parallel devices', lambda: by_hand.data_parallel(lin, torch.ones(4, 4), []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('by_hand.data_parallel small', lambda: by_hand.data_parallel(lin, torch.ones(1, 4), simulated.sim_devices(2)),
     ValueError, 'a tensor of shape (1, 4) has 1 entries along'),
    ('simulated.sim_devices', lambda: simulated.sim_devices(-1),
     ValueError, 'n must be an int >= 1'),
    ('dp_evidence.time_steps repeats', lambda: dp_evidence.time_steps(lin, torch.ones(4, 4), simulated.sim_devices(2), repeats=0),
     ValueError, 'repeats must be an int >= 1'),
    ('cluster.slurm_script nodes', lambda: cluster.slurm_script(job_name="j", nodes=0, gpus_per_node=1, module="m"),
     ValueError, 'nodes must be an int >= 1'),
    ('cluster.slurm_script module', lambda: cluster.slurm_script(job_name="j", nodes=1, gpus_per_node=1, module="a b"),
     ValueError, "module must be a dotted module name such as '"),
    ('collectives.ring_bytes_per_rank', lambda: collectives.ring_bytes_per_rank(10, 0),
     ValueError, 'world_size must be an int >= 1'),
    ('collectives.check_ring_all_reduce', lambda: collectives.check_ring_all_reduce(0, 2, []),
     ValueError, 'sizes is empty: give at least one tensor size'),
    ('data.RandomDataset', lambda: data.RandomDataset(0, 5),
     ValueError, 'size must be an int >= 1'),
    ('data.RandomDataset type', lambda: data.RandomDataset("5", 5),
     TypeError, 'size must be an int'),
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
    ('ddp_train.train_reference ws', lambda: ddp_train.train_reference(ddp_train.TrainConfig(), 0),
     ValueError, 'world_size must be an int >= 1'),
    ('ddp_train.train_reference cfg', lambda: ddp_train.train_reference("cfg", 2),
     TypeError, 'config must be a TrainConfig'),
    ('devices.choose_backend', lambda: devices.choose_backend(0),
     ValueError, 'ranks_on_this_machine must be an int >= 1'),
    ('devices.choose_backend', lambda: devices.choose_backend(2, gpus=-1),
     ValueError, 'gpus must be an int >= 0'),
    ('devices.emulated_node_env', lambda: devices.emulated_node_env(2, 2, 1),
     ValueError, 'node must be an int in [0, 2)'),
    ('devices.emulated_node_env gpus', lambda: devices.emulated_node_env(0, 2, 1, gpus="2"),
     ValueError, 'gpus must be an int >= 0'),
    ('torchrun.init_from_torchrun', lambda: torchrun.init_from_torchrun("mpi"),
     ValueError, "backend must be 'gloo' or 'nccl'"),
    ('torchrun.init_from_torchrun timeout', lambda: torchrun.init_from_torchrun("gloo", 0),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('distributed.launch fn', lambda: distributed.launch("f", 2),
     TypeError, 'fn must be a function'),
    ('distributed.launch ws', lambda: distributed.launch(distributed.rank_print, 0),
     ValueError, 'world_size must be an int >= 1'),
    ('distributed.launch timeout', lambda: distributed.launch(distributed.rank_print, 1, timeout_s=-1),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('distributed.launch init', lambda: distributed.launch(distributed.rank_print, 1, init=True),
     ValueError, "init must be one of 'store', 'env', 'tcp', 'none'"),
    ('distributed.launch stacks', lambda: distributed.launch(distributed.rank_print, 1, stacks="on"),
     TypeError, 'stacks must be True or False'),
    ('distributed.launch args', lambda: distributed.launch(distributed.rank_print, 1, (x for x in "ab")),
     TypeError, 'cannot send the arguments for fn to the ranks: args[0] is a generator'),
    ('torchrun.torchrun module', lambda: torchrun.torchrun("", 2),
     TypeError, "module must be a module name such as 'course_"),
    ('torchrun.torchrun n', lambda: torchrun.torchrun("m", 0),
     ValueError, 'nproc_per_node must be an int >= 1'),
    ('torchrun.torchrun timeout', lambda: torchrun.torchrun("m", 1, timeout_s=0),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('torchrun.torchrun_nodes', lambda: torchrun.torchrun_nodes("m", 0, 1),
     ValueError, 'nnodes must be an int >= 1'),
    ('torchrun.torchrun_nodes id', lambda: torchrun.torchrun_nodes("m", 2, 1, job_id=""),
     ValueError, 'job_id must be a non-empty name of letters, d'),
    ('torchrun.torchrun_nodes args', lambda: torchrun.torchrun_nodes("m", 2, 1, launcher_args="--x"),
     TypeError, 'launcher_args must be a tuple of strings'),
    ('torchrun.torchrun_nodes env', lambda: torchrun.torchrun_nodes("m", 2, 1, env={"A": 1}),
     TypeError, 'env must be a dict of strings to strings'),
    ('env.pick_device', lambda: env.pick_device(-1),
     ValueError, 'index must be >= 0'),
    ('env.pick_device type', lambda: env.pick_device("0"),
     TypeError, 'index must be an int'),
    ('env.seed_everything', lambda: env.seed_everything("0"),
     TypeError, 'seed must be an int'),
    ('env.seed_everything neg', lambda: env.seed_everything(-1),
     ValueError, 'seed must be in [0, 2**32)'),
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
    ('parallel_criterion.DataParallelCriterion', lambda: parallel_criterion.DataParallelCriterion("f", simulated.sim_devices(2)),
     TypeError, 'criterion must be callable'),
    ('parallel_criterion.DataParallelCriterion red', lambda: parallel_criterion.DataParallelCriterion(nn.MSELoss(), simulated.sim_devices(2), reduction="median"),
     ValueError, "reduction must be 'mean' or 'sum' (from the c"),
    ('parallel_criterion.DataParallelModel', lambda: parallel_criterion.DataParallelModel(lin, []),
     ValueError, 'device_ids is empty: give at least one device'),
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
    ('amp.train_step', lambda: amp.train_step(lin, nn.MSELoss(), torch.ones(2, 4), torch.ones(2, 2), torch.optim.SGD(lin.parameters(), lr=0.1), amp.grad_scaler("off"), "fp8"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('snapshots.state_copy', lambda: snapshots.state_copy({"w": 1}),
     TypeError, "model must be an nn.Module, got dict"),
    ('diagrams.dataparallel_steps', lambda: diagrams.dataparallel_steps(30, 4, output_device=4),
     ValueError, "output_device must be an int in [0, 4), got 4"),
    ('diagrams.draw_dataparallel', lambda: diagrams.draw_dataparallel(0),
     ValueError, "batch_size must be an int >= 1, got 0"),
    ('diagrams.draw_ddp_overlap', lambda: diagrams.draw_ddp_overlap([1.0] * 3, [2, 2]),
     ValueError, "bucket_layers must split the 3 layers"),
    ('diagrams.ring_schedule', lambda: diagrams.ring_schedule(0),
     ValueError, "world_size must be an int >= 1, got 0"),
    ('diagrams.draw_ring', lambda: diagrams.draw_ring(1),
     ValueError, "a ring needs world_size >= 2"),
    ('data.regression_dataset nan', lambda: data.regression_dataset(4, 2, 2, noise=float("nan")),
     ValueError, "noise must be a number >= 0, got nan"),
    ('ddp_train.TrainConfig nan', lambda: ddp_train.TrainConfig(lr=float("nan")),
     ValueError, "lr must be a number > 0, got nan"),
    ('memory.ModelSpec nan', lambda: memory.ModelSpec.linear().__class__(**{**memory.ModelSpec.linear().__dict__, "activation_floats": float("nan")}),
     ValueError, "activation_floats must be a number >= 0, got nan"),
    ('zero.ZeroByHand stage', lambda: zero.ZeroByHand(lin, 4),
     ValueError, 'stage must be one of (0, 1, 2, 3), got 4'),
    ('zero.ZeroByHand model', lambda: zero.ZeroByHand("model", 1),
     TypeError, 'model must be an nn.Module, got str'),
    ('sharding.sharded_bytes', lambda: sharding.sharded_bytes([10], 2, "zero4"),
     ValueError, "strategy must be one of ('ddp', 'zero1', 'zero2', 'zero3', 'fsdp', 'hsdp'), got 'zero4'"),
    ('sharding.sharded_bytes numels', lambda: sharding.sharded_bytes([-1], 2, "zero1"),
     ValueError, 'numels must be ints >= 0, got [-1]'),
    ('sharding.sharded_ledger', lambda: sharding.sharded_ledger(memory_spec(), "dp", batch_size=4, num_devices=2),
     ValueError, "strategy must be one of ('ddp', 'zero1', 'zero2', 'zero3', 'fsdp', 'hsdp'), got 'dp'"),
    ('sharding.comm_bytes_per_step', lambda: sharding.comm_bytes_per_step(-1, 2, "ddp"),
     ValueError, 'numel must be >= 0, got -1'),
    ('exercises.check', lambda: exercises.check(1.1, 3),
     ValueError, "key must look like '05.2'"),
    ('exercises.progress', lambda: exercises.progress(None),
     ValueError, "notebook must be a number such as '05'"),
    ('show.show', lambda: show.show(3),
     TypeError, "obj must be a function, method, class or module, got int"),
    ('hangs.where_stuck stacks', lambda: hangs.where_stuck(["  File x"]),
     TypeError, 'stacks must be a dict of rank -> stack lines'),
    ('hangs.where_stuck last', lambda: hangs.where_stuck({}, last=0),
     ValueError, 'last must be an int >= 1'),
    ('training_bugs.uneven_batches counts', lambda: training_bugs.uneven_batches([3, 0], 0),
     ValueError, 'batches_per_rank must be a non-empty list of ints >= 1'),
    ('training_bugs.uneven_batches rank', lambda: training_bugs.uneven_batches([3, 2], 2),
     ValueError, 'rank must be an int in [0, 2)'),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_a_clear_error(name, call, error, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # calls that would write (a snapshot, say) write here

    with pytest.raises(error, match="^" + re.escape(message)):
        call()


def test_the_cases_cover_the_entry_points_and_only_them():
    named = {name.split(" ")[0] for name, *_ in CASES}
    assert sorted(set(ENTRY_POINTS) - named) == [], "entry points without a bad-input case"
    assert sorted(named - set(ENTRY_POINTS)) == [], "cases for what is not an entry point"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_is_public(name):
    import importlib

    module, attr = name.split(".")
    assert attr in importlib.import_module(f"course_utils.{module}").__all__


@pytest.mark.parametrize(("main", "argv", "message"), [
    (ddp_train.main, ["--out", "p.pt", "--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
    (ddp_train.main, ["--epochs", "2"], "the following arguments are required: --out"),
    (bench.main, ["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (gpu_check.main, ["--timeout", "0"], "--timeout and --tests-timeout must be numbers of seconds > 0"),
    (edition.main, [], "the following arguments are required: out_dir"),
    (compat_check.main, ["--torch", "2.11"], "TORCH must name one release exactly, like 2.11.0, got '2.11'"),
], ids=["ddp_train-type", "ddp_train-missing", "bench-unknown", "gpu_check-timeout", "edition-missing",
        "compat_check-release"])
def test_command_lines_refuse_bad_arguments_with_usage(main, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and message in err


def test_the_ring_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group"):
        collectives.ring_all_reduce(torch.ones(2))
