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

from course_utils import data, devices, distributed, env, exercises, models, show
from course_utils.dataparallel import by_hand, evidence, memory, parallel_criterion, simulated, splits
from course_utils.dataparallel import diagrams as dp_diagrams
from course_utils.ddp import amp, collectives, train
from course_utils.ddp import diagrams as ddp_diagrams
from course_utils.debugging import hangs, training_bugs
from course_utils.faults import cluster, snapshots, torchrun
from course_utils.sharding import ledgers, strategies, zero
from course_utils.tools import bench, compat_check, gpu_check, solutions

lin = nn.Linear(4, 2)


def memory_spec():
    return memory.ModelSpec.linear()


#: The entry points a learner calls with values of their own: the notebooks' imports, snapshot
#: I/O and exercise checks. Every one has a case below, and only these do.
ENTRY_POINTS = (
    "ddp.amp.autocast", "ddp.amp.grad_scaler", "ddp.amp.output_dtypes", "ddp.amp.train_step",
    "sharding.strategies.measure_loader", "sharding.strategies.measure_strategies",
    "dataparallel.by_hand.DataParallelByHand", "dataparallel.by_hand.data_parallel",
    "faults.cluster.slurm_script",
    "ddp.collectives.ring_bytes_per_rank", "ddp.collectives.check_ring_all_reduce",
    "data.RandomDataset", "data.make_loader", "data.regression_dataset",
    "ddp.train.TrainConfig", "ddp.train.train_reference",
    "devices.choose_backend", "devices.emulated_node_env",
    "dataparallel.diagrams.dataparallel_steps", "dataparallel.diagrams.draw_dataparallel", "ddp.diagrams.draw_ddp_overlap", "ddp.diagrams.ring_schedule", "ddp.diagrams.draw_ring",
    "distributed.launch",
    "dataparallel.evidence.compare_training", "dataparallel.evidence.time_steps",
    "env.pick_device", "env.seed_everything",
    "exercises.check", "exercises.progress",
    "dataparallel.memory.ModelSpec", "dataparallel.memory.ledger", "dataparallel.memory.plot_ledgers",
    "models.BertLike", "models.ImageClassifier", "models.Model", "models.SequenceGRU", "models.SmallCNN",
    "dataparallel.parallel_criterion.DataParallelCriterion", "dataparallel.parallel_criterion.DataParallelModel",
    "sharding.ledgers.sharded_bytes", "sharding.ledgers.sharded_ledger", "sharding.ledgers.comm_bytes_per_step",
    "show.show",
    "dataparallel.simulated.sim_devices", "dataparallel.simulated.course_devices",
    "faults.snapshots.save_snapshot", "faults.snapshots.load_snapshot", "faults.snapshots.strip_module_prefix", "faults.snapshots.state_copy",
    "dataparallel.splits.split_sizes", "dataparallel.splits.epoch_splits", "dataparallel.splits.simulate_tutorial", "dataparallel.splits.plot_epoch_splits",
    "faults.torchrun.torchrun", "faults.torchrun.torchrun_nodes", "faults.torchrun.init_from_torchrun",
    "sharding.zero.ZeroByHand",
    "debugging.hangs.where_stuck",
    "debugging.training_bugs.uneven_batches",
)

CASES = [
    ('ddp.amp.autocast mode', lambda: amp.autocast("fp8"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('ddp.amp.autocast type', lambda: amp.autocast(16),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('ddp.amp.autocast device', lambda: amp.autocast("bf16", "tpu"),
     ValueError, "device_type must be 'cpu' or 'cuda'"),
    ('ddp.amp.grad_scaler mode', lambda: amp.grad_scaler("half"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('ddp.amp.output_dtypes model', lambda: amp.output_dtypes("x", torch.ones(2, 4), "bf16"),
     TypeError, 'model must be an nn.Module'),
    ('ddp.amp.output_dtypes inputs', lambda: amp.output_dtypes(lin, [1, 2], "bf16"),
     TypeError, 'inputs must be a tensor'),
    ('sharding.strategies.measure_loader workers', lambda: strategies.measure_loader((-1,)),
     ValueError, 'num_workers must be a non-empty list of ints'),
    ('sharding.strategies.measure_loader empty', lambda: strategies.measure_loader(()),
     ValueError, 'num_workers must be a non-empty list of ints'),
    ('sharding.strategies.measure_loader work', lambda: strategies.measure_loader((0,), work="gpu"),
     ValueError, "work must be 'io' or 'cpu'"),
    ('sharding.strategies.measure_strategies size', lambda: strategies.measure_strategies("huge"),
     ValueError, "size must be one of ['large', 'medium', 'smal"),
    ('sharding.strategies.measure_strategies strategy', lambda: strategies.measure_strategies(strategies=("zero",)),
     ValueError, 'strategies must be a non-empty list drawn fro'),
    ('sharding.strategies.measure_strategies empty', lambda: strategies.measure_strategies(strategies=()),
     ValueError, 'strategies must be a non-empty list drawn fro'),
    ('sharding.strategies.measure_strategies steps', lambda: strategies.measure_strategies(steps=0),
     ValueError, 'steps must be an int >= 1'),
    ('dataparallel.by_hand.DataParallelByHand module', lambda: by_hand.DataParallelByHand("m", [0]),
     TypeError, 'module must be an nn.Module'),
    ('dataparallel.by_hand.DataParallelByHand devices', lambda: by_hand.DataParallelByHand(lin, []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('dataparallel.evidence.compare_training batches', lambda: evidence.compare_training(lin, [], nn.functional.mse_loss, simulated.sim_devices(2)),
     ValueError, 'batches is empty: give at least one (inputs,'),
    ('dataparallel.simulated.course_devices', lambda: simulated.course_devices(0),
     ValueError, 'n must be an int >= 1'),
    ('dataparallel.by_hand.data_parallel devices', lambda: by_hand.data_parallel(lin, torch.ones(4, 4), []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('dataparallel.by_hand.data_parallel small', lambda: by_hand.data_parallel(lin, torch.ones(1, 4), simulated.sim_devices(2)),
     ValueError, 'a tensor of shape (1, 4) has 1 entries along'),
    ('dataparallel.simulated.sim_devices', lambda: simulated.sim_devices(-1),
     ValueError, 'n must be an int >= 1'),
    ('dataparallel.evidence.time_steps repeats', lambda: evidence.time_steps(lin, torch.ones(4, 4), simulated.sim_devices(2), repeats=0),
     ValueError, 'repeats must be an int >= 1'),
    ('faults.cluster.slurm_script nodes', lambda: cluster.slurm_script(job_name="j", nodes=0, gpus_per_node=1, module="m"),
     ValueError, 'nodes must be an int >= 1'),
    ('faults.cluster.slurm_script module', lambda: cluster.slurm_script(job_name="j", nodes=1, gpus_per_node=1, module="a b"),
     ValueError, "module must be a dotted module name such as '"),
    ('ddp.collectives.ring_bytes_per_rank', lambda: collectives.ring_bytes_per_rank(10, 0),
     ValueError, 'world_size must be an int >= 1'),
    ('ddp.collectives.check_ring_all_reduce', lambda: collectives.check_ring_all_reduce(0, 2, []),
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
    ('ddp.train.TrainConfig', lambda: train.TrainConfig(epochs=0),
     ValueError, 'epochs must be an int >= 1'),
    ('ddp.train.TrainConfig batch', lambda: train.TrainConfig(global_batch_size=7).per_rank_batch_size(2),
     ValueError, 'global_batch_size=7 does not divide into 2 ra'),
    ('ddp.train.TrainConfig amp', lambda: train.TrainConfig(amp="fp8"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('ddp.train.train_reference ws', lambda: train.train_reference(train.TrainConfig(), 0),
     ValueError, 'world_size must be an int >= 1'),
    ('ddp.train.train_reference cfg', lambda: train.train_reference("cfg", 2),
     TypeError, 'config must be a TrainConfig'),
    ('devices.choose_backend', lambda: devices.choose_backend(0),
     ValueError, 'ranks_on_this_machine must be an int >= 1'),
    ('devices.choose_backend', lambda: devices.choose_backend(2, gpus=-1),
     ValueError, 'gpus must be an int >= 0'),
    ('devices.emulated_node_env', lambda: devices.emulated_node_env(2, 2, 1),
     ValueError, 'node must be an int in [0, 2)'),
    ('devices.emulated_node_env gpus', lambda: devices.emulated_node_env(0, 2, 1, gpus="2"),
     ValueError, 'gpus must be an int >= 0'),
    ('faults.torchrun.init_from_torchrun', lambda: torchrun.init_from_torchrun("mpi"),
     ValueError, "backend must be 'gloo' or 'nccl'"),
    ('faults.torchrun.init_from_torchrun timeout', lambda: torchrun.init_from_torchrun("gloo", 0),
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
    ('faults.torchrun.torchrun module', lambda: torchrun.torchrun("", 2),
     TypeError, "module must be a module name such as 'course_"),
    ('faults.torchrun.torchrun n', lambda: torchrun.torchrun("m", 0),
     ValueError, 'nproc_per_node must be an int >= 1'),
    ('faults.torchrun.torchrun timeout', lambda: torchrun.torchrun("m", 1, timeout_s=0),
     ValueError, 'timeout_s must be a number of seconds > 0'),
    ('faults.torchrun.torchrun_nodes', lambda: torchrun.torchrun_nodes("m", 0, 1),
     ValueError, 'nnodes must be an int >= 1'),
    ('faults.torchrun.torchrun_nodes id', lambda: torchrun.torchrun_nodes("m", 2, 1, job_id=""),
     ValueError, 'job_id must be a non-empty name of letters, d'),
    ('faults.torchrun.torchrun_nodes args', lambda: torchrun.torchrun_nodes("m", 2, 1, launcher_args="--x"),
     TypeError, 'launcher_args must be a tuple of strings'),
    ('faults.torchrun.torchrun_nodes env', lambda: torchrun.torchrun_nodes("m", 2, 1, env={"A": 1}),
     TypeError, 'env must be a dict of strings to strings'),
    ('env.pick_device', lambda: env.pick_device(-1),
     ValueError, 'index must be >= 0'),
    ('env.pick_device type', lambda: env.pick_device("0"),
     TypeError, 'index must be an int'),
    ('env.seed_everything', lambda: env.seed_everything("0"),
     TypeError, 'seed must be an int'),
    ('env.seed_everything neg', lambda: env.seed_everything(-1),
     ValueError, 'seed must be in [0, 2**32)'),
    ('dataparallel.memory.ledger strategy', lambda: memory.ledger(memory_spec(), "zero", batch_size=4, num_devices=2),
     ValueError, "strategy must be one of ('dp', 'parallel_crit"),
    ('dataparallel.memory.ledger batch', lambda: memory.ledger(memory_spec(), "dp", batch_size=0, num_devices=2),
     ValueError, 'batch_size must be an int >= 1'),
    ('dataparallel.memory.ledger outdev', lambda: memory.ledger(memory_spec(), "dp", batch_size=4, num_devices=2, output_device=2),
     ValueError, 'output_device must be in 0..1'),
    ('dataparallel.memory.ledger optimizer', lambda: memory.ledger(memory_spec(), "dp", batch_size=4, num_devices=2, optimizer="lion"),
     ValueError, "optimizer must be one of ['adam', 'adamw', 's"),
    ('dataparallel.memory.ledger spec', lambda: memory.ledger("bert", "dp", batch_size=4, num_devices=2),
     TypeError, 'spec must be a ModelSpec'),
    ('dataparallel.memory.ledger dtype', lambda: memory.ledger(memory_spec(), "dp", batch_size=4, num_devices=2, dtype=torch.int8),
     TypeError, 'dtype must be a floating torch.dtype'),
    ('dataparallel.memory.ModelSpec', lambda: memory.ModelSpec("m", -1, 0, 0, 1, 4, 1, 1, 4, 0),
     ValueError, 'parameters must be an int >= 0'),
    ('dataparallel.memory.ModelSpec itemsize', lambda: memory.ModelSpec("m", 1, 0, 0, 1, 0, 1, 1, 4, 0),
     ValueError, 'input_itemsize must be an int >= 1'),
    ('dataparallel.memory.plot_ledgers', lambda: memory.plot_ledgers([]),
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
    ('dataparallel.parallel_criterion.DataParallelCriterion', lambda: parallel_criterion.DataParallelCriterion("f", simulated.sim_devices(2)),
     TypeError, 'criterion must be callable'),
    ('dataparallel.parallel_criterion.DataParallelCriterion red', lambda: parallel_criterion.DataParallelCriterion(nn.MSELoss(), simulated.sim_devices(2), reduction="median"),
     ValueError, "reduction must be 'mean' or 'sum' (from the c"),
    ('dataparallel.parallel_criterion.DataParallelModel', lambda: parallel_criterion.DataParallelModel(lin, []),
     ValueError, 'device_ids is empty: give at least one device'),
    ('faults.snapshots.load_snapshot missing', lambda: snapshots.load_snapshot("/nonexistent/s.pt", lin),
     FileNotFoundError, 'no snapshot at /nonexistent/s.pt'),
    ('faults.snapshots.load_snapshot path', lambda: snapshots.load_snapshot(3, lin),
     TypeError, 'path must be a str or a path'),
    ('faults.snapshots.save_snapshot folder', lambda: snapshots.save_snapshot("/nonexistent/s.pt", lin, epoch=0, step_in_epoch=0, global_step=0),
     FileNotFoundError, 'cannot save a snapshot in /nonexistent: no su'),
    ('faults.snapshots.save_snapshot neg', lambda: snapshots.save_snapshot("s.pt", lin, epoch=-1, step_in_epoch=0, global_step=0),
     ValueError, 'epoch must be >= 0'),
    ('faults.snapshots.save_snapshot extra', lambda: snapshots.save_snapshot("s.pt", lin, epoch=0, step_in_epoch=0, global_step=0, extra=[1]),
     TypeError, 'extra must be a dict or None'),
    ('faults.snapshots.strip_module_prefix', lambda: snapshots.strip_module_prefix([("a", 1)]),
     TypeError, 'state must be a state dict (a dict)'),
    ('dataparallel.splits.epoch_splits', lambda: splits.epoch_splits(0, 2, 2),
     ValueError, 'data_size must be an int >= 1'),
    ('dataparallel.splits.plot_epoch_splits', lambda: splits.plot_epoch_splits(10, 0, 2),
     ValueError, 'batch_size must be an int >= 1'),
    ('dataparallel.splits.simulate_tutorial', lambda: splits.simulate_tutorial(0),
     ValueError, 'num_devices must be an int >= 1'),
    ('dataparallel.splits.split_sizes', lambda: splits.split_sizes(4.0, 2),
     TypeError, 'batch_size must be an int'),
    ('ddp.amp.train_step', lambda: amp.train_step(lin, nn.MSELoss(), torch.ones(2, 4), torch.ones(2, 2), torch.optim.SGD(lin.parameters(), lr=0.1), amp.grad_scaler("off"), "fp8"),
     ValueError, "amp must be one of ['bf16', 'fp16', 'off']"),
    ('faults.snapshots.state_copy', lambda: snapshots.state_copy({"w": 1}),
     TypeError, "model must be an nn.Module, got dict"),
    ('dataparallel.diagrams.dataparallel_steps', lambda: dp_diagrams.dataparallel_steps(30, 4, output_device=4),
     ValueError, "output_device must be an int in [0, 4), got 4"),
    ('dataparallel.diagrams.draw_dataparallel', lambda: dp_diagrams.draw_dataparallel(0),
     ValueError, "batch_size must be an int >= 1, got 0"),
    ('ddp.diagrams.draw_ddp_overlap', lambda: ddp_diagrams.draw_ddp_overlap([1.0] * 3, [2, 2]),
     ValueError, "bucket_layers must split the 3 layers"),
    ('ddp.diagrams.ring_schedule', lambda: ddp_diagrams.ring_schedule(0),
     ValueError, "world_size must be an int >= 1, got 0"),
    ('ddp.diagrams.draw_ring', lambda: ddp_diagrams.draw_ring(1),
     ValueError, "a ring needs world_size >= 2"),
    ('data.regression_dataset nan', lambda: data.regression_dataset(4, 2, 2, noise=float("nan")),
     ValueError, "noise must be a number >= 0, got nan"),
    ('ddp.train.TrainConfig nan', lambda: train.TrainConfig(lr=float("nan")),
     ValueError, "lr must be a number > 0, got nan"),
    ('dataparallel.memory.ModelSpec nan', lambda: memory.ModelSpec.linear().__class__(**{**memory.ModelSpec.linear().__dict__, "activation_floats": float("nan")}),
     ValueError, "activation_floats must be a number >= 0, got nan"),
    ('sharding.zero.ZeroByHand stage', lambda: zero.ZeroByHand(lin, 4),
     ValueError, 'stage must be one of (0, 1, 2, 3), got 4'),
    ('sharding.zero.ZeroByHand model', lambda: zero.ZeroByHand("model", 1),
     TypeError, 'model must be an nn.Module, got str'),
    ('sharding.ledgers.sharded_bytes', lambda: ledgers.sharded_bytes([10], 2, "zero4"),
     ValueError, "strategy must be one of ('ddp', 'zero1', 'zero2', 'zero3', 'fsdp', 'hsdp'), got 'zero4'"),
    ('sharding.ledgers.sharded_bytes numels', lambda: ledgers.sharded_bytes([-1], 2, "zero1"),
     ValueError, 'numels must be ints >= 0, got [-1]'),
    ('sharding.ledgers.sharded_ledger', lambda: ledgers.sharded_ledger(memory_spec(), "dp", batch_size=4, num_devices=2),
     ValueError, "strategy must be one of ('ddp', 'zero1', 'zero2', 'zero3', 'fsdp', 'hsdp'), got 'dp'"),
    ('sharding.ledgers.comm_bytes_per_step', lambda: ledgers.comm_bytes_per_step(-1, 2, "ddp"),
     ValueError, 'numel must be >= 0, got -1'),
    ('exercises.check', lambda: exercises.check(1.1, 3),
     ValueError, "key must look like '05.2'"),
    ('exercises.progress', lambda: exercises.progress(None),
     ValueError, "notebook must be a number such as '05'"),
    ('show.show', lambda: show.show(3),
     TypeError, "obj must be a function, method, class or module, got int"),
    ('debugging.hangs.where_stuck stacks', lambda: hangs.where_stuck(["  File x"]),
     TypeError, 'stacks must be a dict of rank -> stack lines'),
    ('debugging.hangs.where_stuck last', lambda: hangs.where_stuck({}, last=0),
     ValueError, 'last must be an int >= 1'),
    ('debugging.training_bugs.uneven_batches counts', lambda: training_bugs.uneven_batches([3, 0], 0),
     ValueError, 'batches_per_rank must be a non-empty list of ints >= 1'),
    ('debugging.training_bugs.uneven_batches rank', lambda: training_bugs.uneven_batches([3, 2], 2),
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

    module, attr = name.rsplit(".", 1)
    assert attr in importlib.import_module(f"course_utils.{module}").__all__


@pytest.mark.parametrize(("main", "argv", "message"), [
    (train.main, ["--out", "p.pt", "--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
    (train.main, ["--epochs", "2"], "the following arguments are required: --out"),
    (bench.main, ["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (gpu_check.main, ["--timeout", "0"], "--timeout and --tests-timeout must be numbers of seconds > 0"),
    (solutions.main, [], "the following arguments are required: out_dir"),
    (compat_check.main, ["--torch", "2.11"], "TORCH must name one release exactly, like 2.11.0, got '2.11'"),
], ids=["ddp.train-type", "ddp.train-missing", "bench-unknown", "gpu_check-timeout", "solutions-missing",
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
