"""Small synthetic data sets; nothing is downloaded (notebooks 01 and 02)."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ._checks import check_int, check_number, check_positive_int

__all__ = ["RandomDataset", "SlowDataset", "make_loader", "regression_dataset"]


class RandomDataset(Dataset):
    """The tutorial's data set: ``length`` random vectors of ``size`` features.

    Unlike the tutorial's, it draws from its own generator seeded with ``seed``, so a notebook
    prints the same numbers on every run without touching the global random state.
    """

    def __init__(self, size: int, length: int, *, seed: int = 0) -> None:
        self.size = check_positive_int("size", size)
        self.len = check_positive_int("length", length)
        generator = torch.Generator().manual_seed(check_int("seed", seed))
        self.data = torch.randn(self.len, self.size, generator=generator)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len

    def __repr__(self) -> str:
        return f"RandomDataset(size={self.size}, length={self.len})"


def make_loader(
    dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, **kwargs
) -> DataLoader:
    """A ``DataLoader`` whose shuffling is seeded: the same batches in the same order every run."""
    batch_size = check_positive_int("batch_size", batch_size)
    generator = torch.Generator().manual_seed(check_int("seed", seed))
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator,
                      **kwargs)


def regression_dataset(
    n_samples: int, input_size: int, output_size: int, *, noise: float = 0.1, seed: int = 0
) -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """``y = x @ W.T + b + noise``: a data set whose true ``W`` and ``b`` are known.

    Returns ``(dataset, W, b)`` so that a notebook can compare what training learned with the
    truth.
    """
    n_samples = check_positive_int("n_samples", n_samples)
    input_size = check_positive_int("input_size", input_size)
    output_size = check_positive_int("output_size", output_size)
    check_number("noise", noise, at_least=0)
    g = torch.Generator().manual_seed(check_int("seed", seed))
    weight = torch.randn(output_size, input_size, generator=g)
    bias = torch.randn(output_size, generator=g)
    x = torch.randn(n_samples, input_size, generator=g)
    y = x @ weight.T + bias + noise * torch.randn(n_samples, output_size, generator=g)
    return TensorDataset(x, y), weight, bias


class SlowDataset(Dataset):
    """Samples that take real time to produce, like images read from disk and decoded (notebook 11).

    ``work="io"`` waits ``seconds`` per sample (the CPU is free meanwhile, as when reading a
    file); ``work="cpu"`` spends ``seconds`` of CPU time (as when decoding a JPEG), so workers
    that share a core take longer.
    """

    def __init__(self, length: int, seconds: float, *, work: str = "io", size: int = 16) -> None:
        self.len = check_positive_int("length", length)
        check_number("seconds", seconds, at_least=0)
        if work not in ("io", "cpu"):
            raise ValueError(f"work must be 'io' or 'cpu', got {work!r}")
        self.seconds, self.work, self.size = float(seconds), work, check_positive_int("size", size)

    def __len__(self) -> int:
        return self.len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.len:
            raise IndexError(f"index {index} is out of range for {self.len} samples")
        if self.work == "io":
            time.sleep(self.seconds)
        else:
            end = time.process_time() + self.seconds  # CPU time: a shared core does not count
            while time.process_time() < end:
                pass
        return torch.full((self.size,), float(index))
