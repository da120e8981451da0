"""The judge of notebook 00's warm-up exercise (a guess that notebook 02 explains); its content is in
nb00.toml."""

from __future__ import annotations

from typing import Any

from ..dataparallel.splits import split_sizes
from .core import load_bank

__all__ = ["CASES", "EXERCISES"]

_ROWS, _GPUS = 10, 8

CASES: dict[str, list[str]] = {"00.1": [f"a batch of {_ROWS} rows on {_GPUS} GPUs"]}


def _judge_busy_gpus(answer: Any) -> str | None:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"write a number of GPUs (0 to {_GPUS}), not {type(answer).__name__}"
    if answer != int(answer):
        return "a GPU either gets rows or it does not: write a whole number"
    if answer == len(split_sizes(_ROWS, _GPUS)):
        return None
    if answer > _GPUS:
        return f"there are only {_GPUS} GPUs"
    if answer < 1:
        return f"{_ROWS} rows must go somewhere: at least one GPU works"
    if answer == 1:
        return "DataParallel does split the batch: with several GPUs, more than one of them gets rows"
    if answer == _GPUS:
        return ("DataParallel does not promise every GPU a piece: it settles how many rows each piece "
                "holds (the same for all, rounded up), then hands out pieces until the rows run out")
    if answer == -(-_ROWS // _GPUS):
        return "that is how many rows go in a piece; the question asks how many pieces, one per busy GPU"
    return ("work out how many rows go in a piece (the same for all, rounded up), then how many pieces "
            "the batch fills")


EXERCISES = load_bank(__name__)
