"""The gradient noise scale (notebook 07, section 3) and AdaScale's gain (section 4): the estimates
are unbiased over many draws from a known distribution, bad input is refused with a clear message,
and on real 2- and 4-rank runs NoiseScaleDDP measures what each rank's gradient and the averaged one
really are, and its estimates average to the truth."""

import math

import pytest
import torch

from course_utils.ddp import batch_task
from course_utils.ddp.noise_scale import (
    NoiseScale,
    NoiseScaleDDP,
    adascale_gain,
    fairscale_smoothing,
    gradient_noise_scale,
    smoothed,
)
from course_utils.distributed import launch

DIM = 5


def _distribution(seed):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(DIM, generator=g, dtype=torch.float64) * 0.5
    factor = torch.randn(DIM, DIM, generator=g, dtype=torch.float64) / DIM ** 0.5
    return g, mean, factor


@pytest.mark.parametrize(("b_small", "b_big", "seed"),
                         [(1, 2, 0), (4, 16, 1), (3, 7, 2), (16, 64, 3), (2, 3, 4)])
def test_the_estimates_are_unbiased_over_many_draws(b_small, b_big, seed):
    """Gradients over b_small and b_big rows of a distribution with a known mean G and covariance
    Σ: the estimates, averaged over 20,000 draws, are |G|² and tr(Σ) within 4 standard errors."""
    g, mean, factor = _distribution(seed)
    draws = 20_000
    rows = mean + torch.randn(draws, b_big, DIM, generator=g, dtype=torch.float64) @ factor.T
    small = rows[:, :b_small].mean(1).square().sum(-1)  # a gradient over the first b_small rows
    big = rows.mean(1).square().sum(-1)  # over all b_big rows
    estimates = gradient_noise_scale(small, big, b_small, b_big)
    for got, want in ((estimates.sq_norm, float(mean.square().sum())),
                      (estimates.trace, float((factor @ factor.T).trace()))):
        error = float(got.std()) / math.sqrt(draws)
        assert abs(float(got.mean()) - want) < 4 * error, (float(got.mean()), want, error)


def test_numbers_give_floats_and_tensors_give_tensors():
    est = gradient_noise_scale(0.5, 0.3, 4, 8)
    assert isinstance(est, NoiseScale) and all(isinstance(v, float) for v in est)
    assert est.sq_norm == pytest.approx(0.1) and est.trace == pytest.approx(1.6)
    assert est.b_simple == pytest.approx(16)
    tensors = gradient_noise_scale(torch.tensor([0.5, 0.6]), torch.tensor([0.3, 0.3]), 4, 8)
    assert isinstance(tensors.trace, torch.Tensor) and tensors.trace.shape == (2,)
    assert gradient_noise_scale(torch.tensor(0.5), 0.3, 4, 8).sq_norm == pytest.approx(0.1)


@pytest.mark.parametrize(("args", "error", "message"), [
    ((0.5, 0.3, 8, 8), ValueError, "b_big must be larger than b_small"),
    ((0.5, 0.3, 16, 4), ValueError, "b_big must be larger than b_small"),
    ((0.5, 0.3, 0, 4), ValueError, "b_small must be a number of rows > 0"),
    ((0.5, 0.3, 4, -8), ValueError, "b_big must be a number of rows > 0"),
    (("0.5", 0.3, 4, 8), TypeError, "small_sq_norm must be a number"),
    ((0.5, None, 4, 8), TypeError, "big_sq_norm must be a number"),
    ((0.5, 0.3, True, 8), TypeError, "b_small must be a number of rows"),
    ((0.5, 0.3, 4, "8"), TypeError, "b_big must be a number of rows"),
    ((torch.tensor([True]), 0.3, 4, 8), TypeError, "small_sq_norm must be a real number or a tensor"),
])
def test_bad_input_is_refused_with_a_clear_message(args, error, message):
    with pytest.raises(error, match=message):
        gradient_noise_scale(*args)


def test_smoothing_divides_the_averages_not_the_ratios():
    estimates = [NoiseScale(1.0, 10.0, 10.0), NoiseScale(-0.5, 10.0, -20.0), NoiseScale(1.0, 10.0, 10.0)]
    out = smoothed(estimates, 0.5)
    assert out[0] == pytest.approx(10.0)
    assert out[1] == math.inf  # the averaged |G|² came to 0: no ratio yet
    assert out[2] == pytest.approx(8.75 / 0.5)  # the averages (0.5, 8.75), not the mean of the ratios
    with pytest.raises(ValueError, match="smoothing"):
        smoothed(estimates, 1.0)


def test_adascale_gain_goes_from_one_to_the_scale():
    assert adascale_gain(1.0, 0.0, 4, 64) == 1.0  # no noise: the larger batch is no better
    assert adascale_gain(0.0, 1.0, 4, 64) == pytest.approx(16.0)  # all noise: the linear rule
    assert adascale_gain(-1.0, 1.0, 4, 64) == pytest.approx(16.0)  # a negative |G|² estimate reads as 0
    assert adascale_gain(0.0, 0.0, 4, 64) == 1.0
    # B_simple = 64: (64/4 + 1) / (64/64 + 1)
    assert adascale_gain(1.0, 64.0, 4, 64) == pytest.approx(17 / 2)
    gains = adascale_gain(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 4, 64)
    assert torch.allclose(gains, torch.tensor([1.0, 16.0]))
    with pytest.raises(ValueError, match="batch must be a number of rows > 0"):
        adascale_gain(1.0, 1.0, 4, 0)


def test_fairscale_smoothing_follows_the_number_of_gradients():
    assert fairscale_smoothing(2) == pytest.approx(0.998)
    assert fairscale_smoothing(256) == pytest.approx(0.744)
    assert fairscale_smoothing(4000) == 0.0
    with pytest.raises(ValueError, match="scale must be a number of rows > 0"):
        fairscale_smoothing(0)


def _sampled_statistics(w, rows=2_000_000, seed=3):
    """|G|², tr(Σ), B_simple and B_noise of the task at weights w, on many rows (float64); each
    row's squared residual taken given x (its expectation over the label), which lowers the noise."""
    x, _ = batch_task.batch(torch.Generator().manual_seed(seed), rows)
    x, w = x.double(), w.double()
    p, q = torch.sigmoid(x @ w), torch.sigmoid(x @ batch_task.TEACHER.double())
    g = ((p - q)[:, None] * x).mean(0)
    second = (x.T * (p**2 - 2 * p * q + q)) @ x / rows
    sigma = second - torch.outer(g, g)
    hessian = (x.T * (p * (1 - p))) @ x / rows
    return float(g @ g), float(sigma.trace()), float((hessian @ sigma).trace() / (g @ hessian @ g))


@pytest.mark.parametrize("which", ["zero", "halfway", "random", "near the teacher"])
def test_the_exact_gradient_statistics_are_those_of_many_rows(which):
    """gradient_statistics (Stein's identities and quadrature) agrees with 2,000,000 rows, within
    their sampling error, from the start (w = 0, where x @ w is constant) to near the teacher."""
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(batch_task.DIM, generator=g)
    w = {"zero": torch.zeros(batch_task.DIM), "halfway": batch_task.TEACHER * 0.5, "random": noise,
         "near the teacher": batch_task.TEACHER * 0.95 + 0.05 * noise}[which]
    exact = batch_task.gradient_statistics(w)
    sq_norm, trace, b_noise = _sampled_statistics(w)
    assert float(exact.trace) == pytest.approx(trace, rel=3e-3)
    assert float(exact.sq_norm) == pytest.approx(sq_norm, rel=0.02, abs=2e-6)
    assert float(exact.b_noise) == pytest.approx(b_noise, rel=0.05)
    assert float(exact.b_simple) == pytest.approx(float(exact.trace / exact.sq_norm))
    ratio = exact.noise_curvature / exact.gradient_curvature
    assert float(exact.b_noise / exact.b_simple) == pytest.approx(float(ratio))


def test_gradient_statistics_keeps_the_shape_and_refuses_bad_weights():
    assert batch_task.gradient_statistics(torch.zeros(batch_task.DIM)).b_simple.shape == ()
    many = batch_task.gradient_statistics(torch.zeros(3, 11, batch_task.DIM))
    assert many.b_noise.shape == (3, 11) and many.b_noise.dtype == torch.float64
    with pytest.raises(ValueError, match="weights must be a tensor of shape"):
        batch_task.gradient_statistics(torch.zeros(3))


# ---------------------------------------------------------------------------------- on real ranks

def _measured_rank(rank, world_size, per_rank, steps):
    """NoiseScaleDDP at fixed weights (learning rate 0): its pairs, and the pairs worked out here
    from every rank's own gradient (gathered)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_utils.devices import rank_device

    device = rank_device()
    model = batch_task.model().to(device)
    ddp_model = NoiseScaleDDP(model)
    generator = torch.Generator().manual_seed(100 + rank)
    expected = []
    for _ in range(steps):
        x, y = (t.to(device) for t in batch_task.batch(generator, per_rank))
        loss = F.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)
        local = torch.autograd.grad(loss, model.weight)[0]
        every = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(every, local)
        expected.append((sum(float(g.double().square().sum()) for g in every) / world_size,
                         float((sum(every) / world_size).double().square().sum())))
        model.zero_grad()
        F.binary_cross_entropy_with_logits(ddp_model(x).squeeze(-1), y).backward()  # it finishes, as DDP
    return {"history": ddp_model.history, "expected": expected}


@pytest.mark.parametrize("world_size", [2, 4])
def test_on_real_ranks_the_estimates_are_right_and_average_to_the_truth(world_size):
    per_rank, steps = 8, 150
    results = launch(_measured_rank, world_size, per_rank, steps, echo=False)
    for rank in results:
        assert rank["history"] == results[0]["history"]  # the same pairs on every rank
        for got, want in zip(rank["history"], rank["expected"], strict=True):
            assert got == pytest.approx(want, rel=1e-5)
    estimates = [gradient_noise_scale(s, b, per_rank, world_size * per_rank)
                 for s, b in results[0]["history"]]
    x, y = batch_task.batch(torch.Generator().manual_seed(9), 400_000)
    per_row = (torch.sigmoid(x @ torch.zeros(batch_task.DIM)) - y)[:, None] * x  # at the start: w = 0
    true_sq_norm = float(per_row.mean(0).square().sum())
    true_trace = float((per_row - per_row.mean(0)).square().sum(1).mean())
    for values, want in (([e.sq_norm for e in estimates], true_sq_norm),
                         ([e.trace for e in estimates], true_trace)):
        mean = sum(values) / steps
        error = math.sqrt(sum((v - mean) ** 2 for v in values) / (steps - 1) / steps)
        assert abs(mean - want) < 4 * error + 0.01 * want, (mean, want, error)
