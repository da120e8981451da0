import math

import matplotlib
import pytest
import torch

from course_utils.dataparallel.splits import epoch_splits, plot_epoch_splits, simulate_tutorial, split_sizes

matplotlib.use("Agg")

PUBLISHED = {  # the tutorial's published splits for 100 samples in batches of 30
    2: [[15, 15]] * 3 + [[5, 5]],
    3: [[10, 10, 10]] * 3 + [[4, 4, 2]],
    4: [[8, 8, 8, 6]] * 3 + [[3, 3, 3, 1]],
    8: [[4, 4, 4, 4, 4, 4, 4, 2]] * 3 + [[2, 2, 2, 2, 2]],
}


def test_split_sizes_agrees_with_torch_chunk_everywhere():
    """The one comparison with torch.chunk: every batch up to 300 rows on up to 16 devices."""
    for batch in range(1, 301):
        for devices in range(1, 17):
            sizes = split_sizes(batch, devices)
            assert sizes == [len(c) for c in torch.arange(batch).chunk(devices)], (batch, devices)
            assert sum(sizes) == batch and len(sizes) <= devices
            assert sizes[:-1] == [math.ceil(batch / devices)] * (len(sizes) - 1)


def test_split_sizes_examples():
    assert split_sizes(30, 8) == [4, 4, 4, 4, 4, 4, 4, 2]
    assert split_sizes(10, 8) == [2, 2, 2, 2, 2]
    assert split_sizes(1, 4) == [1]
    assert split_sizes(7, 1) == [7]


@pytest.mark.parametrize("bad", [0, -1, -30])
def test_split_sizes_rejects_non_positive(bad):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        split_sizes(bad, 2)
    with pytest.raises(ValueError, match="num_devices must be an int >= 1"):
        split_sizes(30, bad)


@pytest.mark.parametrize("bad", [1.5, 2.0, "3", None, True, [2]])
def test_split_sizes_rejects_non_ints(bad):
    with pytest.raises(TypeError, match="must be an int"):
        split_sizes(bad, 2)
    with pytest.raises(TypeError, match="num_devices must be an int"):
        split_sizes(30, bad)


def test_split_sizes_accepts_integer_scalars():
    assert split_sizes(torch.tensor(30), 4) == [8, 8, 8, 6]


@pytest.mark.parametrize("devices", sorted(PUBLISHED))
def test_epoch_splits_match_published(devices):
    assert epoch_splits(100, 30, devices) == PUBLISHED[devices]


def test_epoch_splits_drop_last_and_errors():
    assert epoch_splits(100, 30, 2, drop_last=True) == [[15, 15]] * 3
    assert epoch_splits(90, 30, 3) == [[10, 10, 10]] * 3
    with pytest.raises(ValueError, match="leaves no batch"):
        epoch_splits(10, 30, 2, drop_last=True)
    with pytest.raises(ValueError, match="data_size"):
        epoch_splits(0, 30, 2)


@pytest.mark.parametrize("devices", sorted(PUBLISHED))
def test_simulate_tutorial_prints_the_tutorial_lines(devices):
    lines = []
    seen = simulate_tutorial(devices, report=lines.append)
    assert seen == PUBLISHED[devices]
    inside = [line for line in lines if line.startswith("\tIn Model:")]
    outside = [line for line in lines if line.startswith("Outside:")]
    assert len(inside) == sum(len(s) for s in PUBLISHED[devices])
    assert len(outside) == 4
    assert inside[0] == (f"\tIn Model: input size torch.Size([{PUBLISHED[devices][0][0]}, 5]) "
                         f"output size torch.Size([{PUBLISHED[devices][0][0]}, 2])")
    assert outside[-1] == ("Outside: input size torch.Size([10, 5]) "
                           "output_size torch.Size([10, 2])")


def test_simulate_tutorial_rejects_bad_arguments():
    with pytest.raises(ValueError):
        simulate_tutorial(0)
    with pytest.raises(TypeError, match="report must be callable"):
        simulate_tutorial(2, report="print")


def test_plot_draws_one_bar_per_chunk_and_labels_idle_devices():
    ax = plot_epoch_splits(100, 30, 8)
    bars = [p for p in ax.patches]
    table = epoch_splits(100, 30, 8)
    assert len(bars) == sum(len(s) for s in table)
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("idle") == 3  # devices 5, 6 and 7 in the last batch
    assert labels.count("2") == 3 + 5
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"device {d}" for d in range(8)]
    matplotlib.pyplot.close("all")
