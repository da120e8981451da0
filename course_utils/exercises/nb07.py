"""Judges of the exercises of notebook 07 (choosing a strategy); their content is in nb07.toml."""

from __future__ import annotations

from typing import Any

from .core import load_bank

__all__ = ["EXERCISES"]


def _judge_small(answer: Any) -> str | None:
    if not isinstance(answer, str) or answer.strip().lower() not in ("grow", "shrink", "same"):
        return f'answer "grow", "shrink" or "same", not {answer!r}'
    answer = answer.strip().lower()
    if answer == "shrink":
        return None
    if answer == "grow":
        return ("a narrower model and fewer rows mean much less compute per step, while each step "
                "still pays fixed costs (a barrier, starting the all-reduce): which way does that push "
                "the ratio?")
    return "the compute per step falls far more than the communication: the ratio moves"


def _judge_fsdp_fraction(answer: Any) -> str | None:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"write a fraction such as 0.3, not {type(answer).__name__}"
    if abs(answer - 0.5) < 0.01:
        return None
    if abs(answer - 0.25) < 0.01:
        return "fsdp_2 has two ranks: each tensor is split in two, not in four"
    if abs(answer - 0.75) < 0.01:
        return ("splitting only AdamW's two moments is ZeRO-1 (zero1_2); FSDP splits the parameters "
                "and the gradients as well")
    if abs(answer - 1.0) < 0.01:
        return "FSDP is ZeRO-3: every rank keeps only its shard of the parameters, gradients and moments"
    return "count four tensors per parameter (parameter, gradient, two moments) and how FSDP splits each"


_CASES = [  # (parameters, gpu bytes, gpus, activation bytes) -> strategy
    ((1e9, 80e9, 8, 10e9), "ddp"),
    ((7e9, 80e9, 8, 10e9), "zero2"),
    ((30e9, 80e9, 8, 10e9), "fsdp"),
    ((70e9, 80e9, 8, 10e9), "none"),
    ((4e9, 80e9, 8, 30e9), "zero2"),  # the model state alone would fit DDP, not with the activations
    ((15e9, 80e9, 8, 10e9), "zero2"),  # fits ZeRO-2 (66 GB), not ZeRO-1 (92.5 GB)
]


def _judge_choose(answer: Any) -> str | None:
    for args, right in _CASES:
        got = answer(*args)
        if got == right:
            continue
        psi, gpu, n, act = args
        if right == "zero2" and got == "ddp" and 16 * psi <= gpu:
            return "the model state fits DDP here, but the activations need room too: add them"
        if right == "zero2" and got in ("fsdp", "none") and 4 * psi + 12 * psi / n + act > gpu:
            return ("that is ZeRO-1's figure: ZeRO-2 shards the gradients too, so each rank holds "
                    "2Ψ + (2 + 12)Ψ/N")
        if right == "fsdp" and got == "none":
            return "ZeRO-3 (FSDP) shards everything: 16Ψ/N per rank, plus the activations"
        if got == "fsdp" and right == "ddp":
            return "prefer the strategy that sends the least when it fits: DDP first, FSDP last"
        return (f"choose_strategy{args} gave {got!r}: try each strategy from DDP to FSDP and keep the first "
                f"whose bytes per GPU (16 bytes per parameter in all, split as the stage says, plus "
                f"the activations) fit")
    return None


EXERCISES = load_bank(__name__)
