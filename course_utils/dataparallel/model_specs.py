"""What a model holds and saves for backward, per sample: the ``ModelSpec`` that notebook 04's
memory ledger (``memory.ledger``) and notebook 10's sharded one read, counted for small models and
measured with autograd's saved-tensor hooks (:func:`saved_tensor_bytes`) for a BERT-like encoder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._checks import check_number, check_positive_int

__all__ = ["ModelSpec", "saved_tensor_bytes"]


def saved_tensor_bytes(fn: Callable[[], object], exclude: Sequence[torch.Tensor] = ()) -> tuple[int, int]:
    """Bytes that autograd saves for backward while ``fn()`` runs: ``(floating, other)``.

    Each storage counts once; storages of ``exclude`` (parameters, the inputs) do not count.
    ``other``: integer and boolean tensors (indices, dropout masks), whatever the float dtype.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a function of no arguments that runs the forward pass, "
                        f"got {type(fn).__name__}")
    if not all(isinstance(t, torch.Tensor) for t in exclude):
        raise TypeError("exclude must be a sequence of tensors")
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = (t.untyped_storage().nbytes(), t.is_floating_point())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    floating = sum(n for n, is_float in seen.values() if is_float)
    return floating, sum(n for n, is_float in seen.values() if not is_float)


@dataclass(frozen=True)
class ModelSpec:
    """What the ledger needs to know about a model, per sample, in fp32 terms: saved-for-backward
    floats and bytes of non-float tensors (``activation_*``), elements of ``inputs``/``outputs``/
    ``targets``, and floats the loss saves for backward (``loss_saved_floats``)."""

    name: str
    parameters: int
    activation_floats: float
    activation_other_bytes: float
    inputs: int
    input_itemsize: int
    outputs: int
    targets: int
    target_itemsize: int
    loss_saved_floats: int
    notes: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        for field_name in ("parameters", "inputs", "outputs", "targets", "loss_saved_floats"):
            check_positive_int(field_name, getattr(self, field_name), minimum=0)
        for field_name in ("input_itemsize", "target_itemsize"):
            check_positive_int(field_name, getattr(self, field_name))
        for field_name in ("activation_floats", "activation_other_bytes"):
            check_number(field_name, getattr(self, field_name), at_least=0)

    @classmethod
    def linear(cls, input_size: int = 5, output_size: int = 2) -> ModelSpec:
        """The tutorial's ``nn.Linear`` with an MSE loss: it saves only its input for backward."""
        input_size = check_positive_int("input_size", input_size)
        output_size = check_positive_int("output_size", output_size)
        return cls(name=f"Linear({input_size}, {output_size})",
                   parameters=input_size * output_size + output_size,
                   activation_floats=0, activation_other_bytes=0,  # its saved input IS the input
                   inputs=input_size, input_itemsize=4, outputs=output_size,
                   targets=output_size, target_itemsize=4, loss_saved_floats=0,
                   notes="MSE loss")

    @classmethod
    def from_module(cls, name: str, module: nn.Module, example: torch.Tensor,
                    target: torch.Tensor, loss_fn: Callable, notes: str = "") -> ModelSpec:
        """Measure a model: its parameters, and what a forward and the loss save per sample.

        ``example`` and ``target``: a small batch (two rows or more), measured in fp32, train mode.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        rows = example.shape[0]
        if rows < 1 or target.shape[0] != rows:
            raise ValueError("example and target must hold the same number of rows (>= 1)")
        module.train()
        params = list(module.parameters()) + list(module.buffers())
        holder: dict[str, torch.Tensor] = {}

        def forward() -> None:
            holder["out"] = module(example)

        act_float, act_other = saved_tensor_bytes(forward, exclude=params + [example])
        out = holder["out"]
        loss_float, _ = saved_tensor_bytes(lambda: loss_fn(out, target), exclude=[out, target])
        return cls(name=name, parameters=sum(p.numel() for p in module.parameters()),
                   activation_floats=act_float / 4 / rows, activation_other_bytes=act_other / rows,
                   inputs=example[0].numel(), input_itemsize=example.element_size(),
                   outputs=out[0].numel(), targets=target[0].numel(),
                   target_itemsize=target.element_size(), loss_saved_floats=loss_float // 4 // rows,
                   notes=notes)

    @classmethod
    def bert_like(cls, *, vocab: int = 30522, hidden: int = 768, layers: int = 12, heads: int = 12,
                  intermediate: int = 3072, seq_len: int = 128, dropout: float = 0.1) -> ModelSpec:
        """A BERT-base-like encoder with an untied vocabulary head, trained with cross-entropy.

        Parameters counted exactly; activations measured on ``BertLike`` modules with one and two
        layers (and a small vocabulary), then extrapolated: every encoder layer saves the same.
        """
        from ..models import BertLike

        for arg, value in (("vocab", vocab), ("hidden", hidden), ("layers", layers),
                           ("heads", heads), ("intermediate", intermediate), ("seq_len", seq_len)):
            check_positive_int(arg, value)
        state = torch.random.get_rng_state()
        torch.manual_seed(0)
        small_vocab = min(vocab, 64)
        ids = torch.randint(0, small_vocab, (2, seq_len))
        measured = []
        for n in (1, 2):
            model = BertLike(small_vocab, hidden, n, heads, intermediate, seq_len, dropout)
            params = list(model.parameters())
            measured.append(saved_tensor_bytes(lambda m=model: m(ids), exclude=params + [ids]))
        torch.random.set_rng_state(state)
        per_layer = [b - a for a, b in zip(measured[0], measured[1], strict=True)]
        base = [a - p for a, p in zip(measured[0], per_layer, strict=True)]
        act_float = (base[0] + layers * per_layer[0]) / 2
        act_other = (base[1] + layers * per_layer[1]) / 2
        return cls(
            name=f"BERT-like (hidden {hidden}, {layers} layers, vocab {vocab}, seq {seq_len})",
            parameters=BertLike.count_parameters(vocab, hidden, layers, intermediate, seq_len),
            activation_floats=act_float / 4, activation_other_bytes=act_other,
            inputs=seq_len, input_itemsize=8, outputs=seq_len * vocab, targets=seq_len,
            target_itemsize=8, loss_saved_floats=seq_len * vocab,
            notes="cross-entropy over the vocabulary at every position")
