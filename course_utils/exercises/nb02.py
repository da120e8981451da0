"""Judges of the exercises of notebook 02 (``nn.DataParallel``: how a batch is split);
their content is in nb02.toml."""

from __future__ import annotations

from typing import Any

from ..dataparallel.splits import epoch_splits, split_sizes
from .core import calls_recorded, load_bank

__all__ = ["CASES", "EXERCISES"]

#: 02.2's (batch, devices): even splits, remainders, batches smaller than the device count, one device
_SPLITS = [(30, 2), (30, 4), (30, 8), (10, 8), (13, 4), (9, 4), (3, 8), (1, 1), (64, 16), (7, 7), (17, 5)]

CASES: dict[str, list[str]] = {
    "02.1": ["a batch of 13 rows on 4 devices"],
    "02.2": [f"batch={batch}, devices={devices}" for batch, devices in _SPLITS],
    "02.3": ["a batch of 18 rows on 8 devices"],
}


def _even_split(batch: int, devices: int) -> list[int]:
    """What ``torch.tensor_split`` gives: the rows spread as evenly as possible."""
    return [batch // devices + (1 if i < batch % devices else 0) for i in range(devices)]


def _whole(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and float(value).is_integer()


def _judge_chunks_of_13(answer: Any) -> str | None:
    if not isinstance(answer, (list, tuple)) or not all(_whole(v) for v in answer):
        return f"write a list of whole numbers, one per device that gets rows, not {answer!r}"
    answer = [int(v) for v in answer]
    right = split_sizes(13, 4)
    if answer == right:
        return None
    if sum(answer) != 13:
        return f"your chunks add up to {sum(answer)} rows, but the batch has 13: every row goes somewhere"
    if len(answer) > 4:
        return "there are only 4 devices: at most 4 chunks"
    if answer == _even_split(13, 4):
        return ("you spread the rows as evenly as possible (that is torch.tensor_split); DataParallel "
                "scatters with torch.chunk, which cuts equal pieces first and leaves the rest to the last")
    if sorted(answer) == sorted(right):
        return ("the sizes are right but not their order: the chunks go to the devices in order, "
                "the short one last")
    if answer[:-1] == [13 // 4] * 3:
        return ("your pieces are 13 // 4 rows, with the rest added to the last: torch.chunk rounds "
                "the size of its pieces the other way")
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
        if isinstance(got, (list, tuple)) and list(got) == want:
            continue
        if not isinstance(got, (list, tuple)):
            return f"chunk_sizes({batch}, {devices}) returned {type(got).__name__}; return a list of ints"
        got = list(got)
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
    if not _whole(answer):
        return f"write a whole number of devices (0 to 8), not {answer!r}"
    right = len(split_sizes(18, 8))
    if answer == right:
        return None
    if answer == 8:
        return ("chunk does not promise every device a piece: work out how many rows each piece gets "
                "first, then count the pieces")
    if answer > 8:
        return "there are only 8 devices"
    if answer < 1:
        return "18 rows must go somewhere: at least one device works"
    return "work out the size of the pieces torch.chunk cuts from 18 rows, then count how many cover them"


EXERCISES = load_bank(__name__)
