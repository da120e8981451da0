"""Judges of the exercises of notebook 02 (``nn.DataParallel``: how a batch is split);
their content is in nb02.toml."""

from __future__ import annotations

from typing import Any

from ..dataparallel.splits import epoch_splits, split_sizes
from .answers import reals
from .core import calls_recorded, load_bank

__all__ = ["CASES", "EXERCISES"]

#: 02.2's (batch, devices): even splits, remainders, batches smaller than the device count, one device
_SPLITS = [(30, 2), (30, 4), (30, 8), (10, 8), (13, 4), (9, 4), (3, 8), (1, 1), (64, 16), (7, 7), (17, 5)]

#: 02.1's device counts for a batch of 13: on 4 a rule that hands every device a piece (the last one
#: the rest) agrees with torch.chunk; on 6 the pieces run out first
_CHUNK_DEVICES = (4, 6)
#: 02.3's batches on 8 devices: at 18, counting only the full pieces agrees; at 19 it does not
_BUSY_BATCHES = (18, 19)

CASES: dict[str, list[str]] = {
    "02.1": [f"a batch of 13 rows on {n} devices" for n in _CHUNK_DEVICES],
    "02.2": [f"batch={batch}, devices={devices}" for batch, devices in _SPLITS],
    "02.3": [f"a batch of {b} rows on 8 devices" for b in _BUSY_BATCHES],
}


def _even_split(batch: int, devices: int) -> list[int]:
    """What ``torch.tensor_split`` gives: the rows spread as evenly as possible."""
    return [batch // devices + (1 if i < batch % devices else 0) for i in range(devices)]


def _wholes(value: Any) -> list[int] | None:
    """``value`` as a list of whole numbers (however each is written), else None."""
    numbers = reals(value) if not isinstance(value, (str, bytes)) else None
    if numbers is None or any(not n.is_integer() for n in numbers):
        return None
    return [int(n) for n in numbers]


def _judge_chunks_of_13(answer: Any) -> str | None:
    what = "(the rows each device gets on 4 devices, on 6 devices)"
    if not (isinstance(answer, (list, tuple)) and len(answer) == len(_CHUNK_DEVICES)):
        return f"write a pair of lists {what}, one list for each device count"
    for devices, chunks in zip(_CHUNK_DEVICES, answer, strict=True):
        got = _wholes(chunks)
        if got is None:
            return (f"for {devices} devices write a list of whole numbers, one per device that gets rows, "
                    f"not a {type(chunks).__name__}")
        hint = _chunks_hint(got, devices)
        if hint:
            return hint
    return None


def _chunks_hint(answer: list[int], devices: int) -> str | None:
    right = split_sizes(13, devices)
    if answer == right:
        return None
    if min(answer, default=0) < 0:
        return (f"on {devices} devices you gave a device fewer than no rows: with torch.chunk's piece "
                "size the rows can run out before the devices do")
    if sum(answer) != 13:
        return (f"on {devices} devices your chunks add up to {sum(answer)} rows, but the batch has 13: "
                "every row goes somewhere")
    if len(answer) > devices:
        return f"there are only {devices} devices: at most {devices} chunks"
    if answer == _even_split(13, devices):
        return ("you spread the rows as evenly as possible (that is torch.tensor_split); DataParallel "
                "scatters with torch.chunk, which cuts equal pieces first and leaves the rest to the last")
    if answer == right + [0] * (len(answer) - len(right)):
        return (f"on {devices} devices: a device that gets no rows gets no chunk and no replica: list only "
                "the devices that get rows")
    if sorted(answer) == sorted(right):
        return ("the sizes are right but not their order: the chunks go to the devices in order, "
                "the short one last")
    if answer[:-1] == [13 // devices] * (devices - 1):
        return (f"on {devices} devices your pieces are 13 // {devices} rows, with the rest added to the "
                "last: torch.chunk rounds the size of its pieces the other way")
    if len(answer) == devices and len(right) < devices:
        return (f"on {devices} devices you gave every device a piece, but with torch.chunk's piece size "
                "the rows run out before the devices do")
    return ("re-read the split rule above: how big is each piece torch.chunk cuts, and what is left "
            "for the last?")


def _shortcuts() -> tuple[set, set]:
    """What the exercise asks to do without, as it runs: the course's rule (Python functions, by
    their code) and the tensor functions that apply it (built-ins, by name)."""
    codes = {split_sizes.__code__, epoch_splits.__code__}
    try:
        import numpy

        codes.add(numpy.array_split.__code__)
    except (ImportError, AttributeError):
        pass
    return codes, {"chunk", "tensor_split"}


def _judge_split_sizes(answer: Any) -> str | None:
    codes, builtins = _shortcuts()
    for batch, devices in _SPLITS:
        with calls_recorded() as ran:
            got = answer(batch, devices)
        used = sorted({c.co_name for c in ran & codes} | (ran & builtins))
        if used:
            return (f"chunk_sizes ran {used[0]} (whatever name it was reached by), which applies the rule "
                    "for you: the exercise asks for the rule itself, worked out from batch and devices")
        want = split_sizes(batch, devices)
        numbers = _wholes(got)
        if numbers == want:
            continue
        if numbers is None:
            return (f"chunk_sizes({batch}, {devices}) returned {type(got).__name__}; return a list of whole "
                    "numbers")
        got = numbers
        if got == _even_split(batch, devices):
            return (f"chunk_sizes({batch}, {devices}) spreads the rows evenly, as torch.tensor_split "
                    f"does; torch.chunk cuts equal pieces first and leaves the rest to the last")
        if sum(got) != batch:
            return (f"chunk_sizes({batch}, {devices}) gives {got}, which adds up to {sum(got)}, not "
                    f"{batch}: the remainder must go somewhere")
        if len(got) == devices and len(want) < devices:
            return (f"chunk_sizes({batch}, {devices}) gives one chunk per device, but with torch.chunk's "
                    f"piece size the batch runs out before the devices do")
        return (f"chunk_sizes({batch}, {devices}) gives {got}; compare with "
                f"[len(c) for c in torch.arange({batch}).chunk({devices})]")
    return None


def _judge_busy_devices(answer: Any) -> str | None:
    counts = _wholes(answer)
    if counts is None or len(counts) != len(_BUSY_BATCHES):
        return (f"write a pair of whole numbers (devices with rows from a batch of {_BUSY_BATCHES[0]}, from "
                f"a batch of {_BUSY_BATCHES[1]}), each 0 to 8, not a {type(answer).__name__}")
    for batch, count in zip(_BUSY_BATCHES, counts, strict=True):
        hint = _busy_hint(batch, count)
        if hint:
            return hint
    return None


def _busy_hint(batch: int, answer: int) -> str | None:
    right, piece = len(split_sizes(batch, 8)), -(-batch // 8)
    if answer == right:
        return None
    if answer == 8:
        return (f"with {batch} rows: chunk does not promise every device a piece: work out how many rows "
                "each piece gets first, then count the pieces")
    if answer > 8:
        return "there are only 8 devices"
    if answer < 1:
        return f"{batch} rows must go somewhere: at least one device works"
    if answer == batch // piece:
        return (f"with {batch} rows you counted the full pieces only: the rows left over after them make "
                "one more, shorter piece, on a device of its own")
    return (f"work out the size of the pieces torch.chunk cuts from {batch} rows, then count how many "
            "cover them")


EXERCISES = load_bank(__name__)
