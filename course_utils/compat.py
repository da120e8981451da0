"""What differs between the PyTorch releases the course runs on, in one place.

The course pins torch 2.13 (what nbval checks) and runs on Colab's release too (2.11 in 2026);
``make compat`` proves both (``compat_check.TESTED_RELEASES``). Every call whose name or behaviour
changed between those releases goes through here, so that a lesson module never asks which
release it is on.

- ``reduce_scatter_single`` / ``all_gather_single``: the collectives on one flat tensor (notebook
  10). Torch 2.13 named them so; every earlier release calls them ``reduce_scatter_tensor`` and
  ``all_gather_into_tensor``, names that 2.13 still accepts with a ``FutureWarning``.
- ``dump_flight_recorder``: this process's Flight Recorder buffer (notebook 12). Torch 2.13 dumps
  it with ``torch._C._distributed_c10d._dump_fr_trace`` only; 2.11 has that name and the older
  ``_dump_nccl_trace``. On a CPU build both record gloo's collectives (measured). 2.11's CUDA build
  keeps NCCL's apart: with torch 2.11+cu130 on an H100, a one-rank NCCL group's all-reduce was in
  ``_dump_nccl_trace``'s buffer and not in ``_dump_fr_trace``'s (measured), so under NCCL the
  dump asks ``_dump_nccl_trace`` first.
- ``analyzer_reads_gloo``: torch's Flight Recorder analyzer (``torch.distributed.flight_recorder``)
  reads gloo's entries in 2.13; 2.11's stops at them ("gloo != 'nccl' or 'xccl'").

And what differs on Windows, whose torch builds lack libuv, which a ``TCPStore`` uses by default
("use_libuv was requested but PyTorch was built without libuv support"):

- ``tcp_store_options``: what every ``TCPStore`` the course makes is given (``use_libuv=False`` on
  Windows). ``env://`` and ``tcp://`` need nothing: torch's own rendezvous already leaves libuv
  out on Windows (``USE_LIBUV=0`` is its default there).
- ``run_torchrun_without_libuv``: torchrun's agent, with its rendezvous stores made without
  libuv. torchrun offers no option for those stores (``USE_LIBUV=0`` reaches other stores only),
  so ``course_utils.faults.torchrun`` runs the agent through this on Windows.

What ``torch.cuda`` does before CUDA starts is private to it, and the course reaches into it in one
place, here:

- ``pending_gpu_generators`` / ``restore_gpu_generators``: ``env.random_state_kept`` keeps what
  CUDA will do to the GPU generators when it starts. Until then ``torch.manual_seed`` (which seeds
  every GPU too, even on a machine without one) and ``torch.cuda``'s seeding calls are queued: the
  latest seed of each kind in a tracker, other calls in a list, the same in 2.11, 2.13 and 2.14.
  Where a release keeps them otherwise, nothing is kept or put back.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVE_NAMES", "FLIGHT_RECORDER_DUMPS", "all_gather_single", "analyzer_reads_gloo",
           "collective_name", "dump_flight_recorder", "flight_recorder_dump_name", "pending_gpu_generators",
           "queue_backward_callback", "reduce_scatter_single", "restore_gpu_generators",
           "run_torchrun_without_libuv", "stores_without_libuv", "tcp_store_options", "torch_release"]

#: The flat-tensor collectives: torch 2.13's name, and the name every earlier release uses.
COLLECTIVE_NAMES = {"reduce_scatter_single": "reduce_scatter_tensor",
                    "all_gather_single": "all_gather_into_tensor"}

#: The functions that return the Flight Recorder's buffer, the current name first: 2.13's CPU build
#: has only the first, 2.11's both. In 2.11's CUDA build the second dumps NCCL's own buffer (above).
FLIGHT_RECORDER_DUMPS = ("_dump_fr_trace", "_dump_nccl_trace")


def torch_release() -> tuple[int, int]:
    """The running torch's (major, minor), e.g. ``(2, 13)`` for ``2.13.0+cpu``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def collective_name(name: str) -> str:
    """The name under which this torch offers the flat-tensor collective ``name`` (2.13's name)."""
    if name not in COLLECTIVE_NAMES:
        raise ValueError(f"name must be one of {sorted(COLLECTIVE_NAMES)}, got {name!r}")
    return name if hasattr(dist, name) else COLLECTIVE_NAMES[name]


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:  # noqa: A002
    """Sum ``input`` (N equal slices) over the ranks; this rank's slice lands in ``output``."""
    return getattr(dist, collective_name("reduce_scatter_single"))(output, input, **kwargs)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:  # noqa: A002
    """Every rank's ``input``, in rank order, concatenated into ``output`` (N times its size)."""
    return getattr(dist, collective_name("all_gather_single"))(output, input, **kwargs)


def queue_backward_callback(fn: Any) -> None:
    """Run ``fn()`` once the backward pass now running has finished (what DDP's reducer does when
    its last bucket is ready). Autograd's engine has no public name for it: FSDP and DDP's Python
    reducer call the same private method, present in every release the course supports."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def flight_recorder_dump_name(backend: str | None = None) -> str | None:
    """The name of this torch's function that dumps the Flight Recorder, or ``None`` (notebook 12).

    Under NCCL (``backend="nccl"``), ``_dump_nccl_trace`` where the release has it: 2.11's CUDA
    build keeps NCCL's collectives in a buffer of its own, apart from gloo's (measured; see the
    module's text). Releases not measured on a GPU are asked the same way.
    """
    c10d = getattr(torch._C, "_distributed_c10d", None)  # absent from builds without distributed
    names = ("_dump_nccl_trace", *FLIGHT_RECORDER_DUMPS) if backend == "nccl" else FLIGHT_RECORDER_DUMPS
    return next((name for name in names if hasattr(c10d, name)), None)


def dump_flight_recorder(*, collectives: bool = True, stacks: bool = True) -> dict | None:
    """This process's Flight Recorder buffer, unpickled; ``None`` where this torch cannot dump it.

    The buffer keeps the last ``TORCH_FR_BUFFER_SIZE`` collectives (2000 by default), each with its
    group, sequence number, operation, sizes, dtypes, state and (with ``stacks``) Python stack,
    and ``pg_status``: per group, the last collective enqueued and the last completed. The buffer
    is the one of the default group's backend (:func:`flight_recorder_dump_name`).
    """
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    name = flight_recorder_dump_name(backend)
    if name is None:
        return None
    dump = getattr(torch._C._distributed_c10d, name)
    return pickle.loads(dump(includeCollectives=collectives, includeStackTraces=stacks, onlyActive=False))


def analyzer_reads_gloo() -> bool:
    """Whether torch's Flight Recorder analyzer accepts gloo's entries (2.13's does, 2.11's does not).

    Asked of the analyzer itself: its ``Op`` checks an entry's backend before anything else.
    """
    from torch.distributed.flight_recorder.components.types import Op

    try:
        Op({"profiling_name": "gloo:all_reduce"}, {}, "")
    except AssertionError as err:
        return "gloo" not in str(err)  # 2.11: "name formatting error? gloo != 'nccl' or 'xccl'"
    except Exception:  # noqa: BLE001 - past the backend check: the probe lacks the other fields
        return True
    return True


def tcp_store_options() -> dict[str, Any]:
    """What a ``TCPStore`` needs on this system: ``{"use_libuv": False}`` on Windows (its torch
    builds lack libuv, the default), nothing elsewhere."""
    return {"use_libuv": False} if sys.platform == "win32" else {}


#: The modules of torchrun's rendezvous that make a ``TCPStore`` without asking about libuv.
_RENDEZVOUS_STORES = ("torch.distributed", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
                      "torch.distributed.elastic.rendezvous.static_tcp_rendezvous")


def stores_without_libuv() -> None:
    """From now on, every ``TCPStore`` this process makes through torch's modules leaves libuv out
    unless asked for it (for torchrun's agent on Windows; see :func:`run_torchrun_without_libuv`)."""
    import importlib

    base = dist.TCPStore
    if getattr(base, "course_without_libuv", False):
        return

    class TCPStore(base):  # type: ignore[misc, valid-type]
        """``torch.distributed.TCPStore`` whose ``use_libuv`` defaults to False."""

        course_without_libuv = True

        def __init__(self, *args: Any, use_libuv: bool = False, **kwargs: Any) -> None:
            super().__init__(*args, use_libuv=use_libuv, **kwargs)

    for name in _RENDEZVOUS_STORES:
        module = importlib.import_module(name)
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = TCPStore


def run_torchrun_without_libuv() -> None:
    """torchrun (``python -m torch.distributed.run``) with the arguments of this process, its
    rendezvous stores made without libuv: the agent that Windows' torch builds can run."""
    stores_without_libuv()
    from torch.distributed.run import main

    main()


#: the tracker's attributes: the latest seed of all GPUs, that of the current one, and their order
_LAZY_SEEDS = ("manual_seed_all_cb", "manual_seed_cb", "call_order")


def pending_gpu_generators() -> tuple | None:
    """The tracker, what it holds now, and the queued calls now (call before CUDA starts)."""
    tracker = getattr(torch.cuda, "_lazy_seed_tracker", None)
    calls = getattr(torch.cuda, "_queued_calls", None)
    if not isinstance(calls, list) or not all(hasattr(tracker, name) for name in _LAZY_SEEDS):
        return None
    tracked = [tracker.manual_seed_all_cb, tracker.manual_seed_cb, list(tracker.call_order)]
    return tracker, tracked, list(calls)


def _queued_generator_call(entry: tuple) -> bool:
    return getattr(entry[0], "__module__", None) == "torch.cuda.random"  # a seed or a state, queued


def restore_gpu_generators(tracker: Any, tracked: list, calls: list) -> None:
    """Back to what :func:`pending_gpu_generators` saw. If CUDA has not started, what was queued
    since is taken back. If it started since, it applied what was queued then: every GPU's generator
    starts again from the seed CUDA gives a new generator (a new CPU generator's seed too), then what
    was queued before runs again, in the order CUDA runs it (the queued calls, then the tracker's)."""
    if not torch.cuda.is_initialized():
        for name, value in zip(_LAZY_SEEDS, tracked, strict=True):
            setattr(tracker, name, value)
        before = {id(entry) for entry in calls}
        torch.cuda._queued_calls[:] = [entry for entry in torch.cuda._queued_calls
                                       if id(entry) in before or not _queued_generator_call(entry)]
        return
    torch.cuda.manual_seed_all(torch.Generator().initial_seed())
    for entry in [entry for entry in calls if _queued_generator_call(entry)] + [c for c in tracked[2] if c]:
        entry[0]()
