"""The small task on which notebook 07 measures what the global batch does to training.

Logistic regression on Gaussian inputs, with labels drawn from a teacher: each row is ``x`` with
independent coordinates of variances ``SPECTRUM`` (from 1 down to 1/30: some directions are
learnt fast, others slowly), and its label is 1 with probability ``sigmoid(x @ TEACHER)``. The
model is one linear layer without bias, started at zero, trained on the binary cross-entropy.

Two properties make it the lesson's task:

- **fresh rows at every step**: a batch is drawn from the distribution itself, so the gradient of a
  batch of ``B`` rows is the true gradient plus noise of covariance ``Σ / B`` (the averaged
  gradient of section 1);
- **the loss on the whole distribution, computed exactly**: ``x @ w`` and ``x @ TEACHER`` are
  jointly Gaussian, so the expected loss of any weights is a one-dimensional integral, which
  Gauss-Hermite quadrature gives to within 1e-8 near the teacher's weights (:func:`loss`). "Steps
  to the target" are then read without an evaluation set's own noise.

The labels are noisy (the teacher's logit has a standard deviation of ``LOGIT_STD``), so even the
teacher's own weights have a loss above zero: :data:`BEST_LOSS`, the target's reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .._checks import check_positive_int

__all__ = ["BEST_LOSS", "DIM", "LOGIT_STD", "SPECTRUM", "TEACHER", "GradientStatistics", "batch",
           "gradient_statistics", "loss", "model", "sharpness"]

#: the inputs' dimension
DIM = 8
#: the variance of each input coordinate (the diagonal of the inputs' covariance)
SPECTRUM = torch.logspace(0.0, -1.5, DIM)
#: the standard deviation of the teacher's logit ``x @ TEACHER`` over the inputs
LOGIT_STD = 4.0


def _teacher() -> torch.Tensor:
    w = torch.randn(DIM, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return (w / (w * SPECTRUM.double().sqrt()).norm() * LOGIT_STD).float()


#: the weights that draw the labels
TEACHER = _teacher()

# Gauss-Hermite nodes and weights for E[f(z)], z ~ N(0, 1), in float64 (probabilists' Hermite)
_NODES, _WEIGHTS = (torch.from_numpy(a) for a in np.polynomial.hermite_e.hermegauss(128))
_WEIGHTS = _WEIGHTS / _WEIGHTS.sum()
_SCALE = float((TEACHER.double() * SPECTRUM.double().sqrt()).norm())
#: E[z sigmoid(a z)] for the teacher's logit a z: the part of the loss that the labels contribute
_LABEL_TERM = float((_WEIGHTS * _NODES * torch.sigmoid(_SCALE * _NODES)).sum())


def loss(weights: torch.Tensor) -> torch.Tensor:
    """The expected binary cross-entropy of ``weights`` (shape ``[..., DIM]``) over the whole
    distribution, one value per row of weights, in the weights' dtype.

    With ``u = x @ w`` and ``v = x @ TEACHER``, the loss is ``E[softplus(u)] - E[sigmoid(v) u]``;
    ``u`` is Gaussian with variance ``w Σ w``, and ``E[sigmoid(v) u]`` is ``(w Σ TEACHER) / |v|``
    times a constant of the teacher's: each is a one-dimensional Gaussian integral, taken by
    Gauss-Hermite quadrature (128 nodes: within 1e-8 for weights whose ``u`` has a standard
    deviation up to 4, as near the teacher, and 2e-4 at 10, far from any target).
    """
    if not isinstance(weights, torch.Tensor) or weights.shape[-1:] != (DIM,):
        raise ValueError(f"weights must be a tensor of shape [..., {DIM}], got "
                         f"{getattr(weights, 'shape', type(weights).__name__)}")
    w = weights.double()
    spectrum = SPECTRUM.double().to(w.device)
    spread = (w.square() * spectrum).sum(-1).sqrt()  # the standard deviation of u
    along = (w * spectrum * TEACHER.double().to(w.device)).sum(-1) / _SCALE
    nodes, node_weights = _NODES.to(w.device), _WEIGHTS.to(w.device)
    softplus = torch.nn.functional.softplus(spread[..., None] * nodes)
    return ((softplus * node_weights).sum(-1) - along * _LABEL_TERM).to(weights.dtype)


#: the teacher's own loss: no weights do better (the labels are noisy)
BEST_LOSS = float(loss(TEACHER.double()))


def batch(generator: torch.Generator, rows: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` fresh rows of the task: inputs of shape ``[*shape, rows, DIM]`` and labels (0. or
    1.) of shape ``[*shape, rows]``, drawn from ``generator`` (float32, on the CPU)."""
    rows = check_positive_int("rows", rows)
    x = torch.randn(*shape, rows, DIM, generator=generator) * SPECTRUM.sqrt()
    y = torch.bernoulli(torch.sigmoid(x @ TEACHER), generator=generator)
    return x, y


def model() -> nn.Module:
    """The model: ``nn.Linear(DIM, 1, bias=False)`` with its weight at zero (every run starts there)."""
    layer = nn.Linear(DIM, 1, bias=False)
    with torch.no_grad():
        layer.weight.zero_()
    return layer


def sharpness(weights: torch.Tensor, rows: int = 200_000, seed: int = 1) -> float:
    """The largest eigenvalue of the loss's Hessian at ``weights`` (shape ``[DIM]``), estimated on
    ``rows`` rows: ``E[sigmoid'(x @ w) x xᵀ]``. A step of momentum SGD is stable along that
    direction while ``lr * sharpness < 2 (1 + momentum)``."""
    x, _ = batch(torch.Generator().manual_seed(seed), rows)
    p = torch.sigmoid(x.double() @ weights.double())
    hessian = (x.double().T * (p * (1 - p))) @ x.double() / rows
    return float(torch.linalg.eigvalsh(hessian).max())


class GradientStatistics(NamedTuple):
    """The gradient's statistics at some weights, over the whole distribution (one value per row of
    weights): ``sq_norm`` = |G|², ``trace`` = tr(Σ) (Σ: the covariance of one row's gradient),
    ``b_simple`` = tr(Σ) / |G|² and ``b_noise`` = tr(HΣ) / (Gᵀ H G), H the loss's Hessian: McCandlish
    et al.'s simple and general noise scales. Their ratio ``b_noise / b_simple`` is the ratio of two
    curvatures: ``noise_curvature`` = tr(HΣ) / tr(Σ), the curvature the noise sees on average, over
    ``gradient_curvature`` = Gᵀ H G / |G|², the curvature along the gradient."""

    sq_norm: torch.Tensor
    trace: torch.Tensor
    b_simple: torch.Tensor
    b_noise: torch.Tensor
    noise_curvature: torch.Tensor
    gradient_curvature: torch.Tensor


def _sigmoid_derivatives(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
    s = torch.sigmoid(z)
    d1 = s * (1 - s)
    return s, d1, d1 * (1 - 2 * s), d1 * ((1 - 2 * s) ** 2 - 2 * d1)


@functools.cache
def _grid() -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor grid of 128 × 128 Gauss-Hermite nodes for a standard normal pair, and each node's mass."""
    nodes, weights = (torch.from_numpy(a) for a in np.polynomial.hermite_e.hermegauss(128))
    grid = torch.stack(torch.meshgrid(nodes, nodes, indexing="ij"), -1).reshape(-1, 2)
    return grid, (weights[:, None] * weights[None, :]).reshape(-1) / weights.sum() ** 2


def gradient_statistics(weights: torch.Tensor) -> GradientStatistics:
    """|G|², tr(Σ), B_simple and B_noise at ``weights`` (shape ``[..., DIM]``), exactly (float64).

    A row's gradient is ``(sigmoid(u) - y) x`` with ``u = x @ w``; its label's mean is ``sigmoid(v)``,
    ``v = x @ TEACHER``. With ``x`` Gaussian of covariance ``C``, Stein's identities turn every
    moment into an integral over the pair ``(u, v)``: ``E[x f] = C A E[∇f]`` and ``E[x xᵀ f] = C E[f]
    + C A E[∇²f] Aᵀ C``, ``A = [w, TEACHER]``. So G, the second moment of the gradient (Σ + G Gᵀ)
    and the Hessian ``E[sigmoid'(u) x xᵀ]`` are two-dimensional Gaussian integrals, taken by
    Gauss-Hermite quadrature on a grid of 128 × 128 nodes (within 0.1 % of a grid of 256 × 256 for
    weights whose ``u`` has a standard deviation up to 6, as near the teacher).
    """
    if not isinstance(weights, torch.Tensor) or weights.shape[-1:] != (DIM,):
        raise ValueError(f"weights must be a tensor of shape [..., {DIM}], got "
                         f"{getattr(weights, 'shape', type(weights).__name__)}")
    flat = weights.detach().double().cpu().reshape(-1, DIM)
    grid, mass = _grid()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small products: one thread is faster than a team
    try:
        parts = [_statistics(flat[i:i + 8], grid, mass) for i in range(0, len(flat), 8)]
    finally:
        torch.set_num_threads(threads)
    return GradientStatistics(*(torch.cat(t).reshape(weights.shape[:-1]) for t in zip(*parts, strict=True)))


def _statistics(w: torch.Tensor, grid: torch.Tensor, mass: torch.Tensor) -> tuple[torch.Tensor, ...]:
    c = SPECTRUM.double()
    a = torch.stack([w, TEACHER.double().expand_as(w)], -1)  # A, [n, DIM, 2]
    ca = c[:, None] * a
    values, vectors = torch.linalg.eigh(a.transpose(1, 2) @ ca)  # the covariance of (u, v)
    uv = grid @ (vectors * values.clamp(min=0).sqrt()[:, None, :]).transpose(1, 2)  # [n, nodes, 2]
    su, du, ddu, dddu = _sigmoid_derivatives(uv[..., 0])
    sv, dv, ddv, _ = _sigmoid_derivatives(uv[..., 1])

    def mean(f: torch.Tensor) -> torch.Tensor:
        return f @ mass

    g = (ca @ torch.stack([mean(du), -mean(dv)], -1)[..., None])[..., 0]  # E[(sigmoid(u) - sigmoid(v)) x]
    h = su**2 - 2 * su * sv + sv  # E[(sigmoid(u) - y)² | x]: a row's squared residual, given x
    cross = mean(-2 * du * dv)
    hessian_h = torch.stack([torch.stack([mean(2 * ddu * (su - sv) + 2 * du**2), cross], -1),
                             torch.stack([cross, mean(ddv * (1 - 2 * su))], -1)], -2)
    sigma = (torch.diag_embed(c * mean(h)[:, None]) + ca @ hessian_h @ ca.transpose(1, 2)
             - g[:, :, None] * g[:, None, :])
    cw = c * w
    hessian = (torch.diag_embed(c * mean(du)[:, None])
               + mean(dddu)[:, None, None] * cw[:, :, None] * cw[:, None, :])  # E[sigmoid'(u) x xᵀ]
    sq_norm = g.square().sum(-1)
    trace = torch.diagonal(sigma, dim1=-2, dim2=-1).sum(-1)
    curved = torch.diagonal(hessian @ sigma, dim1=-2, dim2=-1).sum(-1)  # tr(HΣ)
    along = (g[:, None, :] @ hessian @ g[:, :, None])[:, 0, 0]  # Gᵀ H G
    return sq_norm, trace, trace / sq_norm, curved / along, curved / trace, along / sq_norm
