"""Gradient compression with DDP communication hooks, on gloo (notebook 12).

:func:`train_compressed` trains with a plain all-reduce, PyTorch's ``fp16_compress_hook``, or
:func:`bf16_compress_on_gloo` and counts the bytes each step sends. :func:`torch_bf16_hook` shows
why PyTorch's own ``bf16_compress_hook`` is refused on some builds: DDP's check reads how torch was
built, which :func:`built_as` changes for a moment (:data:`BUILDS`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..devices import rank_device
from ..faults.snapshots import state_copy
from .training_bugs import LR, _sine_steps, small_model

__all__ = ["BUILDS", "bf16_compress_on_gloo", "built_as", "torch_bf16_hook", "train_compressed"]

#: What DDP's check of ``bf16_compress_hook`` reads, as two builds of torch have it: the CUDA
#: version it was built with (``torch.version.cuda``; ROCm's ``torch.version.hip`` counts too), its
#: NCCL (built in, and which version), and XPU with XCCL.
BUILDS = {"a CPU build": {"cuda": None, "nccl": None},
          "a CUDA build with NCCL 2.21": {"cuda": "12.8", "nccl": (2, 21, 5)}}


@contextlib.contextmanager
def built_as(cuda: str | None, nccl: tuple[int, ...] | None) -> Iterator[None]:
    """While inside, torch tells DDP's check of ``bf16_compress_hook`` that it was built with CUDA
    ``cuda`` (``None``: without CUDA) and NCCL ``nccl`` (``None``: without NCCL); no XPU. Only the
    answers to those questions change: collectives still run on the process group's backend."""
    saved = (torch.version.cuda, torch.version.hip, dist.is_nccl_available, dist.is_xccl_available,
             torch.cuda.nccl.version)
    torch.version.cuda, torch.version.hip = cuda, None
    dist.is_nccl_available = lambda: nccl is not None
    dist.is_xccl_available = lambda: False
    torch.cuda.nccl.version = lambda: nccl
    try:
        yield
    finally:
        (torch.version.cuda, torch.version.hip, dist.is_nccl_available, dist.is_xccl_available,
         torch.cuda.nccl.version) = saved


def torch_bf16_hook(rank: int, world_size: int, build: str | None, steps: int = 20) -> dict[str, Any]:
    """PyTorch's own ``bf16_compress_hook`` in DDP on this group's backend (gloo in notebook 12),
    registered as this torch is built (``build=None``) or as :data:`BUILDS` ``[build]`` would be.
    Raises DDP's ``TypeError`` where its check refuses; else trains as :func:`train_compressed`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_model = DDP(small_model().to(rank_device()))
    with built_as(**BUILDS[build]) if build is not None else contextlib.nullcontext():
        ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    losses = _sine_steps(ddp_model, optimizer, rank, steps, rows=16)
    return {"losses": losses, "params": state_copy(ddp_model.module)}


def bf16_compress_on_gloo(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``bf16_compress_hook`` under another name, which DDP accepts on any build (its
    check refuses the hook *named* ``bf16_compress_hook`` on builds without CUDA and NCCL 2.10+):
    the bucket travels as bfloat16, is averaged, and is written back in its own dtype."""
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


# DDP checks a hook's annotations as objects; this module's are strings (``from __future__``)
bf16_compress_on_gloo.__annotations__.update(bucket=dist.GradBucket,
                                             **{"return": torch.futures.Future[torch.Tensor]})


def train_compressed(rank: int, world_size: int, hook: str, steps: int = 20) -> dict[str, Any]:
    """DDP training with a communication hook: ``"fp32"`` (plain all-reduce), ``"fp16"``
    (PyTorch's ``fp16_compress_hook``) or ``"bf16"`` (:func:`bf16_compress_on_gloo`).

    Counts the bytes each step hands to ``all_reduce`` and returns them with the losses and the
    final parameters.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {"fp32": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": bf16_compress_on_gloo}
    device = rank_device()
    ddp_model = DDP(small_model().to(device))
    ddp_model.register_comm_hook(None, hooks[hook])
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    sent = []
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(tensor.nbytes)
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting  # the hooks call dist.all_reduce: count what they hand it
    try:
        losses = _sine_steps(ddp_model, optimizer, rank, steps, rows=16)
    finally:
        dist.all_reduce = real
    return {"bytes_per_step": sum(sent) / steps, "losses": losses, "params": state_copy(ddp_model.module)}
