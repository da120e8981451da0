"""What every rank of notebook 05's DDP job builds before it trains: the configuration
(``TrainConfig``), the seeded data set and model, and ``build_job``, which puts the model under DDP
on this rank's device and gives it a loader over this rank's shard. ``course_utils.ddp.train``
trains with it (and re-exports these names).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from .._checks import check_number, check_positive_int
from ..data import regression_dataset
from ..devices import rank_device, wrap_ddp
from ..faults.snapshots import state_copy
from ..models import seeded
from .amp import AMP_MODES, grad_scaler

__all__ = ["Job", "TrainConfig", "build_job", "make_dataset", "make_model"]


@dataclass(frozen=True)
class TrainConfig:
    """The job: ``epochs`` passes over ``data_size`` samples in global batches of
    ``global_batch_size`` rows (``global_batch_size = per_rank_batch_size * world_size``)."""

    data_size: int = 96
    global_batch_size: int = 24
    epochs: int = 2
    input_size: int = 8
    hidden_size: int = 32
    output_size: int = 2
    lr: float = 0.05
    momentum: float = 0.0
    seed: int = 0
    amp: str = "off"  # "off", "bf16" or "fp16" (course_utils.ddp.amp)

    def __post_init__(self) -> None:
        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {sorted(AMP_MODES)}, got {self.amp!r}")
        for name in ("data_size", "global_batch_size", "epochs", "input_size", "hidden_size",
                     "output_size"):
            check_positive_int(name, getattr(self, name))
        check_number("lr", self.lr, above=0)
        check_number("momentum", self.momentum, at_least=0, below=1)

    def per_rank_batch_size(self, world_size: int) -> int:
        world_size = check_positive_int("world_size", world_size)
        if self.global_batch_size % world_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} does not divide into "
                             f"{world_size} ranks: pick a multiple of the world size")
        return self.global_batch_size // world_size


def _check_config(config: TrainConfig) -> TrainConfig:
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    return config


def make_dataset(config: TrainConfig) -> Dataset:
    dataset, _, _ = regression_dataset(config.data_size, config.input_size, config.output_size,
                                       noise=0.1, seed=config.seed)
    return dataset


def make_model(config: TrainConfig) -> nn.Module:
    """The same initial weights in every process: they come from ``config.seed``."""
    return seeded(config.seed, lambda: nn.Sequential(
        nn.Linear(config.input_size, config.hidden_size),
        nn.ReLU(),
        nn.Linear(config.hidden_size, config.output_size),
    ))


@dataclass
class Job:
    """What each rank builds before it trains (notebook 05): ``build_job`` makes it."""

    device: torch.device
    sampler: DistributedSampler
    loader: DataLoader
    model: nn.Module
    ddp_model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module

    def finish(self, losses: list[float], seen: list[list[int]], steps: int) -> dict:
        """This rank's result; drops the DDP model before the group goes (gloo's clean exit)."""
        params = state_copy(self.model)
        self.ddp_model = self.optimizer = self.model = None
        gc.collect()
        return {"params": params, "losses": losses, "seen": seen, "steps": steps}


def build_job(rank: int, world_size: int, config: TrainConfig) -> Job:
    """Every rank builds the same model from the same seed, and a loader over its shard of the data."""
    device = rank_device()  # the CPU under gloo, cuda:LOCAL_RANK under NCCL
    dataset = make_dataset(config)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=config.seed)
    # the loader's own generator: starting an epoch then draws nothing from the global one
    loader = DataLoader(dataset, batch_size=config.per_rank_batch_size(world_size), sampler=sampler,
                        generator=torch.Generator().manual_seed(config.seed))
    model = make_model(config).to(device)
    ddp_model = wrap_ddp(model, device)  # DistributedDataParallel(model), told the GPU if on one
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=config.lr, momentum=config.momentum)
    scaler = grad_scaler(config.amp, device.type)  # scales only for fp16
    return Job(device, sampler, loader, model, ddp_model, optimizer, scaler, nn.MSELoss())
