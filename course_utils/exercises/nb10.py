"""Exercises of notebook 10: the judges of the fix of every failure in the zoo (the content is in
nb10.toml). Ranks run through ``on_ranks``, which tells a hang from a slow machine by evidence
(no rank uses the CPU), so a wrong answer that hangs comes back as a hint and a right one on a
busy machine is not cut off."""

from __future__ import annotations

import re
from typing import Any

from ..hangs import HANG_FRESH_S  # noqa: F401 - the notebook's allowance (tests/test_debugging.py)
from .core import load_bank, not_a_pair
from .nb10_ranks import (
    accumulation_rank,
    drawn_accuracy,
    evaluation_rank,
    join_rank,
    order_rank,
    saving_rank,
    seeded_weights,
)
from .on_ranks import run_on_ranks

__all__ = ["CASES", "EXERCISES"]

#: The configurations each judge tries (CASES describes them, from the same lists).
#: 10.1: world sizes, each with the classifier's right rows (None: the notebook's; else drawn)
EVALUATION_CASES = [(2, None), (3, 1), (4, 2)]
#: 10.2: (rows, world size), including sizes that do not divide evenly
SHARD_CASES = [(n, w) for n in (10, 7, 12, 3, 1) for w in (1, 2, 3, 4)]
#: 10.3: world sizes
ORDER_WORLDS = (2, 3)
#: 10.4: batches per rank: the notebook's, then 3 ranks (the check hands the answer a my_batches
#: for them)
JOIN_CASES = [[3, 2], [4, 3, 5]]
#: 10.5: (world size, k micro-batches, rows per micro-batch, optimizer steps)
ACCUMULATION_CASES = [(2, 4, 3, 2), (3, 3, 2, 2)]
#: 10.6: the models, each with parameters that forward never uses
NO_GRAD_MODELS = ("TwoHeads", "a stack whose middle layer is skipped")
#: 10.8: how long rank 0 takes to write (a sleep shorter than one is too early there)
SAVE_DELAYS_S = [0.3, 2.0]
#: 10.9: calls in a row, the random generators seeded alike before each
STORE_CALLS = 2



def run_ranks(fn: Any, world_size: int, *args: Any) -> tuple[list | None, str | None]:
    """:func:`run_on_ranks` with notebook 10's hang hint."""
    return run_on_ranks(fn, world_size, *args, hang_hint=(
        "the ranks hung: one rank waited in a collective that another rank never called, or "
        "called in a different order"))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# ----------------------------------------------------------------------------- 10.1 evaluation

def _judge_evaluation(evaluate_and_report: Any) -> str | None:
    for world_size, seed in EVALUATION_CASES:
        results, hint = run_ranks(evaluation_rank, world_size, evaluate_and_report, seed)
        if hint:
            return hint + ". Evaluation that all-reduces is a collective: every rank must run it"
        if any(not r["kinds"] for r in results):
            return ("a rank ran no collective: every rank takes part in the evaluation (each counts "
                    "its own shard, and the counts are all-reduced); only the reporting is rank 0's")
        value = results[0]["value"]
        if value is None:
            return "rank 0 should return the accuracy over the whole set (it returned None)"
        if not isinstance(value, (int, float)) or abs(value - drawn_accuracy(seed)) > 1e-6:
            return (f"with {world_size} ranks, rank 0 returned {value!r}, not the accuracy over the "
                    "whole set: each rank must evaluate its own shard, so that together they cover "
                    "every row")
        if any(r["value"] is not None for r in results[1:]):
            return ("only rank 0 reports the number: the other ranks take part in the evaluation and "
                    "return None")
    return None


# ----------------------------------------------------------------------------- 10.2 exact shards

def _judge_shards(shard: Any) -> str | None:
    for n, world_size in SHARD_CASES:
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
        sizes = [len(s) for s in shards]
        if max(sizes) - min(sizes) > 1:
            return (f"with {n} rows on {world_size} ranks the shards hold {sizes} rows: every row is "
                    "evaluated once, but one rank does the work of several while the others wait; "
                    "spread the rows so that shards differ by at most one")
    return None


# ----------------------------------------------------------------------------- 10.3 order

def _judge_order(sync_step: Any) -> str | None:
    for world_size in ORDER_WORLDS:
        results, hint = run_ranks(order_rank, world_size, sync_step)
        if hint:
            return hint + ". Make every rank call the same collectives in the same order"
        for r in results:
            if not r["kinds"]:
                return ("a rank ran no collective: the sum over the ranks and rank 0's flag can only "
                        "come from the other ranks through collectives")
            if r["grads"] != [float(world_size)] * 4:
                return (f"with {world_size} ranks the gradients should be summed over the ranks "
                        f"(all_reduce); a rank got {r['grads']}")
            if r["flag"] != 0.0:
                return f"the flag should be rank 0's (broadcast from rank 0); a rank got {r['flag']}"
            if not set(r["kinds"]) & {"broadcast", "all_gather", "scatter"}:
                return ("the flag is right only because rank 0's value happens to be the smallest: "
                        "a reduction is not a copy; take rank 0's flag as it is (broadcast)")
    return None


# ----------------------------------------------------------------------------- 10.4 Join

def _judge_join(train_my_shard: Any) -> str | None:
    from course_utils.training_bugs import uneven_reference

    for counts in JOIN_CASES:
        results, hint = run_ranks(join_rank, len(counts), train_my_shard, counts)
        if hint:
            return (hint + ". Rank 0 has a third batch; its all-reduce waits for a rank that has "
                    "finished: let the finished rank join (or agree on an equal number of batches)")
        weights = [r["weights"] for r in results]
        if any(_max_diff(weights[0], w) > 0 for w in weights[1:]):
            return "the ranks ended with different weights: all of them must train under DDP"
        if any(r["kinds"] is not None and "all_reduce" not in r["kinds"] for r in results):
            return ("a rank ran no all-reduce: the ranks must train together under DDP, each on its "
                    "own batches, not on the others' batches computed alone")
        if not any(_max_diff(weights[0], uneven_reference(counts, mode)) < 1e-6
                   for mode in ("join", "equal")):
            return ("the ranks finished, but not with the weights that training on their batches gives: "
                    "keep every batch (Join) or drop only the batches that not every rank has")
    return None


# ----------------------------------------------------------------------------- 10.5 accumulation

def _judge_accumulation(accumulation_step: Any) -> str | None:
    for world_size, k, micro, steps in ACCUMULATION_CASES:
        hint = _accumulation_case(accumulation_step, world_size, k, micro, steps)
        if hint is not None:
            return hint
    return None


def _accumulation_case(accumulation_step: Any, world_size: int, k: int, micro: int, steps: int) -> str | None:
    from course_utils.training_bugs import accumulation_reference

    results, hint = run_ranks(accumulation_rank, world_size, accumulation_step, k, micro, steps)
    if hint:
        return hint
    if any(r["cleared_between"] for r in results):
        return ("optimizer.zero_grad() ran between two micro-batches of one step: it throws away what "
                "the micro-batches before it accumulated; clear the gradients once per optimizer step")
    weights = [r["weights"] for r in results]
    if any(_max_diff(weights[0], w) > 1e-7 for w in weights[1:]):
        return ("the ranks ended with different weights: their gradients were not all-reduced "
                "after the last micro-batch (only the backward that syncs is averaged)")
    if _max_diff(weights[0], accumulation_reference(world_size, k, micro, steps)) > 1e-5:
        return (f"with k = {k} micro-batches the ranks agree, but did not move as one big batch "
                "would: each micro-batch's loss is a mean over its rows, so the k accumulated "
                "gradients add up to k times the mean")
    if results[0]["rounds"] >= k * steps:
        return ("the weights are right, but every micro-batch's backward all-reduced the gradients: "
                "accumulating is there to save those all-reduces, so only the last backward of a step "
                "should synchronise")
    if results[0]["rounds"] > steps:
        return ("the weights are right, but more than one backward per optimizer step all-reduced the "
                "gradients: only the last one needs to")
    return None


# ----------------------------------------------------------------------------- 10.6 no gradient

class _SkipsMiddle:
    """10.6's second model: a stack whose middle layer forward skips (built on first use)."""

    def __new__(cls) -> Any:
        import torch

        class SkipsMiddle(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.first, self.middle, self.last = (torch.nn.Linear(4, 4) for _ in range(3))

            def forward(self, x: Any) -> Any:
                return self.last(torch.relu(self.first(x)))

        return SkipsMiddle()


def _judge_no_grad(params_without_grad: Any) -> str | None:
    import torch

    from course_utils.ddp_demos import TwoHeads

    for build, expected in ((TwoHeads, ["unused_head.bias", "unused_head.weight"]),
                            (_SkipsMiddle, ["middle.bias", "middle.weight"])):
        torch.manual_seed(0)
        model = build()
        loss = model(torch.randn(2, 4)).square().mean()
        got = sorted(params_without_grad(model, loss))
        if got == expected:
            continue
        everything = sorted(name for name, _ in model.named_parameters())
        if got == everything:
            return "every parameter is listed: no gradient exists until backward has run"
        if got == sorted(set(everything) - set(expected)):
            return "those are the parameters that did get a gradient; list the others"
        return (f"for {type(model).__name__}, got {got}: list the parameters that backward did not "
                "reach (forward never used them), whatever the model; every parameter here requires "
                "a gradient")
    return None


# ----------------------------------------------------------------------------- 10.7 seeds

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
        return ("DDP copies tensors, not random generators: of the three, which are drawn at random on "
                "each rank after the model is wrapped?")
    return None


# ----------------------------------------------------------------------------- 10.8 saving

#: how torch.load fails on a checkpoint that is still being written
_TORN = re.compile(r"EOFError|UnpicklingError|PytorchStreamReader|zip archive|central directory")


def _judge_save_and_load(save_and_load: Any) -> str | None:
    import os
    import tempfile

    import torch

    def same(a: dict | None, b: dict) -> bool:
        return a is not None and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)

    with tempfile.TemporaryDirectory(prefix="course-checkpoint-") as folder:
        paths = [os.path.join(folder, f"model{i}.pt") for i in range(len(SAVE_DELAYS_S))]
        for path in paths:
            torch.save(seeded_weights(99), path)  # last run's checkpoint, still there
        cases = []
        for path, delay in zip(paths, SAVE_DELAYS_S, strict=True):  # a launch each: a hang ends one
            results, hint = run_ranks(saving_rank, 2, save_and_load, path, delay)
            if hint and _TORN.search(hint):
                return (f"{hint.split(':')[0]} reading the checkpoint while rank 0 was still writing it "
                        "(a torn file): no rank may read until rank 0 has finished writing, and a "
                        "sleep, or watching the file, only guesses when that is")
            if hint:
                return hint + ". A barrier waits until every rank has reached it: every rank must call it"
            cases.append(results)
    saved, stale = seeded_weights(0), seeded_weights(99)
    for delay, results in zip(SAVE_DELAYS_S, cases, strict=True):
        if any(r["wrote"] for r in results[1:]):
            return ("only rank 0 writes the checkpoint: ranks that write one file at once can leave it "
                    "torn, and every copy but one is wasted")
        for rank, result in enumerate(results):
            if result["weights"] is None:
                return (f"return the weights read from the file, a state_dict (rank {rank} returned "
                        "another thing)")
            if same(result["weights"], stale):
                return (f"when rank 0 took {delay:g} s to write, rank {rank} read the file before rank 0 "
                        "had written it, and got last run's checkpoint, which was still there: no rank "
                        "may read until rank 0 has finished writing (a sleep only guesses how long "
                        "that takes)")
            if not same(result["weights"], saved):
                if same(result["weights"], seeded_weights(rank)):
                    return (f"rank {rank} returned its own weights: every rank must return what rank 0 "
                            "saved, read back from the checkpoint")
                return f"rank {rank} did not return the weights rank 0 saved"
    if any(not r["kinds"] for results in cases for r in results):
        return ("every rank read rank 0's weights, but a rank did not wait for rank 0 in a "
                "collective: a sleep, or watching the file, only guesses when writing has "
                "finished; a barrier knows")
    return None


# ----------------------------------------------------------------------------- 10.9 ports

def _seed_every_generator() -> None:
    """The random generators a learner might draw a port from, all in the same state."""
    import random

    import numpy
    import torch

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


def _ephemeral_ports() -> range | None:
    """The ports this machine's OS hands out for port 0 (Linux says; elsewhere None)."""
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


def _judge_store(start_store: Any) -> str | None:
    stores = []
    try:
        for _ in range(STORE_CALLS):  # the first as one an interrupted cell left running
            _seed_every_generator()  # a port drawn at random comes out the same: taken
            stores.append(start_store())
    except Exception as err:  # noqa: BLE001 - an address in use, said in torch's words
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            return ("the store found its port taken (the second call, by the first store, as by "
                    "one an interrupted cell left running; a port drawn at random can be taken as "
                    "well): let the operating system pick a free port (port 0)")
        raise
    if not all(hasattr(store, "port") for store in stores):
        return ("start_store must return a working store every time, also when something holds a "
                f"port: it returned {[type(store).__name__ for store in stores]}")
    ports = [store.port for store in stores]
    if 0 in ports or len(set(ports)) < len(ports):
        return f"the stores should listen on different real ports, got {ports}"
    ephemeral = _ephemeral_ports()
    if ephemeral is not None and any(port not in ephemeral for port in ports):
        return ("the stores work, but on ports this code chose: any of them can be held by another "
                "program (or the next run); let the operating system pick a free port (port 0)")
    stores[-1].set("key", "value")
    if stores[-1].get("key") != b"value":
        return "the store does not keep what is set in it"
    del stores
    return None


# ----------------------------------------------------------------------------- 10.10 CUDA and fork

def _judge_start_methods(safe_after_cuda: Any) -> str | None:
    if not isinstance(safe_after_cuda, (set, frozenset, list, tuple)):
        return "answer with a set of start methods, such as {\"spawn\"}"
    got = set(safe_after_cuda)
    if got - {"fork", "spawn", "forkserver"}:
        return f"the start methods are 'fork', 'spawn' and 'forkserver'; {sorted(got)} has others"
    if "fork" in got:
        return ("a forked child is a copy of this process, CUDA state included, which it cannot "
                "use: that is 'Cannot re-initialize CUDA in forked subprocess'")
    if "spawn" not in got:
        return ("a start method is safe when the child does not copy this process: one of them "
                "starts from a fresh interpreter")
    if got != {"spawn", "forkserver"}:
        return ("a start method is safe when the child does not copy this process: besides a fresh "
                "interpreter, a child can come from a clean process started before CUDA was touched")
    return None


# ----------------------------------------------------------------------------- 10.11 compression

def _judge_ratio(fp16_bytes_ratio: Any) -> str | None:
    if isinstance(fp16_bytes_ratio, bool) or not isinstance(fp16_bytes_ratio, (int, float)):
        return "answer with a number: bytes per step with the fp16 hook / bytes with plain fp32"
    if abs(fp16_bytes_ratio - 0.5) < 1e-9:
        return None
    if abs(fp16_bytes_ratio - 2.0) < 1e-9:
        return "that ratio is upside down: bytes with the fp16 hook over bytes with plain fp32"
    if abs(fp16_bytes_ratio - 50) < 1e-9:
        return "answer with a fraction, not a percentage"
    if abs(fp16_bytes_ratio - 1.0) < 1e-9:
        return "the hook casts each bucket before the all-reduce: fewer bytes travel"
    return "count the bytes of one gradient value: float32 has 4, float16 has 2"



# ----------------------------------------------------------------------------- 10.12 Flight Recorder

def _judge_first_mismatch(first_mismatch: Any) -> str | None:
    from course_utils.flight_recorder import example_flight_records, first_mismatch_of

    wrong_shape = not_a_pair(first_mismatch, "(the collective's number in the group, a rank)")
    if wrong_shape:
        return wrong_shape
    records = example_flight_records()
    seq, rank = first_mismatch
    right_seq, right_rank = first_mismatch_of(records)
    numbers = sorted({e["collective_seq_id"] for r in records.values() for e in r["entries"]})
    if seq not in numbers:
        return f"the dumps hold the group's collectives numbered {numbers}: name one of them"
    if rank not in records:
        return f"the job has ranks 0 to {max(records)}: name one of them"
    if seq < right_seq:
        return ("at that collective every rank ran the same operation with the same sizes, and it "
                "finished everywhere: look further down")
    if seq > right_seq:
        return ("the ranks disagree there too, but an earlier collective already did: a hang begins at "
                "the first disagreement, and what follows only queued behind it")
    if rank != right_rank:
        return ("the right collective: at it two ranks ran the same thing and one did not; the "
                "operation's name is the same on all three, so read the sizes")
    return None


CASES: dict[str, list[str]] = {
    "10.1": [f"world_size={w}, " + ("the notebook's classifier" if seed is None else f"right rows drawn "
             f"with seed {seed}") for w, seed in EVALUATION_CASES],
    "10.2": [f"{n} rows on {w} rank(s)" for n, w in SHARD_CASES],
    "10.3": [f"world_size={w}" for w in ORDER_WORLDS],
    "10.4": [f"world_size={len(c)}, batches per rank {c}" for c in JOIN_CASES],
    "10.5": [f"world_size={w}, k={k} micro-batches of {m} rows, {s} steps"
             for w, k, m, s in ACCUMULATION_CASES],
    "10.6": [f"model: {name}" for name in NO_GRAD_MODELS],
    "10.7": ["the three candidates: weights, dropout mask, data order"],
    "10.8": [f"world_size=2, rank 0 writes for {d:g} s, last run's checkpoint in place"
             for d in SAVE_DELAYS_S],
    "10.9": [f"call {i + 1} of {STORE_CALLS}, random generators seeded alike" for i in range(STORE_CALLS)],
    "10.10": ["the three start methods: fork, spawn, forkserver"],
    "10.11": ["fp16 hook against plain fp32"],
    "10.12": ["the example dumps of 3 ranks"],
}

EXERCISES = load_bank(__name__)
