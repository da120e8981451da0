"""The judge of notebook 00's warm-up exercise (a guess that notebook 02 explains); its content is in
nb00.toml."""

from __future__ import annotations

from typing import Any

from ..dataparallel.splits import split_sizes
from .answers import reals
from .core import load_bank

__all__ = ["CASES", "EXERCISES"]

#: the two batches (rows) the guess is about, on _GPUS GPUs: with 10 rows, "half the rows" and
#: "the rows over whole pieces" give the right count too; with 25 they do not
_BATCHES, _GPUS = (10, 25), 8

CASES: dict[str, list[str]] = {"00.1": [f"a batch of {rows} rows on {_GPUS} GPUs" for rows in _BATCHES]}


def _judge_busy_gpus(answer: Any) -> str | None:
    what = f"(GPUs with work for a batch of {_BATCHES[0]}, for a batch of {_BATCHES[1]})"
    if isinstance(answer, (str, bytes)) or reals(answer) is None:
        return (f"write a pair of numbers of GPUs {what}: two numbers (ints, floats, fractions; 0-d "
                "tensors are fine), not text or True/False")
    counts = reals(answer)
    if len(counts) != len(_BATCHES):
        return f"write a pair, one count per batch: {what}"
    if any(not c.is_integer() for c in counts):
        return "a GPU either gets rows or it does not: write whole numbers"
    for rows, guess in zip(_BATCHES, counts, strict=True):
        hint = _busy_hint(rows, int(guess))
        if hint:
            return hint
    return None


def _busy_hint(rows: int, guess: int) -> str | None:
    right = len(split_sizes(rows, _GPUS))
    piece = -(-rows // _GPUS)
    if guess == right:
        return None
    if guess > _GPUS:
        return f"there are only {_GPUS} GPUs"
    if guess < 1:
        return f"{rows} rows must go somewhere: at least one GPU works"
    if guess == 1:
        return "DataParallel does split the batch: with several GPUs, more than one of them gets rows"
    if guess == _GPUS:
        return (f"with {rows} rows: DataParallel does not promise every GPU a piece: it settles how many "
                "rows each piece holds (the same for all, rounded up), then hands out pieces until the "
                "rows run out")
    if guess == piece:
        return "that is how many rows go in a piece; the question asks how many pieces, one per busy GPU"
    if guess == rows // piece:
        return (f"with {rows} rows you counted the full pieces only: the rows left over after them make "
                "one more, shorter piece, and it needs a GPU too")
    return (f"with {rows} rows: work out how many rows go in a piece (the same for all, rounded up), then "
            "how many pieces the batch fills")


EXERCISES = load_bank(__name__)
