"""``make bench``: the course's performance figures, measured on this machine.

It prints six comparisons, each side by side, the median of at least 5 repeats: DDP
scaling, ring all-reduce against gloo's, ``launch`` against torchrun, DataParallel's overhead, FSDP/DDP,
and DDP by hand (after backward, per parameter, bucketed) against torch's DDP.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from ..sharding.strategies import (
    CLASSES,
    machine_description,
    measure_strategies,
    mlp,
)

__all__ = ["main"]

#: DDP by hand against torch's DDP: the model's width (4 square layers of 4 MiB each at 1024),
#: rows per rank, and the bucket cap both bucketed versions use (4 buckets by hand at 1024)
BY_HAND_WIDTH, BY_HAND_ROWS, BY_HAND_CAP_MB = 1024, 32, 5.0


def _ring_rank(rank: int, world_size: int, sizes_mb: Sequence[int], repeats: int) -> dict:
    """``make bench``: median seconds of ``ring_all_reduce`` and ``dist.all_reduce``, alternating."""
    import torch.distributed as dist

    from ..ddp.collectives import ring_all_reduce
    from ..devices import rank_device

    out = {}
    for mb in sizes_mb:
        x = torch.randn(mb * 2**20 // 4, device=rank_device())
        ring_all_reduce(x.clone())  # warm-up both
        dist.all_reduce(x.clone())
        ring_s, gloo_s = [], []
        for _ in range(repeats):
            for fn, into in ((ring_all_reduce, ring_s), (dist.all_reduce, gloo_s)):
                y = x.clone()
                dist.barrier()
                start = time.perf_counter()
                fn(y)
                into.append(time.perf_counter() - start)
        out[mb] = (statistics.median(ring_s), statistics.median(gloo_s))
    return out


def _noop_rank(rank: int, world_size: int) -> int:
    """Join the process group and leave: what ``launch`` costs by itself."""
    return rank


def _dp_overhead(width: int, rows: int, repeats: int) -> tuple[float, float]:
    from ..dataparallel.by_hand import data_parallel
    from ..dataparallel.simulated import sim_devices

    model = mlp(width)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=g)
    y = torch.randint(0, CLASSES, (rows,), generator=g)
    loss_fn = nn.CrossEntropyLoss()
    plain, emulated = [], []
    for i in range(repeats + 1):
        for fn, into in ((lambda: model(x), plain),
                         (lambda: data_parallel(model, x, sim_devices(2)), emulated)):
            model.zero_grad()
            start = time.perf_counter()
            loss_fn(fn(), y).backward()
            if i:  # the first round warms up
                into.append(time.perf_counter() - start)
    return statistics.median(plain), statistics.median(emulated)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the machine and the six figures of ``make bench``."""
    import argparse

    from ..devices import BACKEND_VARIABLE
    from ..distributed import launch
    from ..faults.torchrun import torchrun

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="repeats per figure (>= 5)")
    parser.add_argument("--quick", action="store_true",
                        help="every figure once on a tiny job: a smoke test, not a measurement")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else max(5, args.repeats)
    torch.set_num_threads(1)
    began = time.perf_counter()
    # Every figure is a CPU figure (1 thread per rank), on any machine: GPUs would make the two
    # sides of a ratio unlike (one rank on a GPU against two on the CPU, say).
    cpu_launch = functools.partial(launch, backend="gloo", echo=False)
    print(f"machine: {machine_description()}")
    print("every figure runs on the CPU with the gloo backend, one thread per rank")
    print(f"each figure: median of {repeats} repeats, the two sides measured in the same run\n")
    rows = []

    # 1 and 5. one job (AdamW on an MLP, the same global batch): DDP on 1 and 2 ranks, FSDP on 2
    records = {r["strategy"]: r for r in measure_strategies(
        "tiny" if args.quick else "large", strategies=("ddp_1", "ddp_2", "fsdp_2"),
        steps=4 * repeats, progress=False, where="cpu")}
    one, two = (records[s]["samples_per_s"] for s in ("ddp_1", "ddp_2"))
    rows.append(("DDP scaling, 2 ranks / 1 rank (samples/s)", f"{two:8.0f} / {one:8.0f}",
                 two / one, "ideal 2.0, target >= 1.7"))

    # 2. ring all-reduce by hand against gloo's all_reduce, 2 ranks
    for mb, (ring_s, gloo_s) in cpu_launch(_ring_rank, 2, [1] if args.quick else [1, 16, 64],
                                           repeats)[0].items():
        rows.append((f"ring all-reduce / gloo, {mb} MB (bandwidth)",
                     f"{ring_s * 1e3:7.2f} / {gloo_s * 1e3:7.2f} ms", gloo_s / ring_s,
                     "target >= 0.8 at 16 MB" if mb == 16 else ""))

    # 3. launch (ranks forked from the fork server, or fresh interpreters) against torchrun,
    #    a 2-rank no-op each
    cpu_launch(_noop_rank, 2, start="forkserver")  # starts the server: not timed
    seconds: dict[str, list[float]] = {"forkserver": [], "subprocess": [], "torchrun": []}
    for _ in range(repeats):
        for how in seconds:
            start = time.perf_counter()
            if how == "torchrun":
                job = torchrun("course_utils.ddp.train", 2, "--out", os.devnull, "--noop",
                               env={BACKEND_VARIABLE: "gloo"})
                if job.returncode != 0:
                    raise RuntimeError("torchrun no-op failed:\n" + "\n".join(job.lines + job.log_lines))
            else:
                cpu_launch(_noop_rank, 2, start=how)
            seconds[how].append(time.perf_counter() - start)
    fm, sm, tm = (statistics.median(x) for x in seconds.values())
    rows.append(("launch (forked) / torchrun, 2-rank no-op (s)", f"{fm:7.2f} / {tm:7.2f} s",
                 fm / tm, "target <= 1.0"))
    rows.append(("launch (forked) / launch (fresh interpreters) (s)", f"{fm:7.2f} / {sm:7.2f} s",
                 fm / sm, "what the fork server saves per launch"))

    # 4. emulated DataParallel on 2 simulated devices against the plain forward + backward
    for label, width, batch in (("small", 64, 256), ("large", 64 if args.quick else 1024, 256)):
        plain, emulated = _dp_overhead(width, batch, repeats)
        rows.append((f"emulated DP (2 sim) / plain, {label} MLP w={width}",
                     f"{emulated * 1e3:7.2f} / {plain * 1e3:7.2f} ms", emulated / plain,
                     "time ratio; 1.0 = no overhead"))
    ddp_s, fsdp_s = records["ddp_2"]["step_time_s"], records["fsdp_2"]["step_time_s"]
    rows.append(("FSDP / DDP step time, 2 ranks, same job (s)", f"{fsdp_s:7.3f} / {ddp_s:7.3f} s",
                 fsdp_s / ddp_s, "ZeRO-3 sends 1.5x DDP's bytes; overlap decides the rest"))

    # 6. DDP by hand (notebook 06) against torch's DDP: one step of each version in turn, 2 ranks,
    #    on a model whose gradients take about as long to send as to compute
    from ..ddp.by_hand_timing import step_times_rank

    width, per_rank = (64, 8) if args.quick else (BY_HAND_WIDTH, BY_HAND_ROWS)
    by_hand = cpu_launch(step_times_rank, 2, width, per_rank, BY_HAND_CAP_MB, 2 * repeats)[0]
    step_s, ddp_step = by_hand["step_s"], by_hand["step_s"]["torch_ddp"]
    buckets = by_hand["buckets"]
    for version, label, note in (
            ("bucketed", "bucketed", f"goal <= 1.2; {buckets['bucketed']} buckets by hand, "
                                     f"{buckets['torch_ddp']} in DDP, cap {BY_HAND_CAP_MB:g} MiB"),
            ("per_parameter", "per parameter", "one all-reduce per parameter, from hooks"),
            ("after_backward", "after backward", "one all-reduce per parameter, after backward")):
        rows.append((f"DDP by hand, {label} / torch DDP, 2 ranks, w={width} (step ms)",
                     f"{step_s[version] * 1e3:7.2f} / {ddp_step * 1e3:7.2f} ms",
                     step_s[version] / ddp_step, note))

    width0 = max(len(r[0]) for r in rows)
    print(f"{'figure':{width0}}  {'measured':>22}  {'ratio':>6}  note")
    for name, measured, ratio, note in rows:
        print(f"{name:{width0}}  {measured:>22}  {ratio:6.2f}  {note}")
    print(f"\nbench took {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    # Run the module's own import, not this __main__ copy: the ranks import their functions
    # from course_utils.tools.bench by name.
    from course_utils.tools.bench import main as _main

    _main()
