"""Where the bytes go on each device: a memory ledger for four strategies (notebook 04; the
sharded strategies of notebook 10 are in ``sharding.sharded_ledger``).

``ledger(spec, strategy, batch_size=..., num_devices=...)`` counts, per device, the bytes held
at the start of backward, when the activations, the outputs and the loss's saved tensors all
coexist with the model state, with the gradients counted whole although ``zero_grad()`` has set
them to None and backward creates them as it frees the activations: the totals overstate the
true peak (by up to the gradients' bytes), the differences between devices hold:

============== ==================================================================================
parameters      the model (DataParallel: the original on device 0, a replica on every device)
gradients       ``.grad`` on device 0; DataParallel replicas' until summed there; DDP: on every rank
optimizer state Adam's two moments (``optimizer="adam"``), SGD momentum's one, plain SGD none
DDP buckets     DDP's flat gradient buckets: a second copy (``gradient_as_bucket_view=False``)
activations     tensors saved for backward, for the rows this device processes
inputs          the batch: DataParallel's device 0 holds all of it (its chunk is a view)
outputs         DataParallel: gathered on ``output_device``; otherwise each device's own rows
output gradient the gradient of the loss with respect to the outputs, where the outputs are
targets         the labels, where the loss is computed
loss            what the loss saves for backward (log-probabilities for cross-entropy)
============== ==================================================================================

Strategies: ``"dp"`` (``nn.DataParallel``), ``"parallel_criterion"`` (each device computes its
part of the loss), ``"ddp"``. Replica outputs freed after ``gather`` and the transients of
backward are not counted: :func:`live_bytes_by_op` measures those (cross-entropy's backward holds
four logits-sized tensors at once, one more than the ledger's outputs, output gradient and loss).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._checks import check_int, check_positive_int
from .model_specs import ModelSpec, saved_tensor_bytes
from .splits import split_sizes

__all__ = ["CATEGORIES", "STRATEGIES", "Ledger", "ModelSpec", "cuda_peak_bytes", "ledger",
           "live_bytes_by_op", "plot_ledgers", "saved_tensor_bytes"]

CATEGORIES = ("parameters", "gradients", "optimizer state", "DDP buckets", "activations",
              "inputs", "outputs", "output gradient", "targets", "loss")
STRATEGIES = ("dp", "parallel_criterion", "ddp")
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}


@dataclass
class Ledger:
    """Bytes per device and category for one strategy (``ledger`` builds it)."""

    spec: ModelSpec
    strategy: str
    batch_size: int
    output_device: int
    rows_per_device: list[int]
    rows: list[dict[str, int]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return {"dp": f"DataParallel, output_device={self.output_device}",
                "parallel_criterion": "parallel criterion", "ddp": "DDP"}[self.strategy]

    def total(self, device: int) -> int:
        return sum(self.rows[device].values())

    def difference(self, a: int = 0, b: int = 1) -> dict[str, int]:
        """Per category, how many more bytes device ``a`` holds than device ``b``."""
        return {c: self.rows[a][c] - self.rows[b][c] for c in CATEGORIES}

    def table(self, unit: float = 2**20, unit_name: str = "MiB") -> str:
        """The ledger as text: one column per device, one row per category, then the totals."""
        head = f"{'':16}" + "".join(f"{'device ' + str(d):>12}" for d in range(len(self.rows)))
        lines = [f"{self.label}: {self.spec.name}, batch {self.batch_size}", head]
        for c in CATEGORIES:
            values = [r[c] for r in self.rows]
            if any(values):
                lines.append(f"{c:16}" + "".join(f"{v / unit:12.1f}" for v in values))
        lines.append(f"{'total ' + unit_name:16}"
                     + "".join(f"{self.total(d) / unit:12.1f}" for d in range(len(self.rows))))
        return "\n".join(lines)


def ledger(spec: ModelSpec, strategy: str, *, batch_size: int, num_devices: int,
           dtype: torch.dtype = torch.float32, optimizer: str = "adam",
           output_device: int = 0) -> Ledger:
    """Model the bytes on every device for one training step of ``spec`` under ``strategy``."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    batch_size = check_positive_int("batch_size", batch_size)
    num_devices = check_positive_int("num_devices", num_devices)
    output_device = check_int("output_device", output_device)
    if not 0 <= output_device < num_devices:
        raise ValueError(f"output_device must be in 0..{num_devices - 1}, got {output_device}")
    if strategy != "dp" and output_device != 0:
        raise ValueError("output_device applies to strategy='dp' only")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZER_STATES)}, got {optimizer!r}")
    if strategy == "ddp" and batch_size % num_devices:
        raise ValueError(f"DDP splits the global batch evenly: batch_size={batch_size} is not a "
                         f"multiple of num_devices={num_devices}")

    s = torch.tensor([], dtype=dtype).element_size()
    rows_on = (sizes := split_sizes(batch_size, num_devices)) + [0] * (num_devices - len(sizes))
    P = spec.parameters * s
    states = _OPTIMIZER_STATES[optimizer] * P

    def activations(r: int) -> int:
        return round(r * (spec.activation_floats * s + spec.activation_other_bytes))

    rows: list[dict[str, int]] = []
    for d, r in enumerate(rows_on):
        row = dict.fromkeys(CATEGORIES, 0)
        row["activations"] = activations(r)
        if strategy == "ddp":
            row.update({"parameters": P, "gradients": P, "optimizer state": states,
                        "DDP buckets": P})
            row["inputs"] = r * spec.inputs * spec.input_itemsize
            row["outputs"] = row["output gradient"] = r * spec.outputs * s
            row["targets"] = r * spec.targets * spec.target_itemsize
            row["loss"] = r * spec.loss_saved_floats * s + s
        else:
            # DataParallel's model: the original (with .grad and the optimizer) on device 0, and
            # a replica whose gradients are summed onto device 0, on every device with rows
            has_replica = d == 0 or r > 0
            row["parameters"] = P if has_replica else 0
            row["gradients"] = P if has_replica else 0
            row["optimizer state"] = states if d == 0 else 0
            row["inputs"] = (batch_size if d == 0 else r) * spec.inputs * spec.input_itemsize
            if strategy == "dp":
                on_loss_device = d == output_device
                outputs = batch_size * spec.outputs * s
                row["outputs"] = row["output gradient"] = outputs if on_loss_device else 0
                row["targets"] = batch_size * spec.targets * spec.target_itemsize if on_loss_device else 0
                row["loss"] = (batch_size * spec.loss_saved_floats * s + s) if on_loss_device else 0
            else:  # parallel criterion: outputs stay put; targets scattered from device 0
                row["outputs"] = row["output gradient"] = r * spec.outputs * s
                row["targets"] = (batch_size if d == 0 else r) * spec.targets * spec.target_itemsize
                row["loss"] = r * spec.loss_saved_floats * s + (s if r else 0) + (s if d == 0 else 0)
        rows.append(row)
    return Ledger(spec, strategy, batch_size, output_device, rows_on, rows)


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage an operation creates, for as long as a tensor holds it."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()
        self.skip, self.live, self.steps = skip, {}, []

    def _release(self, key: int) -> None:
        self.live[key][1] -= 1
        if not self.live[key][1]:
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (key := t.untyped_storage().data_ptr()) not in self.skip:
                self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])[1] += 1
                weakref.finalize(t, self._release, key)
        self.steps.append((func.overloadpacket.__name__, sum(n for n, _ in self.live.values())))
        return out


def live_bytes_by_op(fn: Callable[[], object], exclude: Sequence[torch.Tensor] = ()) -> list[tuple[str, int]]:
    """Run ``fn()`` (a forward and its backward) and return, after each operation it ran, the
    operation's name and the bytes of the tensors that operations created and that are still
    alive: the transient peak of a step, which the ledger does not count. Storages of ``exclude``
    (parameters, inputs) do not count; views count their storage once."""
    if not callable(fn):
        raise TypeError(f"fn must be a function of no arguments, got {type(fn).__name__}")
    mode = _LiveBytes({t.untyped_storage().data_ptr() for t in exclude})
    with mode:
        fn()
    return mode.steps


def plot_ledgers(ledgers: Sequence[Ledger], *, unit: float = 2**30, unit_name: str = "GiB",
                 axes=None):
    """Stacked bars per device, one panel per ledger, the categories in the same colours."""
    import matplotlib.pyplot as plt

    if not ledgers:
        raise ValueError("ledgers is empty")
    if axes is None:
        _, axes = plt.subplots(1, len(ledgers), figsize=(3.6 * len(ledgers), 3.8), sharey=True,
                               squeeze=False)
        axes = axes[0]
    colors = dict(zip(CATEGORIES, plt.get_cmap("tab10").colors, strict=False))
    for ax, led in zip(axes, ledgers, strict=True):
        n = len(led.rows)
        bottom = [0.0] * n
        for c in CATEGORIES:
            values = [row[c] / unit for row in led.rows]
            if any(values):
                ax.bar(range(n), values, bottom=bottom, color=colors[c], label=c)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(range(n), [str(d) for d in range(n)])  # "dev 0dev 1..." ran together at 8
        ax.set_xlabel("device")
        ax.set_title(led.label, fontsize=10)
        ax.set_ylabel(unit_name)
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    order = [c for c in CATEGORIES if c in handles]
    axes[-1].legend([handles[c] for c in order], order, bbox_to_anchor=(1.02, 1), loc="upper left",
                    fontsize=8)
    return axes


def _bert_step_inputs(config: dict, batch_size: int, device: torch.device):
    from ..models import BertLike

    torch.manual_seed(0)
    model = BertLike(**config).to(device)
    ids = torch.randint(0, config["vocab"], (batch_size, config["max_len"]), device=device)
    return model, ids, ids.clone()


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _ddp_peak_rank(rank: int, world_size: int, config: dict, per_rank_batch: int) -> int:
    """One rank of ``cuda_peak_bytes(strategy="ddp")``: the peak of its second training step."""
    from ..devices import rank_device, wrap_ddp

    device = rank_device()  # cuda:LOCAL_RANK: cuda_peak_bytes launches it with NCCL
    model, ids, targets = _bert_step_inputs(config, per_rank_batch, device)
    ddp_model = wrap_ddp(model, device)
    optimizer = torch.optim.Adam(ddp_model.parameters())
    on_gpu = device.type == "cuda"
    for step in range(2):
        if step == 1 and on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        loss = _token_loss(ddp_model(ids), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    peak = torch.cuda.max_memory_allocated(device) if on_gpu else 0  # nothing to measure on a CPU
    del ddp_model, model, optimizer, loss
    return peak


def cuda_peak_bytes(strategy: str, config: dict, *, batch_size: int, num_devices: int,
                    output_device: int = 0) -> list[int]:
    """``torch.cuda.max_memory_allocated`` per GPU in the second step of a training run.

    A ``BertLike(**config)`` with Adam and token-level cross-entropy under ``strategy`` on GPUs
    ``0..num_devices-1``; the first step creates the optimizer state, the second is measured.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    num_devices = check_positive_int("num_devices", num_devices)
    if not torch.cuda.is_available() or torch.cuda.device_count() < num_devices:
        raise RuntimeError(f"cuda_peak_bytes needs {num_devices} GPUs; this machine has "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    if strategy == "ddp":
        from ..distributed import launch

        return launch(_ddp_peak_rank, num_devices, config, batch_size // num_devices,
                      backend="nccl", echo=False)
    from .parallel_criterion import DataParallelCriterion, DataParallelModel

    devices = list(range(num_devices))
    model, ids, targets = _bert_step_inputs(config, batch_size, torch.device("cuda", 0))
    if strategy == "dp":
        wrapped = nn.DataParallel(model, device_ids=devices, output_device=output_device)
        criterion = _token_loss
    else:
        wrapped = DataParallelModel(model, devices)
        criterion = DataParallelCriterion(_token_loss, devices, reduction="mean")
    optimizer = torch.optim.Adam(model.parameters())
    for step in range(2):
        if step == 1:
            for d in devices:
                torch.cuda.reset_peak_memory_stats(d)
        out = wrapped(ids)
        loss = criterion(out, targets.to(output_device) if strategy == "dp" else targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        del out, loss
    peaks = [torch.cuda.max_memory_allocated(d) for d in devices]
    del wrapped, model, optimizer
    torch.cuda.empty_cache()
    return peaks
