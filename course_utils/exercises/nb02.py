"""Judges of the exercises of notebook 02 (``nn.DataParallel``: how a batch is split);
their content is in nb02.toml."""

from __future__ import annotations

from typing import Any

from ..splits import split_sizes
from .core import load_bank

__all__ = ["EXERCISES"]


def _even_split(batch: int, devices: int) -> list[int]:
    """What ``torch.tensor_split`` gives: the rows spread as evenly as possible."""
    return [batch // devices + (1 if i < batch % devices else 0) for i in range(devices)]


def _judge_chunks_of_13(answer: Any) -> str | None:
    if not isinstance(answer, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in answer):
        return f"write a list of whole numbers, one per device that gets rows, not {answer!r}"
    answer = list(answer)
    if answer == split_sizes(13, 4):
        return None
    if sum(answer) != 13:
        return f"your chunks add up to {sum(answer)} rows, but the batch has 13: every row goes somewhere"
    if answer == _even_split(13, 4):
        return ("you spread the rows as evenly as possible (that is torch.tensor_split); DataParallel "
                "scatters with torch.chunk, which cuts equal pieces first and leaves the rest to the last")
    if sorted(answer) == sorted(split_sizes(13, 4)):
        return ("the sizes are right but not their order: the chunks go to the devices in order, "
                "the short one last")
    if len(answer) > 4:
        return "there are only 4 devices: at most 4 chunks"
    return "torch.chunk cuts pieces of ceil(batch / devices) rows; the last piece gets what is left"


def _judge_busy_devices(answer: Any) -> str | None:
    if not isinstance(answer, int) or isinstance(answer, bool):
        return f"write a whole number of devices (0 to 8), not {type(answer).__name__}"
    right = len(split_sizes(18, 8))
    if answer == right:
        return None
    if answer == 8:
        return ("chunk does not promise every device a piece: work out the size of each piece first "
                "(ceil of the batch over the devices), then count how many such pieces 18 rows make")
    if answer > 8:
        return "there are only 8 devices"
    return "each piece has ceil(18 / 8) rows; count how many pieces it takes to cover 18 rows"


def _judge_split_sizes(answer: Any) -> str | None:
    for batch, devices in [(30, 2), (30, 4), (30, 8), (10, 8), (13, 4), (9, 4), (3, 8), (1, 1), (64, 16)]:
        got = answer(batch, devices)
        want = split_sizes(batch, devices)
        if got == want:
            continue
        if not isinstance(got, list):
            return f"chunk_sizes({batch}, {devices}) returned {type(got).__name__}; return a list of ints"
        if got == _even_split(batch, devices):
            return (f"chunk_sizes({batch}, {devices}) spreads the rows evenly, as torch.tensor_split "
                    f"does; torch.chunk cuts pieces of ceil(batch / devices) rows instead")
        if sum(got) != batch:
            return (f"chunk_sizes({batch}, {devices}) gives {got}, which adds up to {sum(got)}, not "
                    f"{batch}: the remainder must go somewhere")
        if len(got) == devices and len(want) < devices:
            return (f"chunk_sizes({batch}, {devices}) gives one chunk per device, but with pieces of "
                    f"ceil(batch / devices) rows the batch runs out before the devices do")
        return (f"chunk_sizes({batch}, {devices}) gives {got}; compare with "
                f"[len(c) for c in torch.arange({batch}).chunk({devices})]")
    return None


EXERCISES = load_bank(__name__)
