"""The gradient noise scale and AdaScale's gain, from the gradients DDP's ranks already hold
(notebook 07, sections 3 and 4).

A gradient computed on ``B`` rows drawn independently is the true gradient ``G`` plus noise of
covariance ``Σ / B`` (``Σ``: the covariance of one row's gradient), so the expected squared norm
of that gradient is ``|G|² + tr(Σ) / B``. Two batch sizes give two such equations, and their
solution is an unbiased estimate of each unknown (McCandlish et al. 2018, appendix A). Under DDP
the two sizes are already there: each rank's local gradient (``B_small``: the rows of one rank) and
the averaged gradient (``B_big = N * B_small``). Their ratio ``B_simple = tr(Σ) / |G|²`` is the
paper's simple noise scale, its estimate of the critical batch size when the Hessian is close to a
multiple of the identity (``B_noise`` is the general one).

:class:`NoiseScaleDDP` is :class:`.by_hand.DDPByHand` with the two squared norms measured at every
synchronised step, for one scalar all-reduce more. :func:`adascale_gain` turns the same two
estimates into AdaScale's learning-rate gain (Johnson et al. 2020).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from .by_hand import DDPByHand

__all__ = ["NoiseScale", "NoiseScaleDDP", "adascale_gain", "fairscale_smoothing", "gradient_noise_scale",
           "smoothed"]


class NoiseScale(NamedTuple):
    """The estimates of ``|G|²`` (``sq_norm``), ``tr(Σ)`` (``trace``) and their ratio ``b_simple``."""

    sq_norm: Any
    trace: Any
    b_simple: Any


def _value(name: str, value: Any) -> Any:
    """A real number (a Python, NumPy or 0-d torch number) as a float, or a float tensor as is."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number or a tensor of real numbers, "
                            f"got a {value.dtype} tensor")
        return value if value.is_floating_point() else value.double()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number (a squared norm), got {value!r} ({type(value).__name__})")
    return float(value)


def _size(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of rows, got {value!r} ({type(value).__name__})")
    if not value > 0:
        raise ValueError(f"{name} must be a number of rows > 0, got {value!r}")
    return float(value)


def gradient_noise_scale(small_sq_norm: Any, big_sq_norm: Any, b_small: float, b_big: float) -> NoiseScale:
    """Unbiased estimates of ``|G|²`` and ``tr(Σ)``, and ``B_simple``, from two squared norms.

    ``small_sq_norm``: the squared norm of a gradient over ``b_small`` rows (for N ranks, the mean
    over the ranks of each rank's local squared norm, a better estimate of the same expectation);
    ``big_sq_norm``: the squared norm of a gradient over ``b_big`` rows (DDP's averaged gradient,
    ``b_big = N * b_small``). Numbers give floats; tensors give tensors, element by element.

    Each estimate is unbiased; their ratio is not (the ratio of two noisy numbers): average the
    estimates over steps before dividing (:func:`smoothed`). A single step's estimate of ``|G|²``
    can be negative when the noise dominates.
    """
    small_sq_norm, big_sq_norm = _value("small_sq_norm", small_sq_norm), _value("big_sq_norm", big_sq_norm)
    b_small, b_big = _size("b_small", b_small), _size("b_big", b_big)
    if not b_big > b_small:
        raise ValueError(f"b_big must be larger than b_small (the averaged gradient covers more rows "
                         f"than one rank's), got b_small={b_small:g} and b_big={b_big:g}: the two "
                         "equations need two different batch sizes")
    # region: estimates
    # E|g_B|² = |G|² + tr(Σ)/B at B = b_small and at B = b_big: two equations, two unknowns
    sq_norm = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
    trace = (small_sq_norm - big_sq_norm) / (1 / b_small - 1 / b_big)
    return NoiseScale(sq_norm, trace, trace / sq_norm)
    # endregion


def smoothed(estimates: list[NoiseScale], smoothing: float = 0.9) -> list[float]:
    """``B_simple`` after each step, from exponential moving averages of the estimates of
    ``|G|²`` and ``tr(Σ)``, divided only then: the paper's way to avoid the bias of a ratio of
    noisy numbers (the two averages start at zero together, so their ratio needs no debiasing).
    ``smoothing``: the share of the average kept at each step."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    out, sq_norm, trace = [], 0.0, 0.0
    for e in estimates:
        sq_norm = smoothing * sq_norm + (1 - smoothing) * float(e.sq_norm)
        trace = smoothing * trace + (1 - smoothing) * float(e.trace)
        out.append(trace / sq_norm if sq_norm > 0 else float("inf"))
    return out


def adascale_gain(sq_norm: Any, trace: Any, base_batch: float, batch: float) -> Any:
    """AdaScale's gain for a global batch of ``batch`` rows over a recipe at ``base_batch`` rows:
    ``(σ² + μ²) / (σ²/S + μ²)`` with ``S = batch / base_batch``, ``μ² = |G|²`` and ``σ² =
    tr(Σ) / base_batch`` (the variance of the recipe's gradient). 1 where the gradient has no
    noise, S where it is all noise; estimates that came out negative are read as 0. The learning
    rate is the recipe's times the gain."""
    base_batch, batch = _size("base_batch", base_batch), _size("batch", batch)
    tensors = isinstance(sq_norm, torch.Tensor) or isinstance(trace, torch.Tensor)
    scale = batch / base_batch
    # region: gain
    mu2 = torch.as_tensor(_value("sq_norm", sq_norm), dtype=torch.float64).clamp(min=0)  # |G|²
    sigma2 = torch.as_tensor(_value("trace", trace), dtype=torch.float64).clamp(min=0) / base_batch
    ratio = (sigma2 + mu2) / (sigma2 / scale + mu2).clamp(min=1e-300)
    gain = torch.where(sigma2 + mu2 > 0, ratio, torch.ones_like(ratio)).clamp(1.0, max(scale, 1.0))
    # endregion
    return gain.float() if tensors else float(gain)


def fairscale_smoothing(scale: float) -> float:
    """The smoothing of AdaScale's moving averages that fairscale's ``AdaScale`` uses when none is
    given: ``max(1 - S / 1000, 0)``, ``S`` the number of gradients averaged in a step (world size
    times accumulation steps), so the average spans about ``1000 / S`` steps."""
    return max(1.0 - _size("scale", scale) / 1000, 0.0)


class NoiseScaleDDP(DDPByHand):
    """:class:`.by_hand.DDPByHand` that also measures the two squared norms at every synchronised
    step: each bucket's local gradient as its all-reduce starts (where a DDP communication hook
    would see it), and the averaged gradient once the step is synchronised; then one scalar
    all-reduce gives the mean over the ranks of the local squared norms.

    After a synchronised ``backward()`` (which ends in ``finish_gradient_synchronization()``),
    ``sq_norms`` is ``(mean local squared norm, squared norm of the averaged gradient)``;
    ``history`` keeps every step's pair.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None, **kwargs: Any) -> None:
        super().__init__(module, bucket_cap_mb, **kwargs)
        self._local = torch.zeros((), dtype=torch.float64, device=self.trainable[0].device)
        self.sq_norms: tuple[float, float] | None = None
        self.history: list[tuple[float, float]] = []

    def _start_all_reduce(self, b: int) -> None:
        for param in self.buckets[b]:  # this rank's own gradient, before the all-reduce sums it
            self._local += param.grad.double().square().sum()
        super()._start_all_reduce(b)

    def finish_gradient_synchronization(self) -> None:
        synchronised = any(self.arrived)
        try:
            super().finish_gradient_synchronization()
        except RuntimeError:
            self._local.zero_()  # the failed step's partial sum must not reach the next step
            raise
        if not synchronised:
            return
        local, self._local = self._local, torch.zeros_like(self._local)
        dist.all_reduce(local)  # the one scalar more per step
        big = sum(float(p.grad.double().square().sum()) for p in self.trainable)
        self.sq_norms = (float(local) / self.world_size, big)
        self.history.append(self.sq_norms)
