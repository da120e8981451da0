"""What collectives a rank ran, seen at torch's dispatcher, and the bytes a ring sends for them (the
judges of notebook 10): every route to a collective ends there before the backend, the functional
collectives too (``torch.distributed._functional_collectives``, DTensor's), which never reach the
process group's Python methods."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["collectives_dispatched", "ring_bytes_sent"]


def _nbytes(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0) or 0)


#: the collectives as torch's dispatcher sees them, by the op's name without its namespace: c10d's
#: ops (which every ``torch.distributed`` function and every ``ProcessGroup`` method ends in) and
#: the functional collectives' (``torch.distributed._functional_collectives``, DTensor's), which never
#: reach the group's Python methods; for each, its kind and the position of the argument that
#: holds what this rank hands in
_DISPATCHED = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0), "all_reduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0), "reduce_": ("reduce", 0),
    "send": ("send", 0),
    "allgather_": ("all_gather", 1), "_allgather_base_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1), "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0), "all_gather_into_tensor_out": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_": ("reduce_scatter", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_": ("all_to_all", 1), "alltoall_base_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0),
    "gather_": ("gather", 1), "scatter_": ("scatter", 1),
    "barrier": ("barrier", None), "monitored_barrier_": ("barrier", None),
}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


@contextlib.contextmanager
def collectives_dispatched() -> Iterator[list[tuple[str, int]]]:
    """On a rank: ``(kind, bytes handed in)`` of every collective the block runs in this thread,
    seen where every route to one ends before the backend, torch's dispatcher (a
    ``TorchDispatchMode``): ``dist.all_reduce`` and any name or alias of it, the group's own
    methods, ``compat``'s, and the functional collectives, which :func:`collectives_called` misses.
    A collective nested in another (an autograd wrapper's) is seen once, as the outer one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[str, int]] = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            namespace, name = getattr(func, "namespace", ""), func.__name__.split(".")[0]
            if namespace in _COLLECTIVE_NAMESPACES and name in _DISPATCHED:
                kind, position = _DISPATCHED[name]
                handed = args[position] if position is not None and len(args) > position else None
                calls.append((kind, _nbytes(handed)))
            return func(*args, **(kwargs or {}))

    with Seen():
        yield calls


def ring_bytes_sent(calls: list[tuple[str, int]], world_size: int) -> float:
    """The bytes one rank sends for ``calls`` (from :func:`collectives_dispatched` or
    :func:`collectives_called`) in the ring model of notebook 10: an all-reduce of B bytes
    ``2B(N-1)/N``; a reduce-scatter, an all-to-all or a broadcast of B bytes ``B(N-1)/N`` (a
    broadcast on average over the ranks); an all-gather of a b-byte shard ``(N-1)b``; a barrier
    nothing; anything else its bytes."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "broadcast": (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_to_all": (n - 1) / n, "all_gather": n - 1, "barrier": 0}
    return sum(factors.get(kind, 1) * size for kind, size in calls)
