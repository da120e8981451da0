"""When things happen on a rank during a step of DDP by hand (notebook 06): :class:`Timeline`, a
list of :class:`Event`, which the versions of :mod:`course_utils.ddp.by_hand` mark and the notebook
draws."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

__all__ = ["Event", "Timeline"]


class Event(NamedTuple):
    """One moment on a rank's timeline: ``what`` happened to bucket ``index`` at ``t`` seconds."""

    what: str  # backward_start, backward_end, all_reduce_start, all_reduce_done, wait_start, wait_end
    index: int | None
    t: float  # time.perf_counter(): one clock for every process of this machine


class Timeline:
    """The events of one rank, in the order they happened (with ``record=False``, none are kept).

    The training loop marks ``backward_start`` and, for the versions that do not, ``backward_end``
    (``DDPByHand`` marks it itself once autograd has computed every gradient); the versions mark,
    per all-reduce, when it was started, when the backend finished it (``all_reduce_done``: on gloo
    the moment its thread is done; on NCCL, when the work was queued on the GPU's stream, not when
    the GPU ended it) and when it was waited for (``wait_start``, ``wait_end``: by ``DDPByHand``
    as the backward pass ends).
    """

    def __init__(self, record: bool = True) -> None:
        self.record = record
        self.events: list[Event] = []

    def mark(self, what: str, index: int | None = None) -> None:
        if self.record:
            self.events.append(Event(what, index, time.perf_counter()))

    def started(self, handle: Any, index: int) -> None:
        """An asynchronous all-reduce of bucket ``index`` was just started: mark it, and mark it
        done when the backend completes it."""
        self.mark("all_reduce_start", index)
        if self.record:
            handle.get_future().then(lambda _: self.mark("all_reduce_done", index))
