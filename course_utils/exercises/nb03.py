"""Judges of the exercises of notebook 03 (DataParallel by hand); their content is in nb03.toml."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..dataparallel.splits import split_sizes
from .answers import reals
from .core import changed, load_bank, snapshot

__all__ = ["CASES", "EXERCISES"]

#: 03.1's (time steps, batch, indices of the simulated devices given)
_GRU_RUNS = [(8, 4, (0, 1)), (5, 7, (1, 3, 4)), (3, 10, (0, 1, 2, 3))]
#: 03.2's checkpoints: their keys
_CHECKPOINTS = [
    ("a wrapped model's, one of whose blocks wraps a module of its own",
     ("module.block1.weight", "module.block1.bias", "module.block2.module.weight")),
    ("a plain model's ('module' inside a key, 'modules.' at the start of one)",
     ("fc.weight", "modules.bias", "block2.module.weight")),
]

CASES: dict[str, list[str]] = {
    "03.1": [f"{t} steps, a batch of {b} on {', '.join(f'sim:{i}' for i in d)}" for t, b, d in _GRU_RUNS],
    "03.2": [f"the checkpoint of {label}" for label, _ in _CHECKPOINTS],
    "03.3": ["a batch of 10 rows on 4 devices"],
}


def _judge_gru(answer: Any) -> str | None:
    for steps, batch, indices in _GRU_RUNS:
        hint = _gru_run(answer, steps, batch, indices)
        if hint:
            return hint
    return None


def _gru_run(answer: Any, steps: int, batch: int, indices: tuple[int, ...]) -> str | None:
    import threading

    from ..dataparallel.simulated import SimDevice
    from ..models import SequenceGRU

    torch.manual_seed(0)
    gru = SequenceGRU()
    seq = torch.randn(steps, batch, 6)  # (time, batch, features)
    given = snapshot(seq)
    devices = [SimDevice(i) for i in indices]
    ran: list[tuple[str, tuple[int, ...]]] = []  # (thread, input shape) of every forward of a replica

    def record(module: Any, inputs: Any, output: Any) -> None:
        ran.append((threading.current_thread().name, tuple(inputs[0].shape)))

    with torch.no_grad():
        out, h_n = gru(seq)
        # a replica shares its hooks with the original: this records every replica's input
        hook = gru.register_forward_hook(record)
        try:
            returned = answer(gru, seq, devices)
        except RuntimeError as err:
            first = (str(err).strip().splitlines() or [""])[0]
            return (f"a replica failed: {first} Each one got only some of the 6 features of "
                    "every step, so the axis you cut is not the batch")
        finally:
            hook.remove()
    if changed(seq, given):
        return "the input you were given changed in place: leave it as it was"
    if not (isinstance(returned, tuple) and len(returned) == 2):
        return "return what the GRU returns: (output, h_n)"
    got_out, got_h = returned
    if got_out.dim() == 3 and (got_out.shape[0], got_out.shape[2]) == (steps, out.shape[2]) \
            and got_out.shape[1] < batch:
        return (f"the output holds {got_out.shape[1]} of the {batch} sequences: every sequence of the batch "
                "goes to one device or another, whatever the batch size")
    if got_out.shape != out.shape:
        return (f"the output has shape {list(got_out.shape)} instead of {list(out.shape)}: the input must "
                "reach each replica as (time, batch, features), a few whole sequences each")
    if got_h.shape != h_n.shape:
        return (f"h_n has shape {list(got_h.shape)} instead of {list(h_n.shape)}: the replicas' final "
                "hidden states were stacked along the layers axis, so the batch was not the axis you cut")
    if not (torch.allclose(got_out, out, atol=1e-6) and torch.allclose(got_h, h_n, atol=1e-6)):
        return ("the shapes are right but the values are not: some replica saw only part of each "
                "sequence; cut the axis that holds the batch of a sequence-first GRU")
    if len(ran) < 2:
        return ("the numbers are right, but the GRU ran once, on the whole batch: nothing was split "
                "over the devices")
    # each replica runs in a thread named after its device ("replica-1-sim:3"); the caller's is not
    where = [name.split("-", 2)[2] if name.startswith("replica-") else None for name, _ in ran]
    sizes = split_sizes(batch, len(devices))
    wanted = [str(d) for d in devices[:len(sizes)]]
    if None in where:
        return ("the numbers are right, but the GRU ran in your own code, on none of the devices you were "
                "given: each device gets a replica, and each replica its few whole sequences")
    if sorted(where) != sorted(wanted):
        return (f"the numbers are right, but the replicas ran on {sorted(set(where))} while the devices "
                f"given were {[str(d) for d in devices]}: spread the batch over the devices you are given")
    if sorted(shape for _, shape in ran) != sorted((steps, n, 6) for n in sizes):
        return (f"the numbers are right, but the replicas saw inputs of shapes {[s for _, s in ran]}: each "
                "device should get its own few whole sequences")
    return None


def _judge_strip(answer: Any) -> str | None:
    for _, keys in _CHECKPOINTS:
        tensors = [torch.full((2,), float(i)) for i in range(len(keys))]
        given = dict(zip(keys, tensors, strict=True))
        before = snapshot(given)
        got = answer(given)
        if not isinstance(got, dict):
            return f"return a dict (a state_dict), not {type(got).__name__}"
        if changed(given, before):
            return "the checkpoint you were given changed: build a new dict and leave the argument as it was"
        want = {key.removeprefix("module."): tensor for key, tensor in zip(keys, tensors, strict=True)}
        if set(got) != set(want):
            return _strip_hint(keys, got)
        if any(got[key] is not tensor for key, tensor in want.items()):
            return "keep the same tensors under the new names (no copies, no changes to their values)"
    return None


def _strip_hint(keys: tuple[str, ...], got: dict) -> str:
    if "s.bias" in got:
        return ("'modules.bias' lost its first letters: str.lstrip removes any of the characters "
                "it is given, from the left, not a prefix")
    if keys[0].startswith("module."):
        if "block2.weight" in got or "block2.module.weight" not in got:
            return ("'module.block2.module.weight' lost an inner 'module.' too: a model that wraps one of "
                    "its blocks keeps that name; remove the prefix at the start of a key only")
        return f"the keys came out as {sorted(got)}: remove exactly the leading 'module.' of each key"
    return (f"a checkpoint without the prefix came back with keys {sorted(got)}: only keys that "
            "start with 'module.' change (loading a plain checkpoint must still work)")


def _judge_weights(answer: Any) -> str | None:
    weights = reals(answer) if not isinstance(answer, (str, bytes)) else None
    if weights is None:
        return f"write a list of numbers, one weight per returned loss, not {answer!r}"
    answer = weights
    sizes = split_sizes(10, 4)  # torch.chunk's pieces: what each replica's loss averages over
    even = [10 // 4 + (1 if i < 10 % 4 else 0) for i in range(4)]  # torch.tensor_split's

    def matches(shares: list[float]) -> bool:
        return len(answer) == len(shares) and all(
            math.isclose(a, s, abs_tol=1e-6) for a, s in zip(answer, shares, strict=True))

    if len(answer) != len(sizes):
        return (f"you gave {len(answer)} weights; count the chunks first: every loss a replica "
                "returns needs one weight")
    if matches([s / 10 for s in sizes]):
        return None
    if all(math.isclose(a, answer[0], abs_tol=1e-6) for a in answer):
        return ("you averaged the chunk losses without weighting them by chunk size: the short chunk "
                "would count as much as a full one")
    if matches([float(s) for s in sizes]):
        return ("those are the chunk sizes: summed with these weights, four means make far more than "
                "the batch's mean. What must the weights of a mean add up to?")
    if matches([s / 10 for s in even]):
        return ("those are the shares of the most even split; DataParallel's chunks are "
                "torch.chunk's, cut the way notebook 02 showed")
    if matches([s / 10 for s in reversed(sizes)]):
        return ("the shares are right but not their order: device 0 gets the first chunk, the short one "
                "is last")
    if not math.isclose(sum(answer), 1.0, abs_tol=1e-6):
        return f"your weights add up to {sum(answer):g}; the weights of a mean add up to 1"
    return "each returned loss is a mean over its own chunk: how much of the batch does each chunk hold?"


EXERCISES = load_bank(__name__)
