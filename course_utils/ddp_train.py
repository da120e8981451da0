"""One DDP training job, run three ways (notebook 05).

- ``launch(train_ddp, N, config)`` from a notebook;
- ``python -m torch.distributed.run --standalone --nproc-per-node=N -m course_utils.ddp_train``
  as a script under torchrun (``main`` below), which saves rank 0's final parameters;
- ``train_reference(config, N)`` in one process, with the global batch that the N ranks share.

All three start from the same weights and see the same samples, so they must end with the same
parameters. The data set is the seeded regression set of ``course_utils.data``; each rank reads
its shard through a ``DistributedSampler`` and a ``DataLoader``.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ._checks import check_positive_int
from .amp import AMP_MODES, autocast, grad_scaler
from .data import regression_dataset

__all__ = [
    "TrainConfig",
    "make_dataset",
    "make_model",
    "main",
    "train_ddp",
    "train_reference",
]


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
    seed: int = 0
    amp: str = "off"  # "off", "bf16" or "fp16" (course_utils.amp)

    def __post_init__(self) -> None:
        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {sorted(AMP_MODES)}, got {self.amp!r}")
        for name in ("data_size", "global_batch_size", "epochs", "input_size", "hidden_size",
                     "output_size"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or self.lr <= 0:
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")

    def per_rank_batch_size(self, world_size: int) -> int:
        world_size = check_positive_int("world_size", world_size)
        if self.global_batch_size % world_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} does not divide into "
                             f"{world_size} ranks: pick a multiple of the world size")
        return self.global_batch_size // world_size


def make_dataset(config: TrainConfig) -> Dataset:
    dataset, _, _ = regression_dataset(config.data_size, config.input_size, config.output_size,
                                       noise=0.1, seed=config.seed)
    return dataset


def make_model(config: TrainConfig) -> nn.Module:
    """The same initial weights in every process: they come from ``config.seed``."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(config.seed)
    model = nn.Sequential(
        nn.Linear(config.input_size, config.hidden_size),
        nn.ReLU(),
        nn.Linear(config.hidden_size, config.output_size),
    )
    torch.random.set_rng_state(generator_state)
    return model


def _sampler(dataset: Dataset, config: TrainConfig, world_size: int, rank: int) -> DistributedSampler:
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                              seed=config.seed)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def train_ddp(rank: int, world_size: int, config: TrainConfig = TrainConfig()) -> dict:
    """Train with ``DistributedDataParallel`` inside an initialised process group.

    Returns this rank's final parameters, its per-step losses and the sample indices it saw in
    each epoch.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        raise RuntimeError("train_ddp needs a process group: run it with launch(...) or torchrun")
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dataset = make_dataset(config)
    sampler = _sampler(dataset, config, world_size, rank)
    loader = DataLoader(dataset, batch_size=config.per_rank_batch_size(world_size), sampler=sampler)
    model = make_model(config).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if on_gpu else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=config.lr)
    scaler = grad_scaler(config.amp, device.type)  # scales only for fp16
    loss_fn = nn.MSELoss()
    losses, seen = [], []
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        seen.append(list(sampler))
        for inputs, targets in loader:
            with autocast(config.amp, device.type):
                loss = loss_fn(ddp_model(inputs.to(device)), targets.to(device))
            optimizer.zero_grad()
            scaler.scale(loss).backward()  # DDP all-reduces the gradients here, bucket by bucket
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
    params = _snapshot(model)
    del ddp_model, optimizer, model
    gc.collect()
    return {"params": params, "losses": losses, "seen": seen}


def train_reference(config: TrainConfig, world_size: int) -> dict:
    """The same training in one process: each step uses the union of the N ranks' batches.

    Every rank's batch has the same number of rows (``DistributedSampler`` pads the data to a
    multiple of ``world_size``), so the mean loss over the union equals the mean of the ranks'
    mean losses, and its gradient equals DDP's averaged gradient.
    """
    per_rank = config.per_rank_batch_size(world_size)
    dataset = make_dataset(config)
    model = make_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    scaler = grad_scaler(config.amp, "cpu")
    loss_fn = nn.MSELoss()
    losses = []
    for epoch in range(config.epochs):
        shards = []
        for rank in range(world_size):
            sampler = _sampler(dataset, config, world_size, rank)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        steps = -(-len(shards[0]) // per_rank)
        for step in range(steps):
            index = [i for shard in shards for i in shard[step * per_rank:(step + 1) * per_rank]]
            inputs, targets = dataset[index]
            with autocast(config.amp, "cpu"):
                loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
    return {"params": _snapshot(model), "losses": losses}


def main(argv: list[str] | None = None) -> None:
    """The torchrun entry point: ``-m course_utils.ddp_train --out PATH [--epochs N ...]``."""
    import os

    import torch.distributed as dist

    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description="DDP training under torchrun; rank 0 saves.")
    parser.add_argument("--out", required=True, help="where rank 0 saves the final parameters")
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--noop", action="store_true",
                        help="join the process group and leave (launch-overhead benchmark)")
    args = parser.parse_args(argv)
    config = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})

    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, init_method="env://")  # torchrun sets RANK, WORLD_SIZE, ...
    if args.noop:
        dist.barrier()
        dist.destroy_process_group()
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = train_ddp(rank, world_size, config)
    if rank == 0:  # rank-0-only saving and printing
        torch.save(result["params"], args.out)
        print(f"rank 0 of {world_size}: {len(result['losses'])} steps, "
              f"last loss {result['losses'][-1]:.4f}; parameters saved", flush=True)
    dist.barrier()
    del result
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
