"""Notebook 07's machinery: the task's exact loss, the vectorised sweep against torch's optimizers,
the shape of the steps-to-target curve, and gradient accumulation with no_sync equal to the larger
world on several k and world sizes."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_utils.ddp import accumulation, batch_curves, batch_task
from course_utils.ddp.batch_size import MOMENTUM, Config, draws, linear_rule, sqrt_rule, sweep_batch
from course_utils.distributed import launch


def test_the_exact_loss_is_the_mean_loss_over_many_rows():
    g = torch.Generator().manual_seed(1)
    x, y = batch_task.batch(g, 400_000)
    for w in (torch.zeros(batch_task.DIM), batch_task.TEACHER, torch.randn(batch_task.DIM, generator=g)):
        sampled = float(F.binary_cross_entropy_with_logits(x @ w, y))
        assert float(batch_task.loss(w)) == pytest.approx(sampled, abs=4e-3)
    assert float(batch_task.loss(torch.zeros(batch_task.DIM))) == pytest.approx(math.log(2))
    assert batch_task.BEST_LOSS < float(batch_task.loss(batch_task.TEACHER * 0.9))
    assert batch_task.loss(torch.zeros(3, 2, batch_task.DIM)).shape == (3, 2)
    with pytest.raises(ValueError, match="weights must be a tensor of shape"):
        batch_task.loss(torch.zeros(3))


def _torch_run(batch, config, seed, seeds, steps):
    """The sweep's copy ``seed`` of ``config``, trained by torch's own optimizer on the same rows."""
    model = batch_task.model()
    if config.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=MOMENTUM)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    rows, losses = draws(batch, seeds), []
    for step in range(1, steps + 1):
        ramp = min(step / config.warmup, 1.0) if config.warmup else 1.0
        optimizer.param_groups[0]["lr"] = config.warmup_from + (config.lr - config.warmup_from) * ramp \
            if config.warmup else config.lr
        x, y = next(rows)
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(x[seed]).squeeze(-1), y[seed]).backward()
        optimizer.step()
        losses.append(float(batch_task.loss(model.weight.detach()[0])))
    return losses


@pytest.mark.parametrize("config", [Config("sgd", 0.3), Config("adamw", 0.05),
                                    Config("sgd", 0.6, warmup=5, warmup_from=0.1)],
                         ids=["sgd", "adamw", "sgd-warmup"])
def test_the_sweep_trains_as_torch_optimizers_do(config):
    others = [Config("sgd", 0.01), Config("adamw", 0.2)]  # in the same tensor, they change nothing
    got = sweep_batch(16, [*others, config], 3, 0.0, 12, trace=(2, 1)).trace
    assert got == pytest.approx(_torch_run(16, config, 1, 3, 12), rel=1e-4, abs=1e-6)


def test_the_mean_trace_is_the_loss_the_steps_are_counted_on():
    """trace=(config, None) records the loss averaged over the seeds, the one the target is read on."""
    configs = [Config("sgd", 0.05), Config("sgd", 0.3)]
    mean = sweep_batch(16, configs, 3, 0.0, 10, trace=(1, None)).trace
    each = [sweep_batch(16, configs, 3, 0.0, 10, trace=(1, seed)).trace for seed in range(3)]
    assert mean == pytest.approx([sum(t) / 3 for t in zip(*each, strict=True)], rel=1e-5)
    reached = sweep_batch(16, configs, 3, mean[6], 10).steps[1]
    assert reached == next(i for i, loss in enumerate(mean, 1) if loss <= mean[6])


def test_adascale_gains_are_kept_per_configuration():
    configs = [Config("sgd", 0.05, adascale=True, base_batch=4), Config("sgd", 0.05),
               Config("sgd", 0.05, adascale=True, base_batch=4, smoothing=0.5)]
    gains = sweep_batch(32, configs, 2, 0.0, 5).gains
    assert set(gains) == {0, 2} and len(gains[0]) == len(gains[2]) == 5
    assert gains[0] != gains[2]  # the smoothing changes the gain
    assert gains[0][0] == pytest.approx(gains[2][0])  # not at the first step: the averages are debiased


def test_the_rules_and_bad_configurations():
    assert linear_rule(0.1, 256, 240) == pytest.approx(0.09375)
    assert sqrt_rule(1e-3, 256, 1024) == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="optimizer must be 'sgd' or 'adamw'"):
        Config("adam", 0.1)
    with pytest.raises(ValueError, match="AdaScale is written for SGD"):
        Config("adamw", 0.1, adascale=True)
    with pytest.raises(ValueError, match="smoothing must be a number >= 0 and < 1"):
        Config("sgd", 0.1, adascale=True, smoothing=1.0)
    with pytest.raises(ValueError, match="do not divide into chunks of 4"):
        sweep_batch(6, [Config("sgd", 0.1, adascale=True, base_batch=4)], 1, 0.5, 1)


def test_regions_speedups_and_the_fit_on_a_known_curve():
    batches = [4 * 2**k for k in range(9)]
    steps = [round(40 * (1 + 100 / b)) for b in batches]  # S_min 40, B_crit 100
    s_min, b_crit = batch_curves.critical_batch(batches, steps)
    assert s_min == pytest.approx(40, rel=0.02) and b_crit == pytest.approx(100, rel=0.03)
    assert batch_curves.regions([1000, 500, 250, 180, 170]) == [
        "perfect scaling", "perfect scaling", "diminishing returns", "no gain"]
    assert math.isnan(batch_curves.speedups([10, None, 5])[0])


def test_the_curve_has_its_three_regions():
    """SGD's best learning rate (a grid around the rates the notebook finds): doubling the batch
    at the small end cuts the steps by more than 1.8x; at the large end, by less than 1.1x."""
    def best(batch, lrs):
        steps = sweep_batch(batch, [Config("sgd", lr) for lr in lrs], batch_curves.SEEDS, batch_curves.TARGET,
                            batch_curves.MAX_STEPS, keep=()).steps
        return min(s for s in steps if s)

    small = [0.04 * 2 ** (j / 2) for j in range(-2, 5)]
    large = [0.32 * 2 ** (j / 2) for j in range(0, 8)]
    assert best(4, small) / best(8, small) > 1.8
    assert best(512, large) / best(1024, large) < 1.1


def test_the_recipe_is_tuned_on_the_grid():
    lr, steps = batch_curves.tune(batch_curves.BASE_BATCH, "sgd", batch_curves.SGD_GRID[2:6])
    assert lr in batch_curves.SGD_GRID and steps > 100
    with pytest.raises(RuntimeError, match="no learning rate of the grid reached the target"):
        batch_curves.tune(batch_curves.BASE_BATCH, "sgd", [1e-5], max_steps=5)


# ---------------------------------------------------------------------------- accumulation

def _one_process(global_rows, steps, lr):
    model = batch_task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = batch_task.batch(generator, global_rows)
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y).backward()
        optimizer.step()
    return model.weight.detach()[0]


@pytest.mark.parametrize(("world_size", "ks"), [(1, (2, 3)), (2, (2, 4)), (3, (2, 3))])
def test_accumulation_with_no_sync_equals_the_larger_world(world_size, ks):
    """k micro-batches of m rows on N ranks end where N·k ranks of m rows end (one process on the
    global batch, notebook 05), with one all-reduce per step; without no_sync, k all-reduces."""
    micro, steps, lr = 4, 3, 0.5
    runs = [(k, k * micro, how) for k in ks for how in ("no_sync", "sync every micro-batch")]
    results = launch(accumulation.accumulation_runs, world_size, runs, steps, lr, echo=False)
    for (k, _, how), *ranks in zip(runs, *results, strict=True):
        want = _one_process(world_size * k * micro, steps, lr)
        for rank in ranks:
            torch.testing.assert_close(rank["weights"], want, rtol=1e-5, atol=1e-6)
            assert rank["rows"] == [k * micro] * steps
            assert rank["all_reduces"] == [1 if how == "no_sync" else k] * steps


def test_a_schedule_in_samples_keeps_its_epoch_when_the_world_grows():
    assert [accumulation.steps_per_epoch(100, 8, n) for n in (1, 2, 3)] == [13, 7, 5]
    by_samples = {n: accumulation.lr_by_epoch(1.0, 300, "samples", 100, 10, n, 5) for n in (1, 2, 5)}
    assert by_samples[1] == by_samples[2] == by_samples[5] == [1.0, 1.0, 1.0, 0.1, 0.1]
    by_steps = {n: accumulation.lr_by_epoch(1.0, 30, "steps", 100, 10, n, 5) for n in (1, 2)}
    assert by_steps[1] == [1.0, 1.0, 1.0, 0.1, 0.1] and by_steps[2] == [1.0] * 5
    with pytest.raises(ValueError, match="counted_in must be 'steps' or 'samples'"):
        accumulation.lr_by_epoch(1.0, 30, "epochs", 100, 10, 1, 5)


def test_the_best_rate_is_the_middle_of_those_that_tie():
    assert batch_curves.best_of([100, 101, 102, 150], [1.0, 2.0, 4.0, 8.0]) == (100, 2.0)
    assert batch_curves.best_of([None, 100, 102, 150], [1.0, 2.0, 4.0, 8.0]) == (100, 2.0)  # lower middle
    assert batch_curves.best_of([120, 100, 200], [1.0, 2.0, 4.0]) == (100, 2.0)
    fewest, lr = batch_curves.best_of([None, None], [1.0, 2.0])
    assert fewest is None and math.isnan(lr)
