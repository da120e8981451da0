"""Steps to a target against the global batch (notebook 07, section 2): Shallue et al.'s curve,
measured on :mod:`.batch_task` with many small models trained at once.

One process stands for N ranks of ``B / N`` rows: DDP's mean gradient is the gradient of the whole
batch (notebook 05), so a run with a global batch of ``B`` rows is one model trained on ``B`` rows a
step. :func:`sweep_batch` trains, for one global batch, every configuration (an optimizer and a
learning rate, maybe a warmup or AdaScale's gain) on several seeds at once: the weights of all the
copies are one tensor ``[seeds, configs, DIM]``, and a step is two batched matrix products
(``torch.bmm``) for every copy together. The copies of one seed see the same rows; the seeds differ.

"Steps to the target" is the first step at which the loss, averaged over the seeds, is at most the
target (the loss is :func:`.batch_task.loss`, exact: no evaluation set). A configuration whose
mean loss has not reached it within ``max_steps`` has no count (None).

The optimizers are torch's own rules, written for a tensor of copies: SGD with momentum
(``torch.optim.SGD(momentum=0.9)``) and AdamW (``torch.optim.AdamW``); the tests check each
against torch's, step for step, and notebook 07 checks one point of the sweep on real ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .._checks import check_number, check_positive_int
from . import batch_task
from .noise_scale import adascale_gain, gradient_noise_scale

__all__ = ["MOMENTUM", "Config", "Sweep", "draws", "linear_rule", "sqrt_rule", "sweep_batch"]

#: SGD's momentum (Goyal et al.'s) and AdamW's betas, epsilon and weight decay (torch's defaults)
MOMENTUM, BETAS, EPS, WEIGHT_DECAY = 0.9, (0.9, 0.999), 1e-8, 1e-2
#: AdaScale's moving averages of |G|² and tr(Σ): this much of the previous value is kept each step
#: (the course's choice, the same at every scale; fairscale's default: ``noise_scale.fairscale_smoothing``)
ADASCALE_SMOOTHING = 0.9


def linear_rule(base_lr: float, base_batch: int, batch: int) -> float:
    """Goyal et al.'s linear scaling rule: the learning rate grows as the global batch."""
    return check_number("base_lr", base_lr, above=0) * _ratio(base_batch, batch)


def sqrt_rule(base_lr: float, base_batch: int, batch: int) -> float:
    """The square-root rule's learning rate (Malladi et al.'s rule for Adam also changes the betas
    and epsilon; the course changes the learning rate only)."""
    return check_number("base_lr", base_lr, above=0) * math.sqrt(_ratio(base_batch, batch))


def _ratio(base_batch: int, batch: int) -> float:
    return check_positive_int("batch", batch) / check_positive_int("base_batch", base_batch)


@dataclass(frozen=True)
class Config:
    """One way to train: ``optimizer`` (``"sgd"``: momentum 0.9, or ``"adamw"``) at ``lr``;
    ``warmup`` steps of a linear ramp from ``warmup_from`` up to ``lr`` first (Goyal et al. start
    from the base learning rate); ``adascale``: the learning rate is ``lr`` times AdaScale's gain,
    measured every step on chunks of ``base_batch`` rows, the per-rank gradients of ``B /
    base_batch`` ranks, its two estimates averaged over the steps with ``smoothing`` (the share of
    the average kept at each step)."""

    optimizer: str
    lr: float
    warmup: int = 0
    warmup_from: float = 0.0
    adascale: bool = False
    base_batch: int = 1
    smoothing: float = ADASCALE_SMOOTHING

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        check_number("lr", self.lr, above=0)
        check_positive_int("warmup", self.warmup, minimum=0)
        check_positive_int("base_batch", self.base_batch)
        if self.adascale and self.optimizer != "sgd":
            raise ValueError("AdaScale is written for SGD (with momentum): use optimizer='sgd'")
        check_number("smoothing", self.smoothing, at_least=0, below=1)


@dataclass(frozen=True)
class Sweep:
    """What :func:`sweep_batch` measured at one global batch: per configuration, the steps to the
    target (None: not within ``max_steps``); with ``trace``, that copy's loss after every step;
    for each configuration with AdaScale (by index), its gain at every step (the mean over the seeds)."""

    batch: int
    steps: list[int | None]
    trace: list[float]
    gains: dict[int, list[float]]


def draws(batch: int, seeds: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The rows of every step of a sweep at global batch ``batch``: ``[seeds, batch, DIM]`` inputs
    and ``[seeds, batch]`` labels, step after step (the same for every configuration)."""
    generator = torch.Generator().manual_seed(batch)
    while True:
        yield batch_task.batch(generator, batch, seeds)


def sweep_batch(batch: int, configs: Sequence[Config], seeds: int, target: float, max_steps: int, *,
                keep: Sequence[int] | None = None, trace: tuple[int, int] | None = None) -> Sweep:
    """Train every configuration of ``configs`` on ``seeds`` seeds at global batch ``batch`` until
    its mean loss over the seeds reaches ``target`` or ``max_steps`` have run.

    A configuration stops as soon as it has reached the target. Those outside ``keep`` (indices;
    default: all are kept) also stop once they have run twice as many steps as the fastest
    configuration of their optimizer needed: they are not its best, and only the best matters for
    them (a learning rate grid). ``trace=(config, seed)`` records that copy's loss after every step
    (``seed=None``: the loss averaged over the seeds, the one the steps are counted on).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tensors are small: one thread is faster than a team
    try:
        return _sweep(batch, configs, seeds, target, max_steps, keep, trace)
    finally:
        torch.set_num_threads(threads)


def _sweep(batch: int, configs: Sequence[Config], seeds: int, target: float, max_steps: int,
           keep: Sequence[int] | None, trace: tuple[int, int] | None) -> Sweep:
    batch, seeds, max_steps = (check_positive_int(n, v) for n, v in
                               (("batch", batch), ("seeds", seeds), ("max_steps", max_steps)))
    configs = list(configs)
    for c in configs:
        if c.adascale and batch % c.base_batch:
            raise ValueError(f"AdaScale cuts the batch into chunks of base_batch rows: {batch} rows do "
                             f"not divide into chunks of {c.base_batch}")
    check_number("target", target)
    kept = torch.tensor([keep is None or i in keep for i in range(len(configs))])
    active = torch.arange(len(configs))
    steps = torch.zeros(len(configs), dtype=torch.int64)  # 0: not reached (yet)
    lr = torch.tensor([c.lr for c in configs])
    start = torch.tensor([c.warmup_from if c.warmup else c.lr for c in configs])
    ramp = torch.tensor([float(max(c.warmup, 1)) for c in configs])
    adam = torch.tensor([c.optimizer == "adamw" for c in configs])
    w = torch.zeros(seeds, len(configs), batch_task.DIM)
    first, second = torch.zeros_like(w), torch.zeros_like(w)  # momentum, or Adam's two moments
    smoothed = torch.zeros(seeds, len(configs), 2)  # AdaScale's moving |G|² and tr(Σ)
    losses: list[float] = []
    gains: dict[int, list[float]] = {i: [] for i, c in enumerate(configs) if c.adascale}
    best = torch.zeros(2, dtype=torch.int64)  # the first step at which SGD's, AdamW's, reached it
    rows = draws(batch, seeds)
    for step in range(1, max_steps + 1):
        x, y = next(rows)
        residual = torch.sigmoid(torch.bmm(w, x.transpose(1, 2))) - y[:, None, :]  # [seeds, C, batch]
        grad = torch.bmm(residual, x) / batch  # the mean gradient over the batch, per copy
        now = (start + (lr - start) * (step / ramp).clamp(max=1.0)).expand(seeds, -1).clone()
        for j, i in enumerate(active.tolist()):
            c = configs[i]
            if c.adascale and batch > c.base_batch:
                gain = _adascale(residual[:, j], x, grad[:, j], c.base_batch, smoothed[:, j], step,
                                 c.smoothing)
                now[:, j] *= gain
                gains[i].append(float(gain.mean()))
        a = adam[:, None]
        first = torch.where(a, BETAS[0] * first + (1 - BETAS[0]) * grad, MOMENTUM * first + grad)
        second = torch.where(a, BETAS[1] * second + (1 - BETAS[1]) * grad.square(), second)
        denom = (second / (1 - BETAS[1] ** step)).sqrt() + EPS
        update = torch.where(a, first / (1 - BETAS[0] ** step) / denom, first)
        w = w * torch.where(adam, 1 - now * WEIGHT_DECAY, 1.0)[..., None] - now[..., None] * update
        mean_loss = batch_task.loss(w).mean(0)
        if trace is not None and bool((active == trace[0]).any()):
            copy = int((active == trace[0]).nonzero())
            losses.append(float(mean_loss[copy] if trace[1] is None else batch_task.loss(w[trace[1], copy])))
        reached = mean_loss <= target
        steps[active[reached]] = step
        for group in (0, 1):
            if best[group] == 0 and bool((reached & (adam == bool(group))).any()):
                best[group] = step
        cutoff = best[adam.long()]
        done = reached | (~kept & (cutoff > 0) & (step >= 2 * cutoff))
        if bool(done.all()):
            break
        if bool(done.any()):
            stay = ~done
            w, first, second, smoothed = w[:, stay], first[:, stay], second[:, stay], smoothed[:, stay]
            active, kept, lr, start, ramp, adam = (t[stay] for t in (active, kept, lr, start, ramp, adam))
    return Sweep(batch, [int(s) or None for s in steps], losses, gains)


def _adascale(residual: torch.Tensor, x: torch.Tensor, grad: torch.Tensor, base_batch: int,
              smoothed: torch.Tensor, step: int, a: float) -> torch.Tensor:
    """AdaScale's gain for one configuration, per seed: the batch cut into chunks of
    ``base_batch`` rows (the ranks' own gradients), the mean squared norm of a chunk's gradient and
    the squared norm of the whole batch's; smoothed over the steps (``a`` of the average kept each
    step), then the gain."""
    seeds, batch = residual.shape
    chunks = batch // base_batch
    used = chunks * base_batch
    per_chunk = torch.einsum("snb,snbd->snd", residual[:, :used].reshape(seeds, chunks, base_batch),
                             x[:, :used].reshape(seeds, chunks, base_batch, -1)) / base_batch
    small = per_chunk.square().sum(-1).mean(1)
    big = grad.square().sum(-1)
    estimate = gradient_noise_scale(small, big, base_batch, used)
    smoothed.mul_(a).add_((1 - a) * torch.stack([estimate.sq_norm, estimate.trace], -1))
    sq_norm, trace = (smoothed / (1 - a ** step)).unbind(-1)  # debiased, as Adam's moments
    return adascale_gain(sq_norm, trace, base_batch, used)
