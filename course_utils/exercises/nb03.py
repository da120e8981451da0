"""Judges of the exercises of notebook 03 (DataParallel by hand); their content is in nb03.toml."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..splits import split_sizes
from .core import load_bank

__all__ = ["EXERCISES"]


def _judge_gru(answer: Any) -> str | None:
    from ..models import SequenceGRU
    from ..simulated import sim_devices

    torch.manual_seed(0)
    gru = SequenceGRU()
    seq = torch.randn(8, 4, 6)  # (time, batch, features)
    seen: list[tuple[int, ...]] = []
    with torch.no_grad():
        out, h_n = gru(seq)
        # a replica shares its hooks with the original: this records every replica's input
        hook = gru.register_forward_hook(lambda module, inputs, output: seen.append(tuple(inputs[0].shape)))
        try:
            returned = answer(gru, seq, sim_devices(2))
        except RuntimeError as err:
            first = (str(err).strip().splitlines() or [""])[0]
            return (f"a replica failed: {first} Each one got only some of the 6 features of "
                    "every step, so the axis you cut is not the batch")
        finally:
            hook.remove()
    if not (isinstance(returned, tuple) and len(returned) == 2):
        return "return what the GRU returns: (output, h_n)"
    got_out, got_h = returned
    if got_out.shape != out.shape:
        return (f"the output has shape {list(got_out.shape)} instead of {list(out.shape)}: the input must "
                "reach each replica as (time, batch, features), a few whole sequences each")
    if got_h.shape != h_n.shape:
        return (f"h_n has shape {list(got_h.shape)} instead of {list(h_n.shape)}: the replicas' final "
                "hidden states were stacked along the layers axis, so the batch was not the axis you cut")
    if not (torch.allclose(got_out, out, atol=1e-6) and torch.allclose(got_h, h_n, atol=1e-6)):
        return ("the shapes are right but the values are not: some replica saw only part of each "
                "sequence; cut the axis that holds the batch of a sequence-first GRU")
    if len(seen) < 2:
        return ("the numbers are right, but the GRU ran once, on the whole batch: nothing was split "
                "over the devices")
    if any(shape != (8, 2, 6) for shape in seen):
        return (f"the numbers are right, but the replicas saw inputs of shapes {seen}: each device should "
                "get its own few whole sequences")
    return None


def _judge_strip(answer: Any) -> str | None:
    w, b, inner = torch.ones(2, 2), torch.zeros(2), torch.full((3,), 2.0)
    wrapped = {"module.block1.weight": w, "module.block1.bias": b, "module.block2.module.weight": inner}
    before = dict(wrapped)
    got = answer(wrapped)
    if not isinstance(got, dict):
        return f"return a dict (a state_dict), not {type(got).__name__}"
    if wrapped != before:
        return "the checkpoint you were given changed: build a new dict and leave the argument as it was"
    if "block2.weight" in got or "block2.module.weight" not in got:
        return ("'module.block2.module.weight' lost an inner 'module.' too: a model that wraps one of its "
                "blocks keeps that name; remove the prefix at the start of a key only")
    if set(got) != {"block1.weight", "block1.bias", "block2.module.weight"}:
        return f"the keys came out as {sorted(got)}: remove exactly the leading 'module.' of each key"
    if not (got["block1.weight"] is w and got["block2.module.weight"] is inner):
        return "keep the same tensors under the new names (no copies, no changes to their values)"
    plain = {"fc.weight": w, "modules.bias": b, "block2.module.weight": inner}
    kept = answer(dict(plain))
    if not isinstance(kept, dict) or set(kept) != set(plain):
        keys = sorted(kept) if isinstance(kept, dict) else kept
        if isinstance(kept, dict) and "s.bias" in kept:
            return ("'modules.bias' lost its first letters: str.lstrip removes any of the characters "
                    "it is given, from the left, not a prefix")
        return (f"a checkpoint without the prefix came back with keys {keys}: only keys that "
                "start with 'module.' change (loading a plain checkpoint must still work)")
    return None


def _judge_weights(answer: Any) -> str | None:
    if not isinstance(answer, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in answer):
        return f"write a list of numbers, one weight per returned loss, not {answer!r}"
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
