"""Pictures of one ``nn.DataParallel`` step, drawn from the split rule the course's code runs
(notebooks 02-04).

``dataparallel_steps`` computes the step transfer by transfer (a plain list that the tests check
against the emulation), with the work that lands on the output device (device 0 by default);
``draw_dataparallel`` draws it with matplotlib. The pictures of DDP are in
:mod:`course_utils.ddp.diagrams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._checks import check_positive_int
from .splits import split_sizes

__all__ = ["Transfer", "dataparallel_steps", "draw_dataparallel"]


# ------------------------------------------------------------------------------ DataParallel

@dataclass(frozen=True)
class Transfer:
    """One arrow of a DataParallel step: ``what`` goes from device ``src`` to ``dst``
    (``rows``: how many rows of the batch, for the chunks)."""

    step: str
    src: int
    dst: int
    what: str
    rows: int = 0


def dataparallel_steps(batch_size: int, devices: int, output_device: int = 0) -> list[Transfer]:
    """The transfers of one ``nn.DataParallel`` training step, in order (notebooks 02-04).

    The batch starts on ``device_ids[0]`` and is cut with ``torch.chunk``; the module is copied
    from device 0 to the others; outputs are gathered on ``output_device``, where the loss runs;
    the loss's gradient is scattered back; the replicas' gradients are summed into device 0's
    parameters. A transfer from a device to itself is a view, and is not listed.
    """
    batch_size = check_positive_int("batch_size", batch_size)
    devices = check_positive_int("devices", devices)
    if not (isinstance(output_device, int) and 0 <= output_device < devices):
        raise ValueError(f"output_device must be an int in [0, {devices}), got {output_device!r}")
    rows = split_sizes(batch_size, devices)
    used = range(len(rows))
    moves = [Transfer("scatter inputs", 0, d, "input chunk", rows[d]) for d in used if d != 0]
    moves += [Transfer("replicate", 0, d, "parameters") for d in used if d != 0]
    moves += [Transfer("gather outputs", d, output_device, "output chunk", rows[d])
              for d in used if d != output_device]
    moves += [Transfer("scatter output grads", output_device, d, "output-grad chunk", rows[d])
              for d in used if d != output_device]
    moves += [Transfer("reduce grads", d, 0, "parameter grads") for d in used if d != 0]
    return moves


def draw_dataparallel(batch_size: int = 30, devices: int = 4, output_device: int = 0, ax: Any = None):
    """Draw ``dataparallel_steps``: one column per device, one row per step; returns the figure."""
    import matplotlib.pyplot as plt

    moves = dataparallel_steps(batch_size, devices, output_device)
    steps = list(dict.fromkeys(m.step for m in moves)) or ["scatter inputs"]
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 * devices + 2.5, 1.0 * len(steps) + 1.6))
    for row, step in enumerate(steps):
        y = -row * 1.2
        ax.text(-0.7, y - 0.25, step, ha="right", va="center", fontsize=9)
        for k, m in enumerate(m for m in moves if m.step == step):
            level = y - 0.2 * k
            color = "tab:red" if 0 in (m.src, m.dst) and output_device in (m.src, m.dst) else "tab:blue"
            ax.annotate("", xy=(m.dst, level), xytext=(m.src, level),
                        arrowprops={"arrowstyle": "->", "color": color, "lw": 1.2})
            label = f"{m.rows} rows" if m.rows else m.what
            ax.text(max(m.src, m.dst) + 0.08, level, label, fontsize=7, va="center", ha="left")
    loads = [sum(1 for m in moves if d in (m.src, m.dst)) for d in range(devices)]
    for d in range(devices):
        ax.text(d, 0.9, f"device {d}\n{loads[d]} transfers", ha="center", fontsize=9,
                bbox={"boxstyle": "round", "fc": "mistyrose" if d in (0, output_device) else "aliceblue"})
    ax.text(output_device, -1.2 * len(steps) + 0.3, "the loss runs here", ha="center", fontsize=8,
            color="tab:red")
    ax.set_xlim(-2.8, devices - 0.2)
    ax.set_ylim(-1.2 * len(steps), 1.4)
    ax.axis("off")
    ax.set_title(f"One nn.DataParallel step, batch {batch_size} on {devices} devices: "
                 f"every transfer starts or ends on device 0 or the output device", fontsize=10)
    return ax.figure
