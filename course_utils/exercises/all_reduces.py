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
    for it, updated as the block goes on), ``after`` (a copy of the tensors' values the first time
    the block found the all-reduce complete: if nothing but the backend wrote them, the sum over the
    ranks of what each sent), ``touched`` (whether autograd's version counter of one of its tensors
    moved between the start and the first wait: an in-place write, a division say, while the backend
    could still be reading or writing it; the backend's own writes do not move it) and ``at`` (what
    ``clock()`` returned when it started, if a clock is given).

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

    def waited(found: list[dict] | None) -> None:
        for record in found or ():
            if not record["waited"]:  # the first wait: was a tensor written while the all-reduce ran?
                record["touched"] = any(t._version != v for t, v in zip(record["tensors"], record["versions"],
                                                                         strict=True))
            record["waited"] += 1

    def completed(found: list[dict] | None) -> None:
        for record in found or ():
            if record["after"] is None:
                record["after"] = torch.cat([t.detach().flatten() for t in record["tensors"]]).clone()

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
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            chained = original(self, *args, **kwargs)
            if id(self) in by_future:
                on_futures([chained], by_future[id(self)])
            return chained
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
            work = original(self, tensors, *args, **kwargs)
            record = {"numel": sum(t.numel() for t in handed), "ptrs": [t.data_ptr() for t in handed],
                      "sent": sent, "work": work, "waited": 0,  # the record keeps the handle: its id stays
                      "tensors": handed, "versions": [t._version for t in handed], "touched": False,
                      "after": None, "at": clock() if clock else None}
            records.append(record)
            by_work[id(work)] = record
            if (type(work), "wait") not in held:
                watch_work_class(type(work))
            return work
        return call

    def other(original: Any, name: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            records.others.append(name)
            return original(self, *args, **kwargs)
        return call

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
