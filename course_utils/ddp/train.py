"""One DDP training job, run three ways (notebook 05).

- ``launch(train_ddp, N, config)`` from a notebook (``train_resumable``: the same, able to
  resume from a snapshot after a restart, notebook 09);
- ``python -m torch.distributed.run --standalone --nproc-per-node=N -m course_utils.ddp.train``
  as a script under torchrun (``main`` below), which saves rank 0's final parameters;
- ``train_reference(config, N)`` in one process, with the global batch that the N ranks share.

All three start from the same weights and see the same samples, so they must end with the same
parameters. The data set is the seeded regression set of ``course_utils.data``; each rank reads
its shard through a ``DistributedSampler`` and a ``DataLoader``.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ..devices import choose_backend
from ..distributed import rank_print
from ..faults.snapshots import ResumableSampler, load_snapshot, save_snapshot, state_copy
from ..faults.torchrun import init_from_torchrun
from .amp import grad_scaler, train_step
from .job import Job, TrainConfig, _check_config, build_job, make_dataset, make_model

__all__ = [
    "Job",
    "TrainConfig",
    "build_job",
    "make_dataset",
    "make_model",
    "main",
    "resume",
    "train_ddp",
    "train_reference",
    "train_resumable",
]


def _check_snapshot_args(snapshot, snapshot_every, before_step) -> None:
    if snapshot is not None and not isinstance(snapshot, (str, os.PathLike)):
        raise TypeError(f"snapshot must be a path or None, got {type(snapshot).__name__}")
    if not isinstance(snapshot_every, int) or isinstance(snapshot_every, bool) or snapshot_every < 0:
        raise ValueError(f"snapshot_every must be an int >= 0, got {snapshot_every!r}")
    if snapshot_every and snapshot is None:
        raise ValueError("snapshot_every needs a snapshot path to save to")
    if before_step is not None and not callable(before_step):
        raise TypeError(f"before_step must be callable or None, got {type(before_step).__name__}")


def train_ddp(rank: int, world_size: int, config: TrainConfig = TrainConfig()) -> dict:
    """Train with ``DistributedDataParallel`` inside an initialised process group (notebook 05).

    Returns this rank's final parameters, its per-step losses and the sample indices it saw in
    each epoch.
    """
    job = build_job(rank, world_size, config)
    losses, seen = [], []
    for epoch in range(config.epochs):
        job.sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        seen.append(list(job.sampler))
        for inputs, targets in job.loader:
            # DDP all-reduces the gradients during backward, bucket by bucket
            loss = train_step(job.ddp_model, job.loss_fn, inputs.to(job.device), targets.to(job.device),
                              job.optimizer, job.scaler, config.amp, job.device.type)
            losses.append(loss.item())
    return job.finish(losses, seen, steps=len(losses))


def resume(snapshot, ddp_model, optimizer, scaler, attempt: int) -> tuple[int, int, int]:
    """(epoch, batch in that epoch, global step) to start from: the snapshot's, or zeros (notebook 09)."""
    if snapshot is None:
        return 0, 0, 0
    if not Path(snapshot).is_file():
        rank_print(f"attempt {attempt}: no snapshot yet, starting at step 0", only_rank=0)
        return 0, 0, 0
    info = load_snapshot(snapshot, ddp_model, optimizer, scaler)
    rank_print(f"attempt {attempt}: resumed from the snapshot of step {info.global_step} "
               f"(epoch {info.epoch}, batch {info.step_in_epoch})", only_rank=0)
    return info.epoch, info.step_in_epoch, info.global_step


def train_resumable(rank: int, world_size: int, config: TrainConfig = TrainConfig(),
                    snapshot: str | os.PathLike | None = None, snapshot_every: int = 0,
                    before_step: Callable[[int, int, int], None] | None = None) -> dict:
    """``train_ddp`` that survives a restart (notebook 09), bitwise the same when nothing fails.

    With ``snapshot``, training resumes from that file if it exists, and rank 0 writes it every
    ``snapshot_every`` steps. ``before_step(rank, global_step, attempt)`` runs before each step:
    notebook 09 injects a fault with it (``course_utils.faults.crashes.KillAt``).
    """
    _check_config(config)
    _check_snapshot_args(snapshot, snapshot_every, before_step)
    job = build_job(rank, world_size, config)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    per_rank = job.loader.batch_size
    resumable = ResumableSampler(job.sampler)  # a resumed epoch starts at the batch where it stopped
    loader = DataLoader(job.loader.dataset, batch_size=per_rank, sampler=resumable,
                        generator=job.loader.generator)
    if callable(getattr(before_step, "check", None)):  # a fault that could never fire is refused
        before_step.check(world_size, config.epochs * len(loader))
    # region: loop
    start_epoch, start_batch, global_step = resume(snapshot, job.ddp_model, job.optimizer, job.scaler,
                                                   attempt)
    losses, seen = [], []
    for epoch in range(start_epoch, config.epochs):
        job.sampler.set_epoch(epoch)
        resumable.skip = start_batch * per_rank if epoch == start_epoch else 0
        seen.append(list(resumable))
        for batch, (inputs, targets) in enumerate(loader, start=resumable.skip // per_rank):
            if before_step is not None:
                before_step(rank, global_step, attempt)
            loss = train_step(job.ddp_model, job.loss_fn, inputs.to(job.device), targets.to(job.device),
                              job.optimizer, job.scaler, config.amp, job.device.type)
            losses.append(loss.item())
            global_step += 1
            if snapshot_every and global_step % snapshot_every == 0:
                # printed before the collective save, so the line order never depends on timing
                rank_print(f"attempt {attempt}: step {global_step} done, loss {loss.item():.4f}; "
                           "saving a snapshot", only_rank=0)
                epoch_done = batch + 1 == len(loader)
                save_snapshot(snapshot, job.ddp_model, job.optimizer, job.scaler, epoch=epoch + epoch_done,
                              step_in_epoch=0 if epoch_done else batch + 1, global_step=global_step)
    # endregion
    return job.finish(losses, seen, steps=global_step)


def train_reference(config: TrainConfig, world_size: int) -> dict:
    """The same training in one process: each step uses the union of the N ranks' batches.

    Every rank's batch has the same number of rows (``DistributedSampler`` pads the data to a
    multiple of ``world_size``), so the mean loss over the union equals the mean of the ranks'
    mean losses, and its gradient equals DDP's averaged gradient.
    """
    per_rank = _check_config(config).per_rank_batch_size(world_size)
    dataset = make_dataset(config)
    model = make_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    scaler = grad_scaler(config.amp, "cpu")
    loss_fn = nn.MSELoss()
    losses = []
    for epoch in range(config.epochs):
        shards = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                         seed=config.seed)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        steps = -(-len(shards[0]) // per_rank)
        for step in range(steps):
            index = [i for shard in shards for i in shard[step * per_rank:(step + 1) * per_rank]]
            inputs, targets = dataset[index]
            loss = train_step(model, loss_fn, inputs, targets, optimizer, scaler, config.amp, "cpu")
            losses.append(loss.item())
    return {"params": state_copy(model), "losses": losses}


def main(argv: list[str] | None = None) -> None:
    """The torchrun entry point: ``-m course_utils.ddp.train --out PATH [--epochs N ...]``."""
    import os

    import torch.distributed as dist

    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description="DDP training under torchrun; rank 0 saves.")
    parser.add_argument("--out", required=True, help="where rank 0 saves the final parameters")
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--noop", action="store_true",
                        help="join the process group and leave (launch-overhead benchmark)")
    parser.add_argument("--snapshot", help="resume from / save snapshots to this file")
    parser.add_argument("--snapshot-every", type=int, default=0, help="save every N steps")
    parser.add_argument("--kill-rank", type=int, help="fault injection: the rank that dies")
    parser.add_argument("--kill-at-step", type=int, help="fault injection: once this many steps are done")
    args = parser.parse_args(argv)
    if (args.kill_rank is None) != (args.kill_at_step is None):
        parser.error("--kill-rank and --kill-at-step go together: give both or neither")
    config = TrainConfig(**{k: getattr(args, k) for k in asdict(defaults)})

    gc.freeze()  # the imports stay for good: the gc.collect() at the end looks only at the training
    torch.set_num_threads(1)
    # NCCL when each of this node's ranks has a GPU of its own (COURSE_BACKEND overrides)
    backend = choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    init_from_torchrun(backend)  # binds cuda:LOCAL_RANK under NCCL; a clean store per attempt
    if args.noop:
        dist.barrier()
        dist.destroy_process_group()
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fault = None
    if args.kill_rank is not None:
        from ..faults.crashes import KillAt

        fault = KillAt(args.kill_rank, args.kill_at_step)
    if args.snapshot is None and fault is None:
        result = train_ddp(rank, world_size, config)
    else:
        result = train_resumable(rank, world_size, config, args.snapshot, args.snapshot_every, fault)
    if rank == 0:  # rank-0-only saving and printing
        torch.save(result["params"], args.out)
        rank_print(f"rank 0 of {world_size}: finished at step {result['steps']}, "
                   f"last loss {result['losses'][-1]:.4f}; parameters saved", rank=rank)
    dist.barrier()
    del result
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
