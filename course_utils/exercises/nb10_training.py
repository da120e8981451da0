"""Exercises 10.5, 10.6, 10.7 and 10.9 of notebook 10 (training loops, checkpoints).

``nb10.EXERCISES`` lists them with the others.
Kept apart from ``nb10.py`` only so that no module passes 400 lines.
"""

from __future__ import annotations

from typing import Any

from .core import Exercise, run_on_ranks

__all__ = ["ACCUMULATION", "CLEAN_KEYS", "HANG_S", "JOIN", "NO_GRAD", "run_ranks"]

HANG_S = 4.0  # a rank function that has not finished by then is stuck


def run_ranks(fn: Any, world_size: int, *args: Any) -> tuple[list | None, str | None]:
    """:func:`run_on_ranks` with notebook 10's hang limit and hang hint."""
    return run_on_ranks(fn, world_size, *args, timeout_s=HANG_S, hang_hint=(
        "the ranks hung: one rank waited in a collective that another rank never called, or "
        "called in a different order"))


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


# ----------------------------------------------------------------------------- 10.5 Join

def _judge_join(train_my_shard: Any) -> str | None:
    from course_utils.debug_training import uneven_reference

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


JOIN = Exercise(
    key="10.5", kind="fix", title="uneven inputs: finish together", answer="train_my_shard",
    context='''\
from course_utils.debug_training import small_model, uneven_batches


def my_batches(rank):  # rank 0 has 3 batches, rank 1 has 2
    return uneven_batches([3, 2], rank)


def weights(model):
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
''',
    starter='''\
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD


def train_my_shard(rank, world_size):
    ddp_model = DDP(small_model())
    optimizer = SGD(ddp_model.parameters(), lr=0.1)
    for x, y in my_batches(rank):
        mse_loss(ddp_model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(ddp_model.module)
''',
    solution='''\
from torch.distributed.algorithms.join import Join
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD


def train_my_shard(rank, world_size):
    ddp_model = DDP(small_model())
    optimizer = SGD(ddp_model.parameters(), lr=0.1)
    with Join([ddp_model]):  # a rank that runs out of batches shadows the others' all-reduces
        for x, y in my_batches(rank):
            mse_loss(ddp_model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return weights(ddp_model.module)
''',
    judge=_judge_join,
    wrong=(('''\
from torch.distributed import barrier
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD


def train_my_shard(rank, world_size):
    ddp_model = DDP(small_model())
    optimizer = SGD(ddp_model.parameters(), lr=0.1)
    for x, y in my_batches(rank):
        mse_loss(ddp_model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    barrier()  # wait for the slow rank
    return weights(ddp_model.module)
''', "the ranks hung"), ('''\
from torch.nn.functional import mse_loss
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD


def train_my_shard(rank, world_size):
    ddp_model = DDP(small_model())
    optimizer = SGD(ddp_model.parameters(), lr=0.1)
    for x, y in my_batches(rank)[:1]:
        mse_loss(ddp_model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return weights(ddp_model.module)
''', "not with the weights")),
)


# ----------------------------------------------------------------------------- 10.6 accumulation

def _judge_accumulation(accumulation_step: Any) -> str | None:
    from course_utils.debug_training import accumulation_reference, train_accumulating

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


ACCUMULATION = Exercise(
    key="10.6", kind="fix", title="gradient accumulation with no_sync", answer="accumulation_step",
    starter='''\
from contextlib import nullcontext

from torch.nn.functional import mse_loss as loss_fn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i % k != 0 else nullcontext():
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
''',
    solution='''\
from contextlib import nullcontext

from torch.nn.functional import mse_loss as loss_fn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else nullcontext():  # sync the last
            loss = loss_fn(ddp_model(x), y) / k  # the mean over all k micro-batches
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
''',
    judge=_judge_accumulation,
    wrong=(('''\
from contextlib import nullcontext

from torch.nn.functional import mse_loss as loss_fn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i < k - 1 else nullcontext():
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
''', "k times the mean"), ('''\
from contextlib import nullcontext

from torch.nn.functional import mse_loss as loss_fn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync() if i % k != 0 else nullcontext():
            loss = loss_fn(ddp_model(x), y) / k
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
''', "different weights"), ('''\
from contextlib import nullcontext

from torch.nn.functional import mse_loss as loss_fn


def accumulation_step(ddp_model, optimizer, micro_batches):
    k = len(micro_batches)
    for x, y in micro_batches:
        with ddp_model.no_sync():
            loss = loss_fn(ddp_model(x), y) / k
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()
''', "different weights")),
)


# ----------------------------------------------------------------------------- 10.7 no gradient

def _judge_no_grad(params_without_grad: Any) -> str | None:
    import torch

    from course_utils.debug_training import TwoHeads

    torch.manual_seed(0)
    model = TwoHeads()
    loss = model(torch.randn(2, 4)).square().mean()
    got = sorted(params_without_grad(model, loss))
    expected = ["head_b.bias", "head_b.weight"]
    if got == expected:
        return None
    everything = sorted(name for name, _ in model.named_parameters())
    if got == everything:
        return "every parameter is listed: no gradient exists until backward has run"
    if got == sorted(set(everything) - set(expected)):
        return "those are the parameters that did get a gradient; list the others"
    return f"expected the names of the parameters whose .grad is still None after backward, got {got}"


NO_GRAD = Exercise(
    key="10.7", kind="implement", title="which parameters get no gradient?", answer="params_without_grad",
    starter='''\
def params_without_grad(model, loss):
    """Run backward on loss and return the names of model's parameters that got no gradient."""
    raise NotImplementedError
''',
    solution='''\
def params_without_grad(model, loss):
    """Run backward on loss and return the names of model's parameters that got no gradient."""
    loss.backward()
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
''',
    judge=_judge_no_grad,
    wrong=(('''\
def params_without_grad(model, loss):
    return [name for name, p in model.named_parameters() if p.grad is None]
''', "until backward has run"), ('''\
def params_without_grad(model, loss):
    loss.backward()
    return [name for name, p in model.named_parameters() if p.grad is not None]
''', "did get a gradient")),
)


# ----------------------------------------------------------------------------- 10.9 prefixes

def _judge_clean_keys(clean_state_dict: Any) -> str | None:
    saved = {"module._orig_mod.body.weight": 1, "_orig_mod.submodule.weight": 2,
             "module.submodule.bias": 3, "head.weight": 4}
    expected = {"body.weight": 1, "submodule.weight": 2, "submodule.bias": 3, "head.weight": 4}
    got = clean_state_dict(dict(saved))
    if got == expected:
        return None
    keys = list(got) if isinstance(got, dict) else []
    if any("_orig_mod." in key for key in keys):
        return "torch.compile's wrapper adds '_orig_mod.' as well, alone or after DDP's 'module.'"
    if any(key.startswith("sub") and not key.startswith("submodule.") for key in keys):
        return "a layer named 'submodule' lost part of its name: remove a prefix only at the start of a key"
    return f"expected the keys {sorted(expected)}, got {sorted(keys)}"


CLEAN_KEYS = Exercise(
    key="10.9", kind="fix", title="load a checkpoint saved from a wrapper", answer="clean_state_dict",
    starter='''\
def clean_state_dict(state_dict):
    return {key.replace("module.", ""): value for key, value in state_dict.items()}
''',
    solution='''\
def clean_state_dict(state_dict):
    cleaned = {}
    for key, value in state_dict.items():
        while key.startswith(("module.", "_orig_mod.")):  # DDP's and torch.compile's, any order
            key = key.split(".", 1)[1]
        cleaned[key] = value
    return cleaned
''',
    judge=_judge_clean_keys,
    wrong=(('''\
def clean_state_dict(state_dict):
    return {key.removeprefix("module."): value for key, value in state_dict.items()}
''', "'_orig_mod.'"), ('''\
def clean_state_dict(state_dict):
    return {key.replace("module.", "").replace("_orig_mod.", ""): value
            for key, value in state_dict.items()}
''', "only at the start")),
)
