"""What this machine has, and what the course will run for real on it (notebook 00).

Also the two habits every notebook starts with: seeding everything, and choosing a device.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._checks import check_int

__all__ = [
    "DeviceReport",
    "NOTEBOOKS_DIR",
    "course_notebooks",
    "course_plan",
    "device_report",
    "in_colab",
    "pick_device",
    "random_state_kept",
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


#: Where the course's notebooks live in a checkout (``make install`` installs the package in place).
NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"

#: Each notebook's topic (its file name without the number) and the label the plan gives it,
#: in the course's order.
_TOPICS = {"single_gpu": "one device", "data_parallel": "nn.DataParallel",
           "data_parallel_by_hand": "DataParallel by hand", "output_device_and_memory": "memory per device",
           "distributed_data_parallel": "DistributedDataParallel", "ddp_by_hand": "DDP by hand",
           "batch_size_and_learning_rate": "batch size and learning rate",
           "mixed_precision": "mixed precision",
           "fault_tolerance_and_multi_node": "faults and nodes",
           "sharded_data_parallel": "sharded data parallel",
           "choosing_a_strategy": "choosing a strategy", "debugging_distributed": "debugging"}


def course_notebooks(folder: str | os.PathLike | None = None) -> list[str]:
    """The course's notebooks after this one, as file stems (``01_single_gpu``...), in order.

    Read from ``folder`` (default: the checkout's ``notebooks/``), so that the plan follows the
    notebooks as they are numbered now. Where there is no such folder (the package installed
    alone, as in Colab), the topics the plan knows, numbered in the course's order.
    """
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path to the notebooks, got {type(folder).__name__}")
    folder = NOTEBOOKS_DIR if folder is None else Path(folder)
    found = sorted(p.stem for p in folder.glob("[0-9][0-9]_*.ipynb")) if folder.is_dir() else []
    if found:
        return [stem for stem in found if stem[3:] != "environment_check"]
    return [f"{number:02d}_{topic}" for number, topic in enumerate(_TOPICS, start=1)]


def course_plan(gpus: int, nccl: bool, gloo: bool,
                notebooks: list[str] | None = None) -> tuple[tuple[str, str], ...]:
    """What each notebook runs for real on a machine with ``gpus`` GPUs, and what it emulates:
    one row ``("NN label", text)`` per notebook of :func:`course_notebooks` (or of ``notebooks``)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be an int >= 0, got {gpus!r}")
    multi = gpus >= 2
    one_device = "cuda:0, for real" if gpus else "the CPU (cuda:N is explained, not run)"
    if multi:
        dp = f"real: splits every batch over {gpus} GPUs"
    elif gpus:
        dp = "real on cuda:0, but one device means no split; splits shown on simulated devices"
    else:
        dp = "a pass-through on the CPU; splits shown on simulated devices"
    by_hand = "CPU emulation of replicate/scatter/parallel_apply/gather on simulated devices" + (
        f", compared with nn.DataParallel on {gpus} GPUs" if multi else "")
    memory = "modelled by the ledger, checked against the tensors the emulation creates" + (
        f"; also measured on {gpus} GPUs (max_memory_allocated)" if multi
        else "; the GPU measurement needs 2 GPUs")
    if not gloo and not (multi and nccl):
        ddp = "unavailable: this PyTorch build has no gloo backend"
    elif multi and nccl:
        ddp = (f"real processes; NCCL, one GPU per rank, for jobs of up to {gpus} ranks; larger "
               "jobs and the CPU-only lessons on gloo")
    elif gpus:
        why = "one GPU cannot host two NCCL ranks" if gpus == 1 else "this PyTorch has no NCCL"
        ddp = f"real processes on the CPU, gloo ({why})"
    else:
        ddp = "real processes on the CPU, gloo backend"
    by_hand_ddp = ("gradient hooks, buckets and their all-reduces on " + (
        "NCCL, one GPU per rank" if multi and nccl else "gloo, real processes on the CPU")
        + ", timed beside torch's DDP") if gloo or (multi and nccl) else ddp
    batch_size = ("global batch and learning-rate rules measured: the ranks on " + (
        "NCCL, one GPU per rank" if multi and nccl else "gloo, real processes on the CPU")
        + "; the sweep of many small models in one process, on the CPU") if gloo or (multi and nccl) else ddp
    amp = "bf16, and fp16 with a GradScaler, autocast on the CPU" + (
        "; fp16 + GradScaler on the GPU too" if gpus else "")
    strategies = (f"every strategy on GPUs ({gpus} available)" if multi and nccl
                  else "every strategy on the CPU: DataParallel on simulated devices, DDP on gloo")
    faults = ("torchrun restarts with NCCL (one GPU per rank); two emulated nodes, each on GPUs "
              "of its own" if multi and nccl else
              "torchrun restarts and two emulated nodes, all on gloo on the CPU")
    sharded = "ZeRO 1/2/3 by hand, ZeroRedundancyOptimizer, FSDP2: " + (
        f"NCCL, one GPU per rank, for jobs of up to {gpus} ranks (larger on gloo); peak GPU memory "
        "per rank" if multi and nccl else "real processes on the CPU, gloo; memory and bytes counted")
    debugging = "the broken programs on gloo on the CPU, on every machine; " + (
        "their fixes on NCCL, one GPU per rank" if multi and nccl else "their fixes too") + (
        "; the CUDA fork error reproduced" if gpus else "; the CUDA fork error explained, not run")
    texts = {"single_gpu": one_device, "data_parallel": dp, "data_parallel_by_hand": by_hand,
             "output_device_and_memory": memory, "distributed_data_parallel": ddp, "ddp_by_hand": by_hand_ddp,
             "batch_size_and_learning_rate": batch_size, "mixed_precision": amp,
             "choosing_a_strategy": strategies,
             "fault_tolerance_and_multi_node": faults, "sharded_data_parallel": sharded,
             "debugging_distributed": debugging}
    stems = course_notebooks() if notebooks is None else notebooks
    return tuple((f"{stem[:2]} {_TOPICS.get(stem[3:], stem[3:].replace('_', ' '))}",
                  texts.get(stem[3:], "see the notebook")) for stem in stems)


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
        plan=course_plan(len(names), nccl, gloo),
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


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Inside, code may seed or draw from Python's, NumPy's and torch's global generators; on the
    way out each is where it was, torch's GPU generators too. An exercise's check runs so: the
    learner's next random numbers do not depend on having run it.

    Before CUDA starts, torch only queues what is done to the GPU generators (``torch.manual_seed``
    queues a seed for every GPU, even on a machine without one) and applies it when CUDA starts: so
    what was queued inside is taken back, and if CUDA started inside, every GPU's generator starts
    again as CUDA starts it, with what the learner had queued applied (``compat.restore_gpu_generators``)."""
    import numpy as np

    from .compat import pending_gpu_generators, restore_gpu_generators

    python, numpy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    queued = pending_gpu_generators() if cuda is None else None
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        elif queued is not None:
            restore_gpu_generators(*queued)


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
