"""Exercises of notebook 12: the judges of the fix of every failure in the zoo (the content is in
nb12.toml). Ranks run through ``on_ranks``, which tells a hang from a slow machine by evidence
(no rank uses the CPU), so a wrong answer that hangs comes back as a hint and a right one on a
busy machine is not cut off."""

from __future__ import annotations

import re
from typing import Any

import torch

from ..debugging.hangs import HANG_FRESH_S  # noqa: F401 - the notebook's allowance (tests/test_debugging.py)
from .answers import real
from .core import load_bank, untimed
from .nb12_local import (  # the judges that run no ranks
    NO_GRAD_MODELS,
    SHARD_CASES,
    STORE_CALLS,
    _judge_first_mismatch,
    _judge_no_grad,
    _judge_ratio,
    _judge_shards,
    _judge_start_methods,
    _judge_still_differ,
    _judge_store,
)
from .nb12_ranks import (
    accumulation_rank,
    drawn_accuracy,
    evaluation_rank,
    join_rank,
    order_rank,
    saving_rank,
    seeded_weights,
)
from .on_ranks import Plan
from .together import by_plan

__all__ = ["CASES", "EXERCISES", "HANG_HINT", "PLANS", "_judge_first_mismatch", "_judge_no_grad",
           "_judge_ratio", "_judge_shards", "_judge_start_methods", "_judge_still_differ", "_judge_store"]

#: The configurations each judge tries (CASES describes them, from the same lists).
#: 12.1: world sizes, each with the classifier's right rows (None: the notebook's; else drawn)
EVALUATION_CASES = [(2, None), (3, 1)]
#: 12.3: world sizes
ORDER_WORLDS = (2, 3)
#: 12.4: batches per rank: the notebook's, then 3 ranks (the check hands the answer a my_batches
#: for them)
JOIN_CASES = [[3, 2], [4, 3, 5]]
#: 12.5: (world size, k micro-batches, rows per micro-batch, optimizer steps)
ACCUMULATION_CASES = [(2, 4, 3, 2), (3, 3, 2, 2)]
#: 12.8: how long rank 0 takes to write (a sleep shorter than one is too early there)
SAVE_DELAYS_S = [0.3, 2.0]




#: what a hang means in notebook 12's checks
HANG_HINT = ("the ranks hung: one rank waited in a collective that another rank never called, or called "
             "in a different order")


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# ----------------------------------------------------------------------------- 12.1 evaluation

def _evaluation_plan(evaluate_and_report: Any) -> Plan:
    for world_size, seed in EVALUATION_CASES:
        results, hint = yield (evaluation_rank, world_size, evaluate_and_report, seed)
        if hint:
            return hint + ". Evaluation that all-reduces is a collective: every rank must run it"
        if any(not r["kinds"] for r in results):
            return ("a rank ran no collective: every rank takes part in the evaluation (each counts "
                    "its own shard, and the counts are all-reduced); only the reporting is rank 0's")
        idle = next((rank for rank, r in enumerate(results) if not r["rows"]), None)
        missed = sorted(set(range(10)) - {i for r in results for i in r["rows"]})
        if idle is not None or missed:
            who = f"rank {idle} evaluated no rows" if idle is not None else f"no rank evaluated rows {missed}"
            return (f"with {world_size} ranks {who}: each rank must evaluate its own shard, so that "
                    "together they cover every row, and the counts are then all-reduced")
        value = real(results[0]["value"])
        if results[0]["value"] is None:
            return "rank 0 should return the accuracy over the whole set (it returned None)"
        with untimed():  # the course's own reference
            accuracy = drawn_accuracy(seed)
        if value is None or abs(value - accuracy) > 1e-6:
            return (f"with {world_size} ranks, rank 0 returned {results[0]['value']!r}, not the accuracy "
                    "over the whole set: each rank must evaluate its own shard, so that together they "
                    "cover every row")
        if any(r["value"] is not None for r in results[1:]):
            return ("only rank 0 reports the number: the other ranks take part in the evaluation and "
                    "return None")
    return None


# ----------------------------------------------------------------------------- 12.3 order

def _order_plan(sync_step: Any) -> Plan:
    for world_size in ORDER_WORLDS:
        results, hint = yield (order_rank, world_size, sync_step)
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
            if r["summed"] < 4 * 4:  # the four float32 gradients went through a reduction
                return ("the gradients come out as the sum, but no rank handed them to a collective "
                        "that sums: they must come from the other ranks (all_reduce), not be worked out")
            if not set(r["kinds"]) & {"broadcast", "all_gather", "scatter"}:
                return ("the flag is right only because rank 0's value happens to be the smallest: "
                        "a reduction is not a copy; take rank 0's flag as it is (broadcast)")
    return None


# ----------------------------------------------------------------------------- 12.4 Join

def _join_plan(train_my_shard: Any) -> Plan:
    from course_utils.debugging.training_bugs import small_model, uneven_reference

    with untimed():  # the course's own model: only the answer's time counts
        size = sum(p.numel() for p in small_model().parameters())
    for counts in JOIN_CASES:
        results, hint = yield (join_rank, len(counts), train_my_shard, counts)
        if hint:
            return (hint + ". Rank 0 has a third batch; its all-reduce waits for a rank that has "
                    "finished: let the finished rank join (or agree on an equal number of batches)")
        weights = [r["weights"] for r in results]
        if any(_max_diff(weights[0], w) > 0 for w in weights[1:]):
            return "the ranks ended with different weights: all of them must train under DDP"
        if any(r["reduced"] is not None and r["reduced"] < size for r in results):
            return ("a rank ran no all-reduce of the gradients: the ranks must train together under DDP, "
                    "each on its own batches, not on the others' batches computed alone")
        with untimed():  # the course's own references
            reached = any(_max_diff(weights[0], uneven_reference(counts, mode)) < 1e-6
                          for mode in ("join", "equal"))
        if not reached:
            return ("the ranks finished, but not with the weights that training on their batches gives: "
                    "keep every batch (Join) or drop only the batches that not every rank has")
    return None


# ----------------------------------------------------------------------------- 12.5 accumulation

def _accumulation_plan(accumulation_step: Any) -> Plan:
    from course_utils.debugging.training_bugs import accumulation_reference

    for world_size, k, micro, steps in ACCUMULATION_CASES:
        results, hint = yield (accumulation_rank, world_size, accumulation_step, k, micro, steps)
        if hint:
            return hint
        if any(r["cleared_between"] for r in results):
            return ("optimizer.zero_grad() ran between two micro-batches of one step: it throws away what "
                    "the micro-batches before it accumulated; clear the gradients once per optimizer step")
        weights = [r["weights"] for r in results]
        if any(_max_diff(weights[0], w) > 1e-7 for w in weights[1:]):
            return ("the ranks ended with different weights: their gradients were not all-reduced "
                    "after the last micro-batch (only the backward that syncs is averaged)")
        with untimed():  # the course's own reference
            reference = accumulation_reference(world_size, k, micro, steps)
        if _max_diff(weights[0], reference) > 1e-5:
            return (f"with k = {k} micro-batches the ranks agree, but did not move as one big batch "
                    "would: each micro-batch's loss is a mean over its rows, so the k accumulated "
                    "gradients add up to k times the mean")
        if results[0]["rounds"] >= k * steps:
            return ("the weights are right, but every micro-batch's backward all-reduced the gradients: "
                    "accumulating is there to save those all-reduces, so only the last backward of a "
                    "step should synchronise")
        if results[0]["rounds"] > steps:
            return ("the weights are right, but more than one backward per optimizer step all-reduced "
                    "the gradients: only the last one needs to")
    return None


# ----------------------------------------------------------------------------- 12.8 saving

#: how torch.load fails on a checkpoint that is still being written
_TORN = re.compile(r"EOFError|UnpicklingError|PytorchStreamReader|zip archive|central directory")


def _saving_plan(save_and_load: Any) -> Plan:
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="course-checkpoint-") as folder:
        cases = []
        for i, delay in enumerate(SAVE_DELAYS_S):  # a launch each: a hang ends one
            path = os.path.join(folder, f"model{i}.pt")
            with untimed():  # last run's checkpoint, still there: the course's own file
                torch.save(seeded_weights(99), path)
            results, hint = yield (saving_rank, 2, save_and_load, path, delay)
            if hint and _TORN.search(hint):
                return (f"{hint.split(':')[0]} reading the checkpoint while rank 0 was still writing it "
                        "(a torn file): no rank may read until rank 0 has finished writing, and a "
                        "sleep only guesses when that is, as does watching the file")
            if hint:
                return hint + ". A barrier waits until every rank has reached it: every rank must call it"
            hint = _saved_hint(delay, results)  # each case judged as it comes: the first fault first
            if hint:
                return hint
            cases.append(results)
    if any(not r["kinds"] for results in cases for r in results):
        return ("every rank read rank 0's weights, but a rank did not wait for rank 0 in a "
                "collective: a sleep only guesses when writing has finished, as does watching the "
                "file; a barrier knows")
    return None


def _saved_hint(delay: float, results: list[dict]) -> str | None:
    def same(a: dict | None, b: dict) -> bool:
        return a is not None and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)

    with untimed():  # the course's own weights
        saved, stale = seeded_weights(0), seeded_weights(99)
        own = [seeded_weights(rank) for rank in range(len(results))]
    if any(r["wrote"] for r in results[1:]):
        return ("only rank 0 writes the checkpoint: ranks that write one file at once can leave it "
                "torn, and every copy but one is wasted")
    written = results[0]["written_at"]
    for rank, result in enumerate(results):
        early = written is not None and any(t < written for t in result["loads_at"])
        if early or same(result["weights"], stale):  # the order, whatever the values say
            return (f"when rank 0 took {delay:g} s to write, rank {rank} read the file before rank 0 "
                    "had written it" + (", and got last run's checkpoint, which was still there" if
                                        same(result["weights"], stale) else "") +
                    ": no rank may read until rank 0 has finished writing (a sleep only guesses how "
                    "long that takes)")
        if result["weights"] is None:
            return (f"return the weights read from the file, a state_dict (rank {rank} returned "
                    "another thing)")
        if not same(result["weights"], saved):
            if same(result["weights"], own[rank]):
                return (f"rank {rank} returned its own weights: every rank must return what rank 0 "
                        "saved, read back from the checkpoint")
            return f"rank {rank} did not return the weights rank 0 saved"
    return None


#: the exercises judged on ranks, by their plans (``together.verdicts`` judges many answers at once)
PLANS = {"12.1": _evaluation_plan, "12.3": _order_plan, "12.4": _join_plan, "12.5": _accumulation_plan,
         "12.8": _saving_plan}
_judge_evaluation, _judge_order, _judge_join, _judge_accumulation, _judge_save_and_load = (
    by_plan(plan_of, HANG_HINT) for plan_of in PLANS.values())


CASES: dict[str, list[str]] = {
    "12.1": [f"world_size={w}, " + ("the notebook's classifier" if seed is None else f"right rows drawn "
             f"with seed {seed}") for w, seed in EVALUATION_CASES],
    "12.2": [f"{n} rows on {w} rank(s)" for n, w in SHARD_CASES],
    "12.3": [f"world_size={w}" for w in ORDER_WORLDS],
    "12.4": [f"world_size={len(c)}, batches per rank {c}" for c in JOIN_CASES],
    "12.5": [f"world_size={w}, k={k} micro-batches of {m} rows, {s} steps"
             for w, k, m, s in ACCUMULATION_CASES],
    "12.6": [f"model: {name}" for name in NO_GRAD_MODELS],
    "12.7": ["the three candidates: weights, dropout mask, data order"],
    "12.8": [f"world_size=2, rank 0 writes for {d:g} s, last run's checkpoint in place"
             for d in SAVE_DELAYS_S],
    "12.9": [f"call {i + 1} of {STORE_CALLS}, random generators seeded alike" for i in range(STORE_CALLS)],
    "12.10": ["the three start methods: fork, spawn, forkserver"],
    "12.11": ["fp16 hook against plain fp32"],
    "12.12": ["the example dumps of 3 ranks"],
}

EXERCISES = load_bank(__name__)
