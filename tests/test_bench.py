import re

import pytest
import torch

from course_utils.sharding import strategies as strategy_harness
from course_utils.tools import bench


def test_machine_description():
    text = strategy_harness.machine_description()
    assert "cores" in text and "PyTorch" in text


def test_measure_strategies_returns_one_record_each():
    strategies = ("single", "dp", "parallel_criterion", "ddp_2", "ddp_2_amp", "zero1_2", "fsdp_2")
    records = strategy_harness.measure_strategies("tiny", strategies=strategies, steps=2, progress=False)
    assert [r["strategy"] for r in records] == list(strategies)
    for r in records:
        assert set(r) == {"strategy", "processes", "devices", "on_gpu", "where", "global_batch",
                          "step_time_s", "samples_per_s", "peak_memory_mb", "model_state_mb",
                          "memory_kind"}
        assert r["samples_per_s"] == pytest.approx(r["global_batch"] / r["step_time_s"])
        assert r["global_batch"] == 2 * strategy_harness.SIZES["tiny"][1]
        assert len(r["peak_memory_mb"]) == (r["processes"] if not r["on_gpu"] else r["devices"])
        assert len(r["model_state_mb"]) == r["processes"]
    assert records[3]["processes"] == 2 and records[1]["devices"] == 2
    # the model state each process holds, counted from its tensors: AdamW keeps 2 moments
    state = {r["strategy"]: r["model_state_mb"] for r in records}
    width = strategy_harness.SIZES["tiny"][0]
    psi = 3 * (width * width + width) + width * 10 + 10
    assert state["single"] == state["ddp_2"][:1] == [4 * psi * 4 / 2**20]
    assert sum(state["fsdp_2"]) == pytest.approx(state["single"][0])  # ZeRO-3: everything split
    zero_state = [s - 2 * 4 * psi / 2**20 for s in state["zero1_2"]]  # minus parameters and gradients
    assert sum(zero_state) == pytest.approx(2 * 4 * psi / 2**20) and max(zero_state) < 2 * 4 * psi / 2**20


@pytest.mark.parametrize("kwargs, message", [
    ({"size": "huge"}, "size must be one of"),
    ({"strategies": ("fsdp",)}, "strategies must be"),
    ({"strategies": ()}, "strategies must be"),
    ({"devices": 0}, "devices"),
    ({"steps": 0}, "steps"),
])
def test_measure_strategies_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        strategy_harness.measure_strategies(**{"size": "tiny", **kwargs})


def test_make_bench_prints_every_figure(capsys):
    """``make bench --quick``: every figure once on a tiny job, FSDP's step time over DDP's and DDP
    by hand's over torch's DDP included."""
    bench.main(["--quick"])
    out = capsys.readouterr().out
    figures = ["DDP scaling, 2 ranks / 1 rank", "ring all-reduce / gloo, 1 MB", "launch (forked) / torchrun",
               "launch (forked) / launch (fresh interpreters)", "emulated DP (2 sim) / plain, small",
               "emulated DP (2 sim) / plain, large", "FSDP / DDP step time, 2 ranks, same job",
               "DDP by hand, bucketed / torch DDP", "DDP by hand, per parameter / torch DDP",
               "DDP by hand, after backward / torch DDP"]
    for figure in figures:
        line = next(line for line in out.splitlines() if line.startswith(figure))
        # "<figure>   <a> / <b> [unit]   <ratio>  <note>": the ratio is a / b (the ring's, b / a: a
        # bandwidth), within what the printed digits of a and b allow
        columns = line.split(")", 1)[1]
        a, b, ratio = re.search(r"([\d.]+) / +([\d.]+)(?: m?s)? +(\d+\.\d\d)\b", columns).groups()
        if figure.startswith("ring"):
            a, b = b, a
        half = [0.5 * 10 ** -len(x.partition(".")[2]) for x in (a, b)]
        low = (float(a) - half[0]) / (float(b) + half[1])
        high = (float(a) + half[0]) / max(float(b) - half[1], 1e-12)
        assert low - 0.005 <= float(ratio) <= high + 0.005, line


def test_measure_loader_times_every_worker_count():
    result = strategy_harness.measure_loader((0, 2), work="cpu", seconds_per_sample=0.002, samples=16,
                                  batch_size=4, progress=False)
    assert result["num_workers"] == [0, 2] and len(result["epoch_s"]) == 2
    # without workers, one epoch does every sample's 2 ms of work in this process, one by one
    assert result["epoch_s"][0] >= 16 * 0.002 and result["first_epoch_s"][0] >= 16 * 0.002
    with pytest.raises(ValueError, match="num_workers"):
        strategy_harness.measure_loader((-1,))
    with pytest.raises(ValueError, match="num_workers"):
        strategy_harness.measure_loader(())


def test_measure_loader_keeps_the_fastest_epoch_and_never_beats_the_floor():
    samples, cost = 16, 0.002
    result = strategy_harness.measure_loader((0, 2), work="io", seconds_per_sample=cost, samples=samples,
                                             batch_size=4, repeats=2, progress=False)
    # waiting: the floor is samples × cost over the workers that wait at once (one without workers)
    for workers, epoch in zip(result["num_workers"], result["epoch_s"], strict=True):
        assert epoch >= samples * cost / max(workers, 1)
    with pytest.raises(ValueError, match="repeats"):
        strategy_harness.measure_loader((0,), repeats=0)


def test_bf16_costs_times_a_product_both_ways_and_a_cast_on_one_thread():
    threads = torch.get_num_threads()
    cost = strategy_harness.bf16_costs(width=64, rows=8, repeats=2)
    assert set(cost) == {"fp32 product", "bf16 product", "cast to bf16"} and min(cost.values()) > 0
    assert torch.get_num_threads() == threads  # put back as it was
