"""The tutorial's model, and other small models the course trains (notebooks 01 and 02)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._checks import check_positive_int

__all__ = ["Model", "SequenceGRU", "SmallCNN"]


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
    """A sequence-first GRU: input ``(time, batch, features)``, as seed 002's RNN note assumes.

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
