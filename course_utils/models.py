"""The tutorial's model, and other small models the course trains (notebooks 01 and 02)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from ._checks import check_positive_int

__all__ = ["BertLike", "ImageClassifier", "Model", "SequenceGRU", "SmallCNN", "seeded"]

M = TypeVar("M", bound=nn.Module)


def seeded(seed: int, build: Callable[[], M]) -> M:
    """``build()`` with its initial weights drawn from ``seed`` (notebook 05): every process that
    calls it with the same seed gets the same model. The caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class Model(nn.Module):
    """The tutorial's model: one ``nn.Linear`` that reports the sizes it sees from ``forward``.

    Under ``nn.DataParallel`` every replica runs this ``forward`` on its own chunk of the batch,
    so the report shows how the batch was split. ``report`` receives each line; it is ``print``
    by default, as in the tutorial, and can be a list's ``append`` to collect the lines instead,
    or ``None`` to stay quiet.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        report: Callable[[str], object] | None = print,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(check_positive_int("input_size", input_size),
                            check_positive_int("output_size", output_size))
        if report is not None and not callable(report):
            raise TypeError(f"report must be callable or None, got {type(report).__name__}")
        self.report = report

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the tutorial's name
        output = self.fc(input)
        if self.report is not None:
            self.report(f"\tIn Model: input size {input.size()} output size {output.size()}")
        return output


class SmallCNN(nn.Module):
    """A two-convolution image classifier for 1x16x16 inputs (notebook 03's equivalence tests)."""

    def __init__(self, num_classes: int = 4, *, batch_norm: bool = False) -> None:
        super().__init__()
        num_classes = check_positive_int("num_classes", num_classes)
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8) if batch_norm else nn.Identity(),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class SequenceGRU(nn.Module):
    """A sequence-first GRU: input ``(time, batch, features)``, as the Korean article's RNN note assumes.

    Returns ``(outputs, h_n)``: ``outputs`` is ``(time, batch, hidden)`` and ``h_n`` is
    ``(layers, batch, hidden)``. The batch is dimension 1 of both, so ``DataParallel`` needs
    ``dim=1``.
    """

    def __init__(self, input_size: int = 6, hidden_size: int = 8, num_layers: int = 1) -> None:
        super().__init__()
        self.gru = nn.GRU(check_positive_int("input_size", input_size),
                          check_positive_int("hidden_size", hidden_size),
                          num_layers=check_positive_int("num_layers", num_layers))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(x)


class BertLike(nn.Module):
    """A BERT-style encoder with a vocabulary-sized output head (notebook 04's memory ledger).

    Token and learned position embeddings, a LayerNorm, ``layers`` post-norm
    ``nn.TransformerEncoderLayer`` blocks (GELU, ``intermediate`` hidden units), and an untied
    ``Linear(hidden, vocab)`` head: input ``(batch, seq)`` token ids, output
    ``(batch, seq, vocab)`` logits. With the defaults of ``BertLike.base()`` it has about 132 M
    parameters (BERT-base has 110 M; it ties its head to the embedding).
    """

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, intermediate: int,
                 max_len: int, dropout: float = 0.1) -> None:
        super().__init__()
        for name, value in (("vocab", vocab), ("hidden", hidden), ("layers", layers),
                            ("heads", heads), ("intermediate", intermediate), ("max_len", max_len)):
            check_positive_int(name, value)
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        self.max_len = max_len
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(max_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden, heads, intermediate, dropout,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, vocab)

    @staticmethod
    def count_parameters(vocab: int, hidden: int, layers: int, intermediate: int,
                         max_len: int) -> int:
        """The exact parameter count, without building the model."""
        per_layer = (3 * hidden * hidden + 3 * hidden      # attention in-projection
                     + hidden * hidden + hidden            # attention out-projection
                     + intermediate * hidden + intermediate  # feed-forward 1
                     + hidden * intermediate + hidden      # feed-forward 2
                     + 4 * hidden)                         # two LayerNorms
        return (vocab * hidden + max_len * hidden + 2 * hidden
                + layers * per_layer + hidden * vocab + vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] > self.max_len:
            raise ValueError(f"expected token ids of shape (batch, seq <= {self.max_len}), "
                             f"got {tuple(ids.shape)}")
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.norm(self.tokens(ids) + self.positions(positions)))
        return self.head(self.encoder(x))


class ImageClassifier(nn.Module):
    """A VGG-style image classifier: four conv stages (64 to 512 channels), 1000 classes.

    The contrast to ``BertLike`` in notebook 04: its activations are large and its outputs tiny
    (1000 logits per image), so gathering the outputs on one device costs almost nothing.
    """

    def __init__(self, num_classes: int = 1000, widths: tuple[int, ...] = (64, 128, 256, 512)) -> None:
        super().__init__()
        num_classes = check_positive_int("num_classes", num_classes)
        layers: list[nn.Module] = []
        channels = 3
        if isinstance(widths, (str, bytes)) or not hasattr(widths, "__len__") or not widths:
            raise ValueError(f"widths must be a non-empty tuple of channel counts, got {widths!r}")
        for width in widths:
            check_positive_int("width", width)
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                       nn.ReLU(), nn.Conv2d(width, width, 3, padding=1, bias=False),
                       nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))
