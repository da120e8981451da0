"""Exercises of notebook 10: the fix of every failure in the zoo, each checked (ranks run under
``launch`` with a short timeout, so a wrong answer that hangs comes back as a hint)."""

from __future__ import annotations

from typing import Any

from .core import Exercise
from .nb10_training import ACCUMULATION, CLEAN_KEYS, JOIN, NO_GRAD, run_ranks

__all__ = ["EXERCISES"]

# ----------------------------------------------------------------------------- 10.1 set_epoch

def _judge_set_epoch(epoch_orders: Any) -> str | None:
    from torch.utils.data.distributed import DistributedSampler

    def fresh() -> DistributedSampler:
        return DistributedSampler(range(12), num_replicas=2, rank=0, shuffle=True, seed=0)

    expected = []
    reference = fresh()
    for epoch in range(3):
        reference.set_epoch(epoch)
        expected.append(list(reference))
    got = [list(order) for order in epoch_orders(fresh(), 3)]
    if got == expected:
        return None
    if len(got) == 3 and got[0] == got[1] == got[2]:
        return ("every epoch reads the same order: the sampler reshuffles only when it is told "
                "which epoch this is, a different number each epoch")
    if len(got) == 3 and got[0] == got[1]:
        return "epochs 0 and 1 read the same order: tell the sampler the epoch before reading it"
    return f"the orders differ from the sampler's own shuffles: {got}"


SET_EPOCH = Exercise(
    key="10.1", kind="fix", title="a new shuffle every epoch", answer="epoch_orders",
    starter='''\
def epoch_orders(sampler, epochs):
    orders = {}
    for epoch in range(epochs):
        orders[epoch] = list(sampler)  # the indices this rank reads in this epoch
    return list(orders.values())
''',
    solution='''\
def epoch_orders(sampler, epochs):
    orders = {}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # before the epoch is read
        orders[epoch] = list(sampler)
    return list(orders.values())
''',
    judge=_judge_set_epoch,
    wrong=(('''\
def epoch_orders(sampler, epochs):
    orders = {}
    for epoch in range(epochs):
        sampler.set_epoch(0)
        orders[epoch] = list(sampler)
    return list(orders.values())
''', "every epoch reads the same order"), ('''\
def epoch_orders(sampler, epochs):
    orders = {}
    for epoch in range(epochs):
        orders[epoch] = list(sampler)
        sampler.set_epoch(epoch)
    return list(orders.values())
''', "before reading it")),
)


# ----------------------------------------------------------------------------- 10.2 evaluation

def _judge_evaluation(evaluate_and_report: Any) -> str | None:
    results, hint = run_ranks(evaluate_and_report, 2)
    if hint:
        return hint + ". Evaluation that all-reduces is a collective: every rank must run it"
    if results[0] is None or abs(results[0] - 0.6) > 1e-6:
        return f"rank 0 should return the accuracy over the whole set (it returned {results[0]!r})"
    return None


EVALUATION = Exercise(
    key="10.2", kind="fix", title="evaluate on every rank, report on rank 0", answer="evaluate_and_report",
    context="from course_utils.debugging import evaluate_everywhere\n",
    starter='''\
def evaluate_and_report(rank, world_size):
    accuracy = None
    if rank == 0:  # "only rank 0 needs the number"
        accuracy = evaluate_everywhere(rank, world_size)
    return accuracy
''',
    solution='''\
def evaluate_and_report(rank, world_size):
    accuracy = evaluate_everywhere(rank, world_size)  # a collective: every rank takes part
    return accuracy if rank == 0 else None  # only reporting is rank 0's
''',
    judge=_judge_evaluation,
    wrong=(('''\
import torch.distributed as dist

def evaluate_and_report(rank, world_size):
    dist.barrier()  # wait for everyone first
    accuracy = None
    if rank == 0:
        accuracy = evaluate_everywhere(rank, world_size)
    return accuracy
''', "every rank must run it"), ('''\
def evaluate_and_report(rank, world_size):
    accuracy = evaluate_everywhere(rank, world_size)
    return accuracy if rank == 1 else None
''', "rank 0 should return the accuracy")),
)


# ----------------------------------------------------------------------------- 10.3 exact shards

def _judge_shards(shard: Any) -> str | None:
    for n in (10, 7, 12, 3, 1):
        for world_size in (1, 2, 3, 4):
            shards = [list(shard(n, rank, world_size)) for rank in range(world_size)]
            flat = [i for s in shards for i in s]
            twice = sorted({i for i in flat if flat.count(i) > 1})
            if twice:
                return (f"with {n} rows on {world_size} ranks, rows {twice} are evaluated by more "
                        f"than one rank: padding counts them twice in the metric")
            missing = sorted(set(range(n)) - set(flat))
            if missing:
                return (f"with {n} rows on {world_size} ranks, rows {missing} are never evaluated: "
                        f"the remainder must go somewhere")
            if sorted(flat) != list(range(n)):
                return f"with {n} rows the shards hold indices outside 0..{n - 1}: {sorted(flat)}"
    return None


SHARDS = Exercise(
    key="10.3", kind="implement", title="shards without padding", answer="shard",
    starter='''\
def shard(n, rank, world_size):
    """The indices of the n validation rows that this rank evaluates: each row on exactly one rank."""
    raise NotImplementedError
''',
    solution='''\
def shard(n, rank, world_size):
    """The indices of the n validation rows that this rank evaluates: each row on exactly one rank."""
    return list(range(rank, n, world_size))  # round robin, no padding: shards differ by one at most
''',
    judge=_judge_shards,
    wrong=(('''\
from torch.utils.data.distributed import DistributedSampler

def shard(n, rank, world_size):
    return list(DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=False))
''', "evaluated by more than one rank"), ('''\
def shard(n, rank, world_size):
    per_rank = n // world_size
    return list(range(rank * per_rank, (rank + 1) * per_rank))
''', "never evaluated")),
)


# ----------------------------------------------------------------------------- 10.4 order

def _judge_order(sync_step: Any) -> str | None:
    results, hint = run_ranks(sync_step, 2)
    if hint:
        return hint + ". Make every rank call the same collectives in the same order"
    for grads, flag in results:
        if list(grads) != [2.0] * 4:
            return f"the gradients should be summed over the ranks (all_reduce); a rank got {grads}"
        if flag != 0.0:
            return f"the flag should be rank 0's (broadcast from rank 0); a rank got {flag}"
    return None


ORDER = Exercise(
    key="10.4", kind="fix", title="same collectives, same order", answer="sync_step",
    starter='''\
from torch import full, ones
from torch.distributed import all_reduce, broadcast

from course_utils.devices import rank_device


def sync_step(rank, world_size):
    grads = ones(4, device=rank_device())
    flag = full((1,), float(rank), device=rank_device())
    if rank == 0:
        all_reduce(grads)
        broadcast(flag, 0)
    else:
        broadcast(flag, 0)
        all_reduce(grads)
    return grads.tolist(), flag.item()
''',
    solution='''\
from torch import full, ones
from torch.distributed import all_reduce, broadcast

from course_utils.devices import rank_device


def sync_step(rank, world_size):
    grads = ones(4, device=rank_device())
    flag = full((1,), float(rank), device=rank_device())
    all_reduce(grads)  # every rank: first the all-reduce,
    broadcast(flag, 0)  # then the broadcast
    return grads.tolist(), flag.item()
''',
    judge=_judge_order,
    wrong=(('''\
from torch import full, ones
from torch.distributed import all_reduce, barrier, broadcast

from course_utils.devices import rank_device


def sync_step(rank, world_size):
    grads = ones(4, device=rank_device())
    flag = full((1,), float(rank), device=rank_device())
    if rank == 0:
        all_reduce(grads)
        barrier()
        broadcast(flag, 0)
    else:
        broadcast(flag, 0)
        barrier()
        all_reduce(grads)
    return grads.tolist(), flag.item()
''', "the same order"), ('''\
from torch import full, ones
from torch.distributed import all_reduce, broadcast

from course_utils.devices import rank_device


def sync_step(rank, world_size):
    grads = ones(4, device=rank_device())
    flag = full((1,), float(rank), device=rank_device())
    broadcast(grads, 0)
    broadcast(flag, 0)
    return grads.tolist(), flag.item()
''', "summed over the ranks")),
)


# ----------------------------------------------------------------------------- 10.8 seeds

def _judge_still_differ(still_differ: Any) -> str | None:
    if not isinstance(still_differ, (set, frozenset, list, tuple)):
        return "answer with a set of names, such as {\"weights\"}"
    got = set(still_differ)
    known = {"weights", "dropout mask", "data order"}
    if got - known:
        return f"choose among {sorted(known)}; {sorted(got - known)} is not one of them"
    if "weights" in got:
        return "DDP's constructor broadcasts rank 0's parameters and buffers: the weights agree after it"
    if got != {"dropout mask", "data order"}:
        return ("DDP copies tensors, not random generators: whatever a rank draws afterwards "
                "(masks, shuffles) still comes from its own seed")
    return None


SEEDS = Exercise(
    key="10.8", kind="predict", title="what DDP's first broadcast fixes", answer="still_differ",
    starter="still_differ = ...  # a set, from {\"weights\", \"dropout mask\", \"data order\"}\n",
    solution="still_differ = {\"dropout mask\", \"data order\"}\n",
    judge=_judge_still_differ,
    wrong=(("still_differ = {\"weights\", \"dropout mask\", \"data order\"}\n", "broadcasts rank 0's"),
           ("still_differ = set()\n", "not random generators")),
)


# ----------------------------------------------------------------------------- 10.10 ports

def _judge_store(start_store: Any) -> str | None:
    try:
        first = start_store()  # the one an interrupted cell left running
        second = start_store()
    except Exception as err:  # noqa: BLE001 - an address in use, said in torch's words
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            return ("the store found its port taken (the second call, by the first store, as by "
                    "one an interrupted cell left running): let the operating system pick a free "
                    "port (port 0)")
        raise
    if first.port == 0 or second.port == 0 or first.port == second.port:
        return f"the stores should listen on two different real ports, got {first.port} and {second.port}"
    second.set("key", "value")
    if second.get("key") != b"value":
        return "the store does not keep what is set in it"
    del first, second
    return None


STORE = Exercise(
    key="10.10", kind="fix", title="a port that is always free", answer="start_store",
    starter='''\
from datetime import timedelta

from torch.distributed import TCPStore


def start_store():
    return TCPStore("127.0.0.1", 29500, None, True, timedelta(seconds=5),
                         wait_for_workers=False)
''',
    solution='''\
from datetime import timedelta

from torch.distributed import TCPStore


def start_store():
    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5),  # 0: any free port
                         wait_for_workers=False)
''',
    judge=_judge_store,
    wrong=(('''\
from datetime import timedelta

from torch.distributed import TCPStore


def start_store():
    return TCPStore("127.0.0.1", 29501, None, True, timedelta(seconds=5),
                         wait_for_workers=False)
''', "port 0"), ('''\
import os
from datetime import timedelta

from torch.distributed import TCPStore


def start_store():
    return TCPStore("127.0.0.1", 29500 + os.getpid() % 1000, None, True,
                         timedelta(seconds=5), wait_for_workers=False)
''', "port 0")),
)


# ----------------------------------------------------------------------------- 10.11 CUDA and fork

def _judge_start_methods(safe_after_cuda: Any) -> str | None:
    if not isinstance(safe_after_cuda, (set, frozenset, list, tuple)):
        return "answer with a set of start methods, such as {\"spawn\"}"
    got = set(safe_after_cuda)
    if got - {"fork", "spawn", "forkserver"}:
        return f"the start methods are 'fork', 'spawn' and 'forkserver'; {sorted(got)} has others"
    if "fork" in got:
        return ("a forked child is a copy of this process, CUDA state included, which it cannot "
                "use: that is 'Cannot re-initialize CUDA in forked subprocess'")
    if got != {"spawn", "forkserver"}:
        return ("a start method is safe when the child does not copy this process: which methods "
                "start from a fresh interpreter, or from a clean one started early?")
    return None


START_METHODS = Exercise(
    key="10.11", kind="predict", title="which start methods survive CUDA", answer="safe_after_cuda",
    starter="safe_after_cuda = ...  # a set, from {\"fork\", \"spawn\", \"forkserver\"}\n",
    solution="safe_after_cuda = {\"spawn\", \"forkserver\"}\n",
    judge=_judge_start_methods,
    wrong=(("safe_after_cuda = {\"fork\", \"spawn\", \"forkserver\"}\n", "forked child is a copy"),
           ("safe_after_cuda = {\"spawn\"}\n", "clean one started early")),
)


# ----------------------------------------------------------------------------- 10.12 compression

def _judge_ratio(fp16_bytes_ratio: Any) -> str | None:
    if isinstance(fp16_bytes_ratio, bool) or not isinstance(fp16_bytes_ratio, (int, float)):
        return "answer with a number: bytes per step with the fp16 hook / bytes with plain fp32"
    if abs(fp16_bytes_ratio - 0.5) < 1e-9:
        return None
    if abs(fp16_bytes_ratio - 1.0) < 1e-9:
        return "the hook casts each bucket before the all-reduce: fewer bytes travel"
    return "count the bytes of one gradient value: float32 has 4, float16 has 2"


RATIO = Exercise(
    key="10.12", kind="predict", title="bytes saved by fp16 compression", answer="fp16_bytes_ratio",
    starter="fp16_bytes_ratio = ...  # bytes per step with fp16_compress_hook / bytes without\n",
    solution="fp16_bytes_ratio = 0.5\n",
    judge=_judge_ratio,
    wrong=(("fp16_bytes_ratio = 1.0\n", "fewer bytes travel"),
           ("fp16_bytes_ratio = 0.25\n", "float16 has 2")),
)

EXERCISES = [SET_EPOCH, EVALUATION, SHARDS, ORDER, JOIN, ACCUMULATION, NO_GRAD, SEEDS, CLEAN_KEYS, STORE,
             START_METHODS, RATIO]
