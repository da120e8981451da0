"""How ``nn.DataParallel`` splits a batch over devices (notebook 02).

``DataParallel``'s scatter cuts each input tensor with ``tensor.chunk(len(device_ids), dim)``.
``chunk`` makes pieces of ``ceil(batch / devices)`` rows and a smaller last piece, and it makes
*fewer* pieces than devices when the batch is small: 10 rows over 8 devices become 5 pieces of
2, and three devices get nothing. ``split_sizes`` states that rule without a tensor, so it can be
printed, plotted and reasoned about.
"""

from __future__ import annotations

from collections.abc import Callable

from .._checks import check_positive_int

__all__ = [
    "epoch_splits",
    "plot_epoch_splits",
    "simulate_tutorial",
    "split_sizes",
]


def split_sizes(batch_size: int, num_devices: int) -> list[int]:
    """The chunk sizes that ``nn.DataParallel`` gives each device, in device order.

    The rule of ``torch.chunk``: every chunk has ``ceil(batch_size / num_devices)`` rows except
    the last, which has what is left. The list can be shorter than ``num_devices``: the devices
    beyond its end get no work for this batch.

    >>> split_sizes(30, 4)
    [8, 8, 8, 6]
    >>> split_sizes(10, 8)
    [2, 2, 2, 2, 2]
    """
    batch_size = check_positive_int("batch_size", batch_size)
    num_devices = check_positive_int("num_devices", num_devices)
    chunk = -(-batch_size // num_devices)  # ceil division
    full, rest = divmod(batch_size, chunk)
    return [chunk] * full + ([rest] if rest else [])


def epoch_splits(
    data_size: int, batch_size: int, num_devices: int, *, drop_last: bool = False
) -> list[list[int]]:
    """``split_sizes`` for every batch of one epoch over ``data_size`` samples."""
    data_size = check_positive_int("data_size", data_size)
    batch_size = check_positive_int("batch_size", batch_size)
    num_devices = check_positive_int("num_devices", num_devices)
    full, rest = divmod(data_size, batch_size)
    batches = [batch_size] * full + ([rest] if rest and not drop_last else [])
    if not batches:
        raise ValueError(
            f"drop_last=True with data_size={data_size} < batch_size={batch_size} leaves no batch"
        )
    return [split_sizes(b, num_devices) for b in batches]


def plot_epoch_splits(
    data_size: int, batch_size: int, num_devices: int, *, drop_last: bool = False, ax=None
):
    """Draw one epoch's splits: one row per device, one bar per batch, labelled with its size.

    A bar's length is the chunk's share of a full batch's chunk; an idle device shows a grey
    dash. Returns the matplotlib ``Axes``.
    """
    import matplotlib.pyplot as plt

    table = epoch_splits(data_size, batch_size, num_devices, drop_last=drop_last)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.5 * len(table), 0.6 + 0.42 * num_devices))
    biggest = max(max(sizes) for sizes in table)
    colors = plt.get_cmap("tab10")
    for b, sizes in enumerate(table):
        for device in range(num_devices):
            y = device
            if device < len(sizes):
                width = 0.9 * sizes[device] / biggest
                ax.barh(y, width, left=b, height=0.7, color=colors(device % 10), alpha=0.85)
                ax.text(b + 0.05, y, str(sizes[device]), va="center", ha="left", fontsize=9,
                        color="white", fontweight="bold")
            else:
                ax.text(b + 0.05, y, "idle", va="center", ha="left", fontsize=8, color="0.55")
    ax.set_yticks(range(num_devices), [f"device {d}" for d in range(num_devices)])
    ax.set_xticks([b + 0.45 for b in range(len(table))],
                  [f"batch {b}\n({sum(s)} rows)" for b, s in enumerate(table)])
    ax.set_xlim(-0.05, len(table))
    ax.invert_yaxis()
    ax.set_title(f"{data_size} samples, batch {batch_size}, {num_devices} device(s)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return ax


def simulate_tutorial(
    num_devices: int,
    *,
    data_size: int = 100,
    batch_size: int = 30,
    input_size: int = 5,
    output_size: int = 2,
    seed: int = 0,
    report: Callable[[str], object] = print,
) -> list[list[int]]:
    """Run the tutorial's loop as ``nn.DataParallel`` would on ``num_devices`` devices.

    Every batch is cut by the scatter rule and each chunk goes through the tutorial's ``Model``
    (each replica is an identical copy, so one module serves them all); the outputs are
    concatenated as gather does. The lines are those the tutorial prints, in device order (real
    replicas run in threads and may print in any order). Returns the chunk sizes of each batch.
    """
    import torch

    from ..data import RandomDataset, make_loader
    from ..models import Model

    num_devices = check_positive_int("num_devices", num_devices)
    if not callable(report):
        raise TypeError(f"report must be callable, got {type(report).__name__}")
    loader = make_loader(RandomDataset(input_size, data_size, seed=seed), batch_size, seed=seed)
    model = Model(input_size, output_size, report=report)
    seen: list[list[int]] = []
    with torch.no_grad():
        for data in loader:
            chunks = torch.split(data, split_sizes(len(data), num_devices))
            output = torch.cat([model(chunk) for chunk in chunks])
            report(f"Outside: input size {data.size()} output_size {output.size()}")
            seen.append([len(c) for c in chunks])
    return seen
