"""The small task on which notebook 13 measures what the global batch does to training.

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

import numpy as np
import torch
from torch import nn

from .._checks import check_positive_int

__all__ = ["BEST_LOSS", "DIM", "LOGIT_STD", "SPECTRUM", "TEACHER", "batch", "loss", "model",
           "sharpness"]

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
