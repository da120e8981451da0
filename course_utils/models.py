"""The tutorial's model, and other small models the course trains (notebooks 01 and 02)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._checks import check_positive_int

__all__ = ["Model"]


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
