"""Exercises of notebook 10: the judges of the fix of every failure in the zoo (the content is in
nb10.toml). Ranks run under ``launch`` with a short timeout, so a wrong answer that hangs comes
back as a hint."""

from __future__ import annotations

from typing import Any

from ..hangs import HANG_FRESH_S
from .core import load_bank
from .on_ranks import run_on_ranks

__all__ = ["EXERCISES"]

HANG_S = 4.0  # a rank function that has not finished by then is stuck
# HANG_FRESH_S where a GPU is visible: launch then starts ranks as fresh interpreters (CUDA and
# fork do not mix), which import torch first; the notebook's own allowance, measured (hangs)


def run_ranks(fn: Any, world_size: int, *args: Any) -> tuple[list | None, str | None]:
    """:func:`run_on_ranks` with notebook 10's hang limit and hang hint."""
    from ..launcher.forkserver import cuda_visible

    timeout_s = HANG_FRESH_S if cuda_visible() else HANG_S
    return run_on_ranks(fn, world_size, *args, timeout_s=timeout_s, hang_hint=(
        "the ranks hung: one rank waited in a collective that another rank never called, or "
        "called in a different order"))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# ----------------------------------------------------------------------------- 10.1 set_epoch

def _judge_set_epoch(epoch_orders: Any) -> str | None:
    from torch.utils.data.distributed import DistributedSampler

    from course_utils.failure_zoo import sampler_orders

    expected = sampler_orders(0, 2, 12, 3, set_epoch=True)  # the zoo's fixed loop, shown above
    sampler = DistributedSampler(range(12), num_replicas=2, rank=0, shuffle=True, seed=0)
    got = [list(order) for order in epoch_orders(sampler, 3)]
    if got == expected:
        return None
    if len(got) == 3 and got[0] == got[1] == got[2]:
        return ("every epoch reads the same order: the sampler reshuffles only when it is told "
                "which epoch this is, a different number each epoch")
    if len(got) == 3 and got[0] == got[1]:
        return "epochs 0 and 1 read the same order: tell the sampler the epoch before reading it"
    return f"the orders differ from the sampler's own shuffles: {got}"


# ----------------------------------------------------------------------------- 10.2 evaluation

def _judge_evaluation(evaluate_and_report: Any) -> str | None:
    results, hint = run_ranks(evaluate_and_report, 2)
    if hint:
        return hint + ". Evaluation that all-reduces is a collective: every rank must run it"
    if results[0] is None or abs(results[0] - 0.6) > 1e-6:
        return f"rank 0 should return the accuracy over the whole set (it returned {results[0]!r})"
    return None


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


# ----------------------------------------------------------------------------- 10.5 Join

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


# ----------------------------------------------------------------------------- 10.6 accumulation

def _judge_accumulation(accumulation_step: Any) -> str | None:
    from course_utils.training_bugs import accumulation_reference, train_accumulating

    k, micro, steps = 4, 3, 2
    results, hint = run_ranks(train_accumulating, 2, accumulation_step, k, micro, steps)
    if hint:
        return hint
    if _max_diff(results[0], results[1]) > 1e-7:
        return ("the ranks ended with different weights: their gradients were not all-reduced "
                "after the last micro-batch (only the backward that syncs is averaged)")
    if _max_diff(results[0], accumulation_reference(2, k, micro, steps)) > 1e-5:
        return ("the ranks agree, but moved further than one big batch would: each micro-batch's "
                "loss is a mean over its rows, so the k accumulated gradients add up to k times "
                "the mean")
    return None


# ----------------------------------------------------------------------------- 10.7 no gradient

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
    return f"expected the names of the parameters whose .grad is still None after backward, got {got}"


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


# ----------------------------------------------------------------------------- 10.9 prefixes

def _judge_clean_keys(clean_state_dict: Any) -> str | None:
    saved = {"module._orig_mod.body.weight": 1, "_orig_mod.submodule.weight": 2,
             "module.submodule.bias": 3, "head.weight": 4, "_orig_mod.module.tail.bias": 5}
    expected = {"body.weight": 1, "submodule.weight": 2, "submodule.bias": 3, "head.weight": 4,
                "tail.bias": 5}
    got = clean_state_dict(dict(saved))
    if got == expected:
        return None
    keys = list(got) if isinstance(got, dict) else []
    if "module.tail.bias" in keys:
        return ("torch.compile(DDP(model)) saves '_orig_mod.module.': the prefixes nest in the order "
                "of the wrapping, so remove them until none is left, whichever comes first")
    if any("_orig_mod." in key for key in keys):
        return "torch.compile's wrapper adds '_orig_mod.' as well, alone or after DDP's 'module.'"
    if any(key.startswith("sub") and not key.startswith("submodule.") for key in keys):
        return "a layer named 'submodule' lost part of its name: remove a prefix only at the start of a key"
    return f"expected the keys {sorted(expected)}, got {sorted(keys)}"


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


# ----------------------------------------------------------------------------- 10.12 compression

def _judge_ratio(fp16_bytes_ratio: Any) -> str | None:
    if isinstance(fp16_bytes_ratio, bool) or not isinstance(fp16_bytes_ratio, (int, float)):
        return "answer with a number: bytes per step with the fp16 hook / bytes with plain fp32"
    if abs(fp16_bytes_ratio - 0.5) < 1e-9:
        return None
    if abs(fp16_bytes_ratio - 1.0) < 1e-9:
        return "the hook casts each bucket before the all-reduce: fewer bytes travel"
    return "count the bytes of one gradient value: float32 has 4, float16 has 2"


EXERCISES = load_bank(__name__)
