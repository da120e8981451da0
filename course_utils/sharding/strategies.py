"""The strategy harness of notebook 11: one training job under each strategy, measured side by side.

``measure_strategies(size)`` runs one training job (an MLP classifier, AdamW) under each strategy,
in fresh processes, and returns per strategy: time per step, samples per second, peak memory per
device (CUDA: ``max_memory_allocated``; CPU: each process's peak resident memory) and the model
state each process holds (parameters, gradients, optimizer state, counted from its tensors).
``measure_loader`` times a ``DataLoader`` with more and more workers. ``make bench``
(:mod:`course_utils.tools.bench`) uses the same harness.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn

from .._checks import check_positive_int

__all__ = ["CLASSES", "SIZES", "STRATEGIES", "bf16_costs", "devices_needed", "machine_description",
           "measure_loader", "measure_strategies", "mlp", "strategy_placement"]

#: size -> (MLP width, rows per device per step)
SIZES = {"tiny": (64, 32), "small": (256, 64), "medium": (1024, 128), "large": (1024, 1024)}
STRATEGIES = ("single", "dp", "parallel_criterion", "ddp_1", "ddp_2", "ddp_2_amp", "zero1_2", "fsdp_2")
CLASSES = 10


def machine_description() -> str:
    """One line about this machine: CPU, cores, GPUs, PyTorch."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_names = f" ({torch.cuda.get_device_name(0)})" if gpus else ""
    return (f"{cpu}, {os.cpu_count()} cores, {gpus} GPU(s){gpu_names}, PyTorch {torch.__version__},"
            f" Python {platform.python_version()}, {platform.system()}")


def mlp(width: int) -> nn.Module:
    from ..models import seeded

    return seeded(0, lambda: nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                                           nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                           nn.Linear(width, CLASSES)))


def bf16_costs(width: int = 1024, rows: int = 128, repeats: int = 10) -> dict[str, float]:
    """Milliseconds, on one CPU thread (the fastest of several runs), of what bf16 autocast changes
    in one ``width`` × ``width`` layer of the harness's MLP: its matrix product on ``rows`` rows in
    fp32 and in bf16, and the cast of its fp32 weight to bf16, which autocast does every forward."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, width, generator=g), torch.randn(width, width, generator=g)
    x16, w16 = x.bfloat16(), w.bfloat16()
    runs = {"fp32 product": lambda: x @ w.t(), "bf16 product": lambda: x16 @ w16.t(),
            "cast to bf16": lambda: w.bfloat16()}
    try:
        best = {}
        for name, run in runs.items():
            run()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(repeats):
                    run()
                times.append((time.perf_counter() - start) / repeats * 1e3)
            best[name] = min(times)
        return best
    finally:
        torch.set_num_threads(threads)


def _peak_rss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB else


def _processes(strategy: str) -> int:
    """``ddp_N``, ``zero1_N``, ``fsdp_N``: N processes; the others one."""
    return int(strategy.split("_")[1]) if strategy.startswith(("ddp", "zero1", "fsdp")) else 1


def devices_needed(strategy: str, devices: int) -> int:
    """How many devices ``strategy`` uses: ``devices`` for the DataParallel kinds, else its processes."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    devices = check_positive_int("devices", devices)
    return devices if strategy in ("dp", "parallel_criterion") else _processes(strategy)


def strategy_placement(strategies: Sequence[str], devices: int, where: str = "auto", *,
                       gpus: int | None = None, nccl: bool | None = None) -> str:
    """``"gpu"`` or ``"cpu"``: where every strategy of one comparison runs, all in one place.

    On GPUs only when there are enough for the strategy that needs most (and NCCL for several
    processes), else on the CPU. ``where="gpu"`` insists (an error if that cannot be), ``"cpu"``
    forces the CPU, ``"auto"`` (the default) picks GPUs when they suffice.
    """
    import torch.distributed as dist

    from ..devices import gpu_count

    if where not in ("auto", "cpu", "gpu"):
        raise ValueError(f"where must be 'auto', 'cpu' or 'gpu', got {where!r}")
    needed = max(devices_needed(s, devices) for s in strategies)
    gpus = gpu_count() if gpus is None else gpus
    nccl = (dist.is_available() and dist.is_nccl_available()) if nccl is None else nccl
    enough = gpus >= needed and (nccl or all(_processes(s) == 1 for s in strategies))
    if where == "gpu" and not enough:
        raise ValueError(f"where='gpu' needs {needed} GPU(s) (and NCCL for DDP); this machine has "
                         f"{gpus}")
    return "gpu" if where != "cpu" and enough else "cpu"


def _harness_rank(rank: int, world_size: int, strategy: str, width: int, global_batch: int,
                  devices: int, steps: int) -> dict:
    """One process of ``measure_strategies``: build, warm up, time ``steps`` steps, where
    ``rank_device()`` says (under NCCL DataParallel uses GPUs ``0..devices-1``, else simulated ones)."""
    import torch.distributed as dist

    from ..dataparallel.by_hand import DataParallelByHand
    from ..dataparallel.parallel_criterion import DataParallelCriterion, DataParallelModel
    from ..dataparallel.simulated import sim_devices
    from ..ddp.amp import grad_scaler, train_step
    from ..devices import rank_device, wrap_ddp
    from .runs import model_state_bytes, shard_layers

    device = rank_device()
    on_gpu = device.type == "cuda"
    model = mlp(width).to(device)
    loss_fn: nn.Module | DataParallelCriterion = nn.CrossEntropyLoss()
    amp = "off"
    if strategy == "dp":
        model = (nn.DataParallel(model, device_ids=list(range(devices))) if on_gpu
                 else DataParallelByHand(model, sim_devices(devices)))
    elif strategy == "parallel_criterion":
        ids = list(range(devices)) if on_gpu else sim_devices(devices)
        model = DataParallelModel(model, ids)
        loss_fn = DataParallelCriterion(nn.CrossEntropyLoss(), ids)
    elif strategy.startswith(("ddp", "zero1")):
        model = wrap_ddp(model, device)
        if strategy.endswith("_amp"):
            amp = "fp16" if on_gpu else "bf16"
    elif strategy.startswith("fsdp"):
        model = shard_layers(model)
    rows = global_batch // world_size
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(rows, width, generator=g).to(device)
    y = torch.randint(0, CLASSES, (rows,), generator=g).to(device)
    used = ([] if not on_gpu else list(range(devices)) if strategy in ("dp", "parallel_criterion")
            else [device.index])
    if strategy.startswith("zero1"):  # importing torch.distributed.optim takes a second: only here
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no state until its first step
    scaler = grad_scaler(amp, device.type)
    times = []
    for step in range(steps + 2):  # two warm-up steps
        if step == 2:
            for d in used:
                torch.cuda.reset_peak_memory_stats(d)
        dist.barrier()
        for d in used:  # every device the step uses, not only the current one
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        train_step(model, loss_fn, x, y, optimizer, scaler, amp, device.type)
        for d in used:
            torch.cuda.synchronize(d)
        if step >= 2:
            times.append(time.perf_counter() - start)
    memory = [torch.cuda.max_memory_allocated(d) / 2**20 for d in used] if used else [_peak_rss_mb()]
    state = sum(model_state_bytes(model, optimizer).values()) / 2**20
    del model, optimizer
    return {"step_time_s": statistics.median(times), "memory_mb": memory, "state_mb": state, "on_gpu": on_gpu,
            "where": (f"cuda:{','.join(map(str, used))}" if on_gpu else
                      f"cpu, {devices} simulated devices" if strategy in ("dp", "parallel_criterion")
                      else "cpu")}


def measure_strategies(size: str = "small", *, strategies: Sequence[str] = STRATEGIES,
                       devices: int = 2, steps: int = 8, progress: bool = True,
                       where: str = "auto") -> list[dict]:
    """Time one training job under each strategy; one record per strategy.

    Every strategy trains the same MLP on the same global batch (``devices`` times the size's
    rows per device) for ``steps`` timed steps after two warm-up steps, all in one place
    (``strategy_placement``). The DataParallel kinds use ``devices`` GPUs (or simulated devices);
    ``ddp_N``, ``zero1_N`` (DDP with ``ZeroRedundancyOptimizer``) and ``fsdp_N`` (FSDP2, each
    ``nn.Linear`` a unit) N processes, one GPU or one CPU thread each. ``ddp_2_amp`` adds
    autocast (fp16 with a GradScaler on GPUs, bf16 on the CPU). Records say where they ran.
    """
    from ..distributed import launch
    from ..progress_bars import tqdm  # a widget in JupyterLab; in a stored notebook, text reading 100%

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"strategies must be a non-empty list drawn from {STRATEGIES}, "
                         f"got {list(strategies)!r}")
    devices = check_positive_int("devices", devices)
    steps = check_positive_int("steps", steps)
    on_gpu = strategy_placement(strategies, devices, where) == "gpu"
    width, rows = SIZES[size]
    global_batch = rows * devices
    records = []
    for strategy in tqdm(list(strategies), desc=f"strategies ({size})", disable=not progress,
                         mininterval=0, miniters=1):
        ranks = _processes(strategy)
        results = launch(_harness_rank, ranks, strategy, width, global_batch, devices, steps,
                         echo=False, timeout_s=600, backend="nccl" if on_gpu else "gloo")
        step_time = max(r["step_time_s"] for r in results)  # a step ends when the slowest rank does
        records.append({
            "strategy": strategy,
            "processes": ranks,
            "devices": devices if strategy in ("dp", "parallel_criterion") else ranks,
            "on_gpu": results[0]["on_gpu"],
            "where": results[0]["where"],
            "global_batch": global_batch,
            "step_time_s": step_time,
            "samples_per_s": global_batch / step_time,
            "peak_memory_mb": [m for r in results for m in r["memory_mb"]],
            "model_state_mb": [r["state_mb"] for r in results],
            "memory_kind": ("cuda max_memory_allocated per device" if results[0]["on_gpu"]
                            else "peak resident memory per process"),
        })
    return records


def measure_loader(num_workers: Sequence[int] = (0, 1, 2, 4), *, work: str = "io",
                   seconds_per_sample: float = 0.01, samples: int = 64, batch_size: int = 8,
                   repeats: int = 3, progress: bool = True) -> dict:
    """Seconds per epoch of a ``DataLoader`` over a ``SlowDataset``, for each worker count.

    Workers start from a clean process (``forkserver`` where available, else ``spawn``) and
    persist; the first epoch (worker start-up) is timed apart from the ``repeats`` after it, of
    which ``"epoch_s"`` keeps the fastest (other work on the machine only ever slows an epoch
    down). DataLoader's warnings (more workers than cores) are collected in ``"warnings"``.
    """
    import multiprocessing
    import warnings

    from torch.utils.data import DataLoader

    from ..data import SlowDataset
    from ..progress_bars import tqdm  # a widget in JupyterLab; in a stored notebook, text reading 100%

    if not num_workers or any(isinstance(w, bool) or not isinstance(w, int) or w < 0
                              for w in num_workers):
        raise ValueError(f"num_workers must be a non-empty list of ints >= 0, got {num_workers!r}")
    repeats = check_positive_int("repeats", repeats)
    dataset = SlowDataset(samples, seconds_per_sample, work=work)
    context = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    result = {"work": work, "num_workers": list(num_workers), "first_epoch_s": [],
              "epoch_s": [], "warnings": []}
    for workers in tqdm(list(num_workers), desc=f"num_workers ({work})", disable=not progress,
                        mininterval=0, miniters=1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers,
                                persistent_workers=workers > 0,
                                multiprocessing_context=context if workers else None)
            times = []
            for _ in range(1 + repeats):
                start = time.perf_counter()
                for _batch in loader:
                    pass
                times.append(time.perf_counter() - start)
            del loader
        result["first_epoch_s"].append(times[0])
        result["epoch_s"].append(min(times[1:]))
        result["warnings"] += sorted({str(w.message).split(".")[0] for w in caught})
    return result
