import statistics

import pytest

from course_utils import bench
from course_utils.distributed import launch


def test_machine_description():
    text = bench.machine_description()
    assert "cores" in text and "PyTorch" in text


def test_measure_strategies_returns_one_record_each():
    strategies = ("single", "dp", "parallel_criterion", "ddp_2", "ddp_2_amp")
    records = bench.measure_strategies("tiny", strategies=strategies, steps=2, progress=False)
    assert [r["strategy"] for r in records] == list(strategies)
    for r in records:
        assert set(r) == {"strategy", "processes", "devices", "on_gpu", "where", "global_batch",
                          "step_time_s", "samples_per_s", "peak_memory_mb", "memory_kind"}
        assert r["step_time_s"] > 0 and r["samples_per_s"] > 0
        assert r["global_batch"] == 2 * bench.SIZES["tiny"][1]
        assert len(r["peak_memory_mb"]) == (r["processes"] if not r["on_gpu"] else r["devices"])
    assert records[3]["processes"] == 2 and records[1]["devices"] == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"size": "huge"}, "size must be one of"),
    ({"strategies": ("fsdp",)}, "strategies must be"),
    ({"strategies": ()}, "strategies must be"),
    ({"devices": 0}, "devices"),
    ({"steps": 0}, "steps"),
])
def test_measure_strategies_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.measure_strategies(**{"size": "tiny", **kwargs})


def test_bench_pieces_measure_something():
    rates = launch(bench._scaling_rank, 2, 64, 32, 2, 2, echo=False)
    assert len(rates[0]) == 2 and statistics.median(rates[0]) > 0
    ring = launch(bench._ring_rank, 2, [1], 2, echo=False)[0]
    assert set(ring) == {1} and all(t > 0 for t in ring[1])
    plain, emulated = bench._dp_overhead(32, 16, 2)
    assert plain > 0 and emulated > 0
    assert launch(bench._noop_rank, 2, echo=False) == [0, 1]


def test_measure_loader_times_every_worker_count():
    result = bench.measure_loader((0, 2), work="cpu", seconds_per_sample=0.002, samples=16,
                                  batch_size=4, progress=False)
    assert result["num_workers"] == [0, 2] and len(result["epoch_s"]) == 2
    assert all(t > 0 for t in result["epoch_s"] + result["first_epoch_s"])
    with pytest.raises(ValueError, match="num_workers"):
        bench.measure_loader((-1,))
    with pytest.raises(ValueError, match="num_workers"):
        bench.measure_loader(())
