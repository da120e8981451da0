"""The diagrams draw what the course's code does: their data are checked against it."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from course_utils.dataparallel import diagrams as dp_diagrams  # noqa: E402
from course_utils.dataparallel.by_hand import data_parallel  # noqa: E402
from course_utils.dataparallel.simulated import record_memory, sim_devices  # noqa: E402
from course_utils.dataparallel.splits import split_sizes  # noqa: E402
from course_utils.ddp import diagrams as ddp_diagrams  # noqa: E402
from course_utils.ddp.collectives import ring_bytes_per_rank  # noqa: E402


@pytest.mark.parametrize(("batch", "n"), [(30, 4), (30, 8), (5, 3), (7, 1)])
def test_dataparallel_scatter_rows_are_the_emulations(batch, n):
    moves = dp_diagrams.dataparallel_steps(batch, n)
    rows = {m.dst: m.rows for m in moves if m.step == "scatter inputs"}
    assert rows == {d: r for d, r in enumerate(split_sizes(batch, n)) if d != 0}
    x = torch.randn(batch, 3)
    with record_memory() as record:
        data_parallel(nn.Linear(3, 1), x, sim_devices(n), strict=False)
    for d, r in rows.items():  # the bytes the emulation copied to device d are those rows
        assert record.bytes(f"sim:{d}", "inputs") == r * x[0].nbytes


def test_every_dataparallel_transfer_touches_device_0_or_the_output_device():
    moves = dp_diagrams.dataparallel_steps(30, 4, output_device=2)
    assert moves and all({0, 2} & {m.src, m.dst} for m in moves)
    assert {m.dst for m in moves if m.step == "gather outputs"} == {2}
    assert {m.dst for m in moves if m.step == "reduce grads"} == {0}
    assert dp_diagrams.dataparallel_steps(30, 1) == []


def test_ddp_overlap_ends_no_later_and_starts_each_bucket_when_it_is_ready():
    t = ddp_diagrams.ddp_timeline([2.0] * 6, [2, 2, 2], [3.0, 3.0, 3.0])
    assert t["end_after"] == 12.0 + 9.0
    assert t["ready"] == [4.0, 8.0, 12.0]
    assert t["end_overlapped"] == 12.0 + 3.0  # only the last bucket's all-reduce is left after backward
    for (_, start, _), ready in zip(t["overlapped"], t["ready"], strict=True):
        assert start >= ready
    assert [layer for layer, *_ in t["backward"]] == [5, 4, 3, 2, 1, 0]  # last layer first
    free = ddp_diagrams.ddp_timeline([2.0] * 4, [2, 2], [0.0, 0.0])
    assert free["end_overlapped"] == free["end_after"] == 8.0
    with pytest.raises(ValueError, match="bucket_layers must split"):
        ddp_diagrams.ddp_timeline([1.0] * 3, [2, 2], [1.0, 1.0])


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_schedule_is_the_rings(n):
    steps = ddp_diagrams.ring_schedule(n)
    assert [s.phase for s in steps] == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    after_rs = steps[n - 2].holds
    for r in range(n):  # rank r holds the complete sum of chunk (r + 1) % N
        assert after_rs[r][(r + 1) % n] == n
        assert sorted(after_rs[r]).count(n) == 1
    assert all(v == n for row in steps[-1].holds for v in row)
    for s in steps:  # every rank sends one chunk per step, never the same chunk as a neighbour
        assert len(s.sends) == n and len(set(s.sends)) == n
    chunk = 1000
    assert len(steps) * chunk == ring_bytes_per_rank(chunk * n, n)


def test_the_drawings_draw():
    drawings = (dp_diagrams.draw_dataparallel(30, 4), ddp_diagrams.draw_ddp_overlap(),
                ddp_diagrams.draw_ring(4))
    for fig in drawings:
        assert fig.axes and fig.axes[0].get_title()
        plt.close(fig)
    assert len(ddp_diagrams.draw_ring(3).axes) == 4
    plt.close("all")
