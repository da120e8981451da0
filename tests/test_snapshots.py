"""Snapshots: round trips, atomic saves under SIGKILL, the module. prefix, exact resumes."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch import nn

from course_utils.ddp.amp import grad_scaler
from course_utils.ddp.train import TrainConfig, train_ddp, train_resumable
from course_utils.distributed import RankError, launch
from course_utils.faults import crashes
from course_utils.faults.crashes import KillAt
from course_utils.faults.snapshots import (
    ResumableSampler,
    load_snapshot,
    save_snapshot,
    strip_module_prefix,
)


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def trained(model, optimizer, steps=3):
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_round_trip_restores_model_optimizer_scaler_position_and_rngs(tmp_path):
    model = small_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trained(model, optimizer)
    scaler = grad_scaler("fp16", "cpu")
    scaler.scale(torch.tensor(1.0))  # initialises the scale
    scaler.update(1024.0)
    path = tmp_path / "s.pt"
    save_snapshot(path, model, optimizer, scaler, epoch=2, step_in_epoch=3, global_step=11,
                  extra={"note": "hello", "lr": 0.01})
    expected_draws = (torch.rand(3), random.random(), np.random.rand())

    other = small_model(seed=1)
    other_optimizer = torch.optim.Adam(other.parameters(), lr=0.01)
    other_scaler = grad_scaler("fp16", "cpu")
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    info = load_snapshot(path, other, other_optimizer, other_scaler)

    assert (info.epoch, info.step_in_epoch, info.global_step) == (2, 3, 11)
    assert info.extra == {"note": "hello", "lr": 0.01}
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value)
    saved_state, loaded_state = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    for index, moments in saved_state.items():
        for name, value in moments.items():
            assert torch.equal(loaded_state[index][name], value)
    assert other_scaler.get_scale() == 1024.0
    draws = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1:] == expected_draws[1:]


def test_restore_rng_false_leaves_the_generators_alone(tmp_path):
    save_snapshot(tmp_path / "s.pt", small_model(), epoch=0, step_in_epoch=0, global_step=0)
    model = small_model()  # seeds the generator itself, so build it first
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    load_snapshot(tmp_path / "s.pt", model, restore_rng=False)
    assert torch.equal(torch.rand(2), expected)


def test_module_prefix_both_ways(tmp_path):
    wrapped = nn.DataParallel(small_model(seed=3))  # on the CPU a pass-through with .module
    plain = small_model(seed=4)
    assert all(k.startswith("module.") for k in wrapped.state_dict())

    save_snapshot(tmp_path / "w.pt", wrapped, epoch=0, step_in_epoch=0, global_step=0)
    stored = torch.load(tmp_path / "w.pt", weights_only=True)["model"]
    assert not any(k.startswith("module.") for k in stored)
    load_snapshot(tmp_path / "w.pt", plain)  # wrapped -> plain
    for key, value in wrapped.module.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)

    fresh = nn.DataParallel(small_model(seed=5))
    load_snapshot(tmp_path / "w.pt", fresh)  # plain keys -> wrapped
    for key, value in plain.state_dict().items():
        assert torch.equal(fresh.module.state_dict()[key], value)


def test_strip_module_prefix_only_when_every_key_has_it():
    assert strip_module_prefix({"module.a": 1, "module.b": 2}) == {"a": 1, "b": 2}
    assert strip_module_prefix({"module.a": 1, "b": 2}) == {"module.a": 1, "b": 2}
    assert strip_module_prefix({}) == {}


def test_skip_first_starts_the_epoch_later():
    sampler = ResumableSampler(range(10), skip=4)
    assert list(sampler) == [4, 5, 6, 7, 8, 9] and len(sampler) == 6
    sampler.skip = 12
    assert list(sampler) == [] and len(sampler) == 0


def test_files_that_are_not_snapshots_are_refused(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="garbage.pt is not a readable snapshot"):
        load_snapshot(tmp_path / "garbage.pt", small_model())
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a course_utils snapshot"):
        load_snapshot(tmp_path / "other.pt", small_model())
    save_snapshot(tmp_path / "s.pt", small_model(), epoch=0, step_in_epoch=0, global_step=0)
    model = small_model()
    with pytest.raises(ValueError, match="holds no optimizer state"):
        load_snapshot(tmp_path / "s.pt", model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_snapshot_of_another_model_is_refused(tmp_path):
    save_snapshot(tmp_path / "s.pt", small_model(), epoch=0, step_in_epoch=0, global_step=0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_snapshot(tmp_path / "s.pt", nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))


@pytest.mark.parametrize("how", ["atomic", "in place"])
def test_writer_killed_in_the_middle_of_a_save(tmp_path, how):
    path = tmp_path / "snapshot.pt"
    with pytest.raises(RankError, match="killed by signal 9"):
        launch(crashes.die_while_saving, 1, str(path), how, echo=False)
    if how == "atomic":
        info = load_snapshot(path, crashes.demo_model())
        assert info.global_step == 1  # the previous snapshot, intact
        leftovers = [p.name for p in tmp_path.iterdir() if p.name != "snapshot.pt"]
        assert len(leftovers) == 1 and leftovers[0].startswith(".snapshot.pt.tmp-")
        save_snapshot(path, crashes.demo_model(), epoch=0, step_in_epoch=0, global_step=3)
        assert [p.name for p in tmp_path.iterdir()] == ["snapshot.pt"]  # the stale file is gone
    else:  # the control: writing in place loses the only snapshot
        with pytest.raises(ValueError, match="is not a readable snapshot"):
            load_snapshot(path, crashes.demo_model())


SAVE_FOREVER = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from course_utils.faults.snapshots import save_snapshot
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # about 4 MB
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            model[0].bias.fill_(step)
        save_snapshot(sys.argv[1], model, epoch=0, step_in_epoch=0, global_step=step)
        print(step, flush=True)
""")


@pytest.mark.stress  # six processes that import torch: run by `make stress`
def test_sigkill_at_random_moments_never_leaves_a_broken_snapshot(tmp_path):
    """Kill a process that saves in a loop at random moments: the file always loads, and it
    holds the step its own contents say (the weights and the step were written together)."""
    rng = random.Random(0)
    path = tmp_path / "s.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    steps = []
    for _ in range(6):
        process = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, str(path)],
                                   stdout=subprocess.PIPE, text=True, env=env)
        assert process.stdout.readline().strip()  # at least one save has finished
        time.sleep(rng.uniform(0.0, 0.3))
        process.send_signal(signal.SIGKILL)
        process.communicate()
        model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))
        info = load_snapshot(path, model, restore_rng=False)
        assert torch.all(model[0].bias == info.global_step)
        steps.append(info.global_step)
    assert all(step >= 1 for step in steps)


@pytest.mark.parametrize("stop_after", [1, 5, 6, 8, 14])
def test_in_process_resume_is_exact_only_with_every_part(tmp_path, stop_after):
    path = tmp_path / "s.pt"
    full = crashes.train_in_process(15)
    first = crashes.train_in_process(15, path, stop_after=stop_after)
    resumed = crashes.train_in_process(15, path, resume=True)
    assert resumed["start"] == stop_after
    assert first["losses"] + resumed["losses"] == full["losses"]
    for key, value in full["params"].items():
        assert torch.equal(resumed["params"][key], value)
    for missing in crashes.PARTS:
        restore = tuple(p for p in crashes.PARTS if p != missing)
        partial = crashes.train_in_process(15, path, resume=True, restore=restore)
        assert any(not torch.equal(partial["params"][k], v) for k, v in full["params"].items()), \
            f"resuming without {missing} should change the run"


@pytest.mark.stress  # three launches; notebook 09 resumes a DDP job under nbval in `make test`
def test_ddp_resume_after_a_lost_rank_under_launch(tmp_path):
    """The resume logic without torchrun: a launch loses rank 1 after step 5; a second launch
    resumes from the snapshot of step 4 and ends bitwise where an uninterrupted launch ends."""
    config = TrainConfig(epochs=3, momentum=0.9)
    reference = launch(train_ddp, 2, config, echo=False)[0]
    path = str(tmp_path / "s.pt")
    with pytest.raises(RankError, match="rank 1 raised ProcessDied"):
        launch(train_resumable, 2, config, path, 2, KillAt(1, 5), echo=False)
    resumed = launch(train_resumable, 2, config, path, 2, echo=False)[0]
    assert resumed["steps"] == 12 and len(resumed["losses"]) == 12 - 4
    assert resumed["losses"] == reference["losses"][4:]
    for key, value in reference["params"].items():
        assert torch.equal(resumed["params"][key], value)


@pytest.mark.parametrize(("args", "message"), [
    ((None, 2), "snapshot_every needs a snapshot path"),
    (("s.pt", -1), "snapshot_every must be an int >= 0"),
    (("s.pt", 2, "KillAt"), "before_step must be callable or None, got str"),
    (("s.pt", 2, KillAt(2, 3)),
     r"KillAt\(rank=2, step=3\) never fires: the rank must be in \[0, 2\) and the step in \[0, 8\)"),
    (("s.pt", 2, KillAt(0, 8)), r"KillAt\(rank=0, step=8\) never fires"),
])
def test_train_resumable_refuses_bad_snapshot_and_fault_arguments(tmp_path, args, message):
    with pytest.raises(RankError, match=message):
        launch(train_resumable, 2, TrainConfig(), *args, echo=False)
