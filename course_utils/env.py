"""What this machine has, and what the course will run for real on it (notebook 00).

Also the two habits every notebook starts with: seeding everything, and choosing a device.
"""

from __future__ import annotations

import os
import platform
import random
import sys
from dataclasses import dataclass, field

import torch

from ._checks import check_int

__all__ = [
    "DeviceReport",
    "device_report",
    "in_colab",
    "pick_device",
    "seed_everything",
]


def in_colab() -> bool:
    """True inside Google Colab (its runtime module is importable only there)."""
    return "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ


def _distributed_backends() -> tuple[bool, bool]:
    import torch.distributed as dist

    if not dist.is_available():
        return False, False
    return bool(dist.is_nccl_available()), bool(dist.is_gloo_available())


@dataclass(frozen=True)
class DeviceReport:
    """A snapshot of the software and devices that the course can use here."""

    python: str
    torch: str
    cuda_available: bool
    cuda_version: str | None
    gpu_names: tuple[str, ...]
    nccl: bool
    gloo: bool
    colab: bool
    cpu_cores: int
    plan: tuple[tuple[str, str], ...] = field(default=())

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_names)

    def lines(self) -> list[str]:
        """The report as aligned lines, ready to print."""
        gpus = ", ".join(f"cuda:{i} {n}" for i, n in enumerate(self.gpu_names)) or "none"
        rows = [
            ("Python", self.python),
            ("PyTorch", self.torch),
            ("CUDA available", f"{self.cuda_available} (CUDA {self.cuda_version or '-'})"),
            ("GPUs", f"{self.gpu_count}: {gpus}"),
            ("NCCL available", str(self.nccl)),
            ("gloo available", str(self.gloo)),
            ("CPU cores", str(self.cpu_cores)),
            ("Running in Colab", str(self.colab)),
        ]
        width = max(len(k) for k, _ in rows)
        return [f"{k:<{width}} : {v}" for k, v in rows]

    def plan_lines(self) -> list[str]:
        """One line per part of the course: does it run for real here, or emulated?"""
        width = max(len(k) for k, _ in self.plan)
        return [f"{k:<{width}} : {v}" for k, v in self.plan]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _course_plan(gpus: int, nccl: bool, gloo: bool) -> tuple[tuple[str, str], ...]:
    multi = gpus >= 2
    dp = (
        f"real: splits every batch over {gpus} GPUs"
        if multi
        else f"real, but a pass-through with {gpus} GPU(s); splits shown on simulated devices"
    )
    by_hand = (
        f"real torch.nn.parallel primitives on {gpus} GPUs, compared with the CPU emulation"
        if multi
        else "CPU emulation of replicate/scatter/parallel_apply/gather on simulated devices"
    )
    memory = (
        "measured per GPU (torch.cuda.max_memory_allocated) and modelled"
        if gpus
        else "modelled by the ledger, checked against the tensors the emulation creates"
    )
    if multi and nccl:
        ddp = f"real processes, NCCL, one per GPU (up to {gpus})"
    elif gloo:
        ddp = "real processes on the CPU, gloo backend"
    else:
        ddp = "unavailable: this PyTorch build has no gloo backend"
    amp = "bf16 autocast on the CPU; fp16 + GradScaler on the GPU" if gpus else (
        "bf16 autocast on the CPU, for real; the fp16 + GradScaler cells need a GPU"
    )
    return (
        ("02 nn.DataParallel", dp),
        ("03 DataParallel by hand", by_hand),
        ("04 memory per device", memory),
        ("05 DistributedDataParallel", ddp),
        ("06 mixed precision", amp),
    )


def device_report() -> DeviceReport:
    """Collect the report. Asking for GPU names initialises CUDA when a GPU is present."""
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    names = tuple(torch.cuda.get_device_name(i) for i in range(count))
    nccl, gloo = _distributed_backends()
    return DeviceReport(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_available=cuda,
        cuda_version=torch.version.cuda,
        gpu_names=names,
        nccl=nccl,
        gloo=gloo,
        colab=in_colab(),
        cpu_cores=os.cpu_count() or 1,
        plan=_course_plan(len(names), nccl, gloo),
    )


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (the CPU and every GPU) with ``seed``.

    Code that wants a stream of its own (a ``DataLoader``'s shuffling, say) takes a seeded
    ``torch.Generator`` instead; ``course_utils.data.make_loader`` does.
    """
    seed = check_int("seed", seed)
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is pinned
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily


def pick_device(index: int | None = None) -> torch.device:
    """The device to use: ``cuda:index`` (``cuda:0`` by default) when CUDA is there, else CPU.

    Asking for a GPU index that does not exist raises ``ValueError`` instead of failing later
    with a CUDA error deep inside a forward pass.
    """
    if index is not None:
        index = check_int("index", index)
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = 0 if index is None else index
    if index >= count:
        raise ValueError(f"cuda:{index} does not exist: this machine has {count} GPU(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return torch.device(f"cuda:{index}")
