"""Exercises of notebook 10: the judges of the fix of every failure in the zoo (the content is in
nb10.toml). Ranks run through ``on_ranks``, which tells a hang from a slow machine by evidence
(no rank uses the CPU), so a wrong answer that hangs comes back as a hint and a right one on a
busy machine is not cut off."""

from __future__ import annotations

from typing import Any

from ..hangs import HANG_FRESH_S  # noqa: F401 - the notebook's allowance (tests/test_debugging.py)
from .core import load_bank, not_a_pair
from .nb10_ranks import accumulation_rank, save_and_load_rank, seeded_weights
from .on_ranks import run_on_ranks

__all__ = ["EXERCISES"]



def run_ranks(fn: Any, world_size: int, *args: Any) -> tuple[list | None, str | None]:
    """:func:`run_on_ranks` with notebook 10's hang hint."""
    return run_on_ranks(fn, world_size, *args, hang_hint=(
        "the ranks hung: one rank waited in a collective that another rank never called, or "
        "called in a different order"))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# ----------------------------------------------------------------------------- 10.1 evaluation

def _judge_evaluation(evaluate_and_report: Any) -> str | None:
    results, hint = run_ranks(evaluate_and_report, 2)
    if hint:
        return hint + ". Evaluation that all-reduces is a collective: every rank must run it"
    if results[0] is None:
        return "rank 0 should return the accuracy over the whole set (it returned None)"
    if abs(results[0] - 0.6) > 1e-6:
        return (f"rank 0 returned {results[0]!r}, not the accuracy over the whole set: each rank must "
                "evaluate its own shard, so that together they cover every row")
    if any(r is not None for r in results[1:]):
        return "only rank 0 reports the number: the other ranks take part in the evaluation and return None"
    return None


# ----------------------------------------------------------------------------- 10.2 exact shards

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


# ----------------------------------------------------------------------------- 10.3 order

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


# ----------------------------------------------------------------------------- 10.4 Join

def _judge_join(train_my_shard: Any) -> str | None:
    from course_utils.training_bugs import uneven_reference

    results, hint = run_ranks(train_my_shard, 2)
    if hint:
        return (hint + ". Rank 0 has a third batch; its all-reduce waits for a rank that has "
                "finished: let the finished rank join (or agree on an equal number of batches)")
    if _max_diff(results[0], results[1]) > 0:
        return "the ranks ended with different weights: all of them must train under DDP"
    for mode in ("join", "equal"):
        if _max_diff(results[0], uneven_reference([3, 2], mode)) < 1e-6:
            return None
    return ("the ranks finished, but not with the weights that training on their batches gives: "
            "keep every batch (Join) or drop only the batches that not every rank has")


# ----------------------------------------------------------------------------- 10.5 accumulation

def _judge_accumulation(accumulation_step: Any) -> str | None:
    from course_utils.training_bugs import accumulation_reference

    k, micro, steps = 4, 3, 2
    results, hint = run_ranks(accumulation_rank, 2, accumulation_step, k, micro, steps)
    if hint:
        return hint
    if any(r["cleared_between"] for r in results):
        return ("optimizer.zero_grad() ran between two micro-batches of one step: it throws away what "
                "the micro-batches before it accumulated; clear the gradients once per optimizer step")
    weights = [r["weights"] for r in results]
    if _max_diff(weights[0], weights[1]) > 1e-7:
        return ("the ranks ended with different weights: their gradients were not all-reduced "
                "after the last micro-batch (only the backward that syncs is averaged)")
    if _max_diff(weights[0], accumulation_reference(2, k, micro, steps)) > 1e-5:
        return ("the ranks agree, but moved further than one big batch would: each micro-batch's "
                "loss is a mean over its rows, so the k accumulated gradients add up to k times "
                "the mean")
    if results[0]["rounds"] >= k * steps:
        return ("the weights are right, but every micro-batch's backward all-reduced the gradients: "
                "accumulating is there to save those all-reduces, so only the last backward of a step "
                "should synchronise")
    if results[0]["rounds"] > steps:
        return ("the weights are right, but more than one backward per optimizer step all-reduced the "
                "gradients: only the last one needs to")
    return None


# ----------------------------------------------------------------------------- 10.6 no gradient

def _judge_no_grad(params_without_grad: Any) -> str | None:
    import torch

    from course_utils.ddp_demos import TwoHeads

    torch.manual_seed(0)
    model = TwoHeads()
    loss = model(torch.randn(2, 4)).square().mean()
    got = sorted(params_without_grad(model, loss))
    expected = ["unused_head.bias", "unused_head.weight"]
    if got == expected:
        return None
    everything = sorted(name for name, _ in model.named_parameters())
    if got == everything:
        return "every parameter is listed: no gradient exists until backward has run"
    if got == sorted(set(everything) - set(expected)):
        return "those are the parameters that did get a gradient; list the others"
    return (f"got {got}: list the parameters that backward did not reach (forward never used them); "
            "every parameter here requires a gradient")


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

def _judge_save_and_load(save_and_load: Any) -> str | None:
    import os
    import tempfile

    import torch

    def same(a: dict | None, b: dict) -> bool:
        return a is not None and sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)

    with tempfile.TemporaryDirectory(prefix="course-checkpoint-") as folder:
        path = os.path.join(folder, "model.pt")
        torch.save(seeded_weights(99), path)  # last run's checkpoint, still there
        results, hint = run_ranks(save_and_load_rank, 2, save_and_load, path)
    if hint:
        return hint + ". A barrier waits until every rank has reached it: every rank must call it"
    if any(r["wrote"] for r in results[1:]):
        return ("only rank 0 writes the checkpoint: ranks that write one file at once can leave it torn, "
                "and every copy but one is wasted")
    saved, stale = seeded_weights(0), seeded_weights(99)
    for rank, result in enumerate(results):
        if result["weights"] is None:
            return f"return the weights read from the file, a state_dict (rank {rank} returned another thing)"
        if same(result["weights"], stale):
            return (f"rank {rank} read the file before rank 0 had written it, and got last run's "
                    "checkpoint, which was still there: no rank may read until rank 0 has finished "
                    "writing (a sleep only guesses how long that takes)")
        if not same(result["weights"], saved):
            if same(result["weights"], seeded_weights(rank)):
                return (f"rank {rank} returned its own weights: every rank must return what rank 0 "
                        "saved, read back from the checkpoint")
            return f"rank {rank} did not return the weights rank 0 saved"
    return None


# ----------------------------------------------------------------------------- 10.9 ports

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
    if not (hasattr(first, "port") and hasattr(second, "port")):
        return ("start_store must return a working store every time, also when something holds a "
                f"port: it returned {type(first).__name__} and {type(second).__name__}")
    if first.port == 0 or second.port == 0 or first.port == second.port:
        return f"the stores should listen on two different real ports, got {first.port} and {second.port}"
    second.set("key", "value")
    if second.get("key") != b"value":
        return "the store does not keep what is set in it"
    del first, second
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


EXERCISES = load_bank(__name__)
