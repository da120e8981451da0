"""Every all-reduce a rank runs and every wait on it, watched where they happen: in the methods of
the rank's ``ProcessGroup`` and of the handles and futures it returns (notebook 06's judges).

A judge that counts the all-reduces an answer called by name is fooled by an alias, a wrapper or
a blocking call; :func:`all_reduces_watched` sees every one, whatever name reached it, and every
way of waiting for it (``wait()``, a wait on a future, ``torch.futures.wait_all``, polling
``is_completed()`` until it is true). A blocking all-reduce waits inside the call, so it counts as
waited for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["all_reduces_watched"]


class Watched(list):
    """The records of :func:`all_reduces_watched`, and ``others``: the names of the other collectives
    the block ran on a process group (a barrier, a broadcast...), in order."""

    others: list[str]


@contextlib.contextmanager
def all_reduces_watched(clock: Any = None) -> Iterator[Watched]:
    """On a rank: one record per all-reduce the block runs on a process group (``allreduce`` and
    ``allreduce_coalesced``), whatever name the code called it by: ``numel`` (the elements handed
    in), ``ptrs`` (where they are), ``sent`` (a copy of their values, flattened, when the all-reduce
    started), ``work`` (the handle the group returned), ``waited`` (how many times the block waited
    for it, updated as the block goes on), ``average`` (whether it was asked for the mean,
    ``ReduceOp.AVG``, rather than the sum), ``after`` (a copy of the tensors' values the moment the
    backend finished, from a callback the watcher chains first to the all-reduce's future: if
    nothing else wrote them while it ran, the sum, or the mean, of what the ranks sent), ``touched``
    (whether, at the block's first wait for a finished all-reduce, the tensors held something else
    than when it finished, not counting what callbacks chained to it wrote: a write, by any means,
    between the end of the all-reduce and the wait, which on a slower machine would land while it
    runs) and ``at`` (what ``clock()`` returned when it started, if a clock is given).

    Every way of waiting counts: ``wait()`` on the handle (a blocking all-reduce calls it itself),
    ``wait()`` on one of its futures (``get_future()``, or a future chained to one with ``then()``),
    on the future ``torch.futures.wait_all`` or ``collect_all`` makes of them, and ``is_completed()``
    or ``done()`` once they answer True (polling until the all-reduce is over is waiting for it)."""
    import torch.distributed as dist

    records = Watched()
    records.others = []
    by_work: dict[int, dict] = {}
    by_future: dict[int, list[dict]] = {}
    kept: list[Any] = []  # the futures seen, kept alive so that their ids stay their own
    group_class = dist.ProcessGroup
    future_class = torch._C.Future
    held: dict[tuple[Any, str], Any] = {}  # what each patched class or module held, put back afterwards

    def patch(owner: Any, name: str, make: Any) -> None:
        original = getattr(owner, name, None)
        if original is None:  # not in this release
            return
        held[owner, name] = owner.__dict__.get(name)
        setattr(owner, name, make(original))

    def values(record: dict) -> torch.Tensor:
        return torch.cat([t.detach().flatten() for t in record["tensors"]]).clone()

    def waited(found: list[dict] | None) -> None:
        for record in found or ():
            record["waited"] += 1

    def completed(found: list[dict] | None) -> None:
        """A wait returned, or a poll said done: the block has not gone on yet. The values the
        all-reduce left (if its callback has not taken them), and, the first time, whether the
        tensors changed since it finished, other than by a callback chained to it."""
        for record in found or ():
            if record["after"] is None:
                record["after"] = record["baseline"] = values(record)
            if not record["checked"]:
                record["checked"] = True
                record["touched"] |= not torch.equal(values(record), record["baseline"])

    def on_done(record: dict) -> Any:
        def call(future: Any) -> Any:
            current = values(record)
            if record["after"] is None:  # the block may already have gone on: then its wait took them
                record["after"] = record["baseline"] = current
            return future.value()
        return call

    def on_futures(futures: list[Any], found: list[dict]) -> None:
        for future in futures:
            kept.append(future)
            by_future.setdefault(id(future), []).extend(found)

    def watch_work_class(cls: type) -> None:
        """Patch the methods of the handles of class ``cls`` (the class a release's backend returns)."""
        def wait(original: Any) -> Any:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                if id(self) in by_work:
                    waited([by_work[id(self)]])
                result = original(self, *args, **kwargs)
                completed([by_work[id(self)]] if id(self) in by_work else None)
                return result
            return call
        patch(cls, "wait", wait)

        def is_completed(original: Any) -> Any:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                done = original(self, *args, **kwargs)
                if done and id(self) in by_work:
                    waited([by_work[id(self)]])
                    completed([by_work[id(self)]])
                return done
            return call
        patch(cls, "is_completed", is_completed)

        def get_future(original: Any) -> Any:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                future = original(self, *args, **kwargs)
                if id(self) in by_work:
                    on_futures([future], [by_work[id(self)]])
                return future
            return call
        patch(cls, "get_future", get_future)

    def future_wait(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            waited(by_future.get(id(self)))
            result = original(self, *args, **kwargs)
            completed(by_future.get(id(self)))
            return result
        return call

    def future_done(original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            done = original(self, *args, **kwargs)
            if done:
                waited(by_future.get(id(self)))
                completed(by_future.get(id(self)))
            return done
        return call

    def future_then(original: Any) -> Any:
        def call(self: Any, callback: Any, *args: Any, **kwargs: Any) -> Any:
            found = by_future.get(id(self))
            if found:  # a callback chained to an all-reduce runs once it is over: its writes are no race
                def after_callback(future: Any, callback: Any = callback) -> Any:
                    # The watcher's own callback, chained first, may not have run yet: one chained
                    # after the all-reduce finished runs at once, in this thread (measured: 1 in 60)
                    for record in found:
                        if record["after"] is None:
                            record["after"] = record["baseline"] = values(record)
                    result = callback(future)
                    for record in found:
                        record["baseline"] = values(record)
                    return result
                chained = original(self, after_callback, *args, **kwargs)
                on_futures([chained], found)
                return chained
            return original(self, callback, *args, **kwargs)
        return call

    def collect_all(original: Any) -> Any:
        def call(futures: Any, *args: Any, **kwargs: Any) -> Any:
            collected = original(futures, *args, **kwargs)
            found = [r for f in futures for r in by_future.get(id(f), [])]
            if found:
                on_futures([collected], found)
            return collected
        return call

    def allreduce(original: Any) -> Any:
        def call(self: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
            handed = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
            sent = torch.cat([t.detach().flatten() for t in handed]).clone() if handed else torch.zeros(0)
            options = args[0] if args else kwargs.get("opts")
            average = getattr(options, "reduceOp", None) == dist.ReduceOp.AVG
            work = original(self, tensors, *args, **kwargs)
            record = {"numel": sum(t.numel() for t in handed), "ptrs": [t.data_ptr() for t in handed],
                      "sent": sent, "work": work, "waited": 0,  # the record keeps the handle: its id stays
                      "tensors": handed, "touched": False, "average": average, "after": None,
                      "baseline": None, "checked": False, "at": clock() if clock else None}
            records.append(record)
            by_work[id(work)] = record
            then(work.get_future(), on_done(record))  # first of its callbacks: the values as it ends
            if (type(work), "wait") not in held:
                watch_work_class(type(work))
            return work
        return call

    def other(original: Any, name: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            records.others.append(name)
            return original(self, *args, **kwargs)
        return call

    then = future_class.then  # the original, for the watcher's own callbacks
    try:
        patch(group_class, "allreduce", allreduce)
        patch(group_class, "allreduce_coalesced", allreduce)
        for name in ("barrier", "broadcast", "allgather", "_allgather_base", "reduce_scatter",
                     "_reduce_scatter_base", "reduce", "gather", "scatter", "alltoall_base", "send", "recv"):
            patch(group_class, name, lambda original, name=name: other(original, name))
        patch(future_class, "wait", future_wait)
        patch(future_class, "done", future_done)
        patch(future_class, "then", future_then)
        patch(torch._C, "_collect_all", collect_all)
        yield records
    finally:
        for (owner, name), descriptor in held.items():
            if descriptor is None:
                delattr(owner, name)
            else:
                setattr(owner, name, descriptor)
