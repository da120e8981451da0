"""Exercises of notebook 07 (choosing a strategy), with their reference solutions."""

from __future__ import annotations

from typing import Any

from .core import Exercise

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
    if not callable(answer):
        return f"choose_strategy must stay a function, got {type(answer).__name__}"
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


_CHOOSE_STARTER = '''def choose_strategy(parameters, gpu_bytes, gpus, activation_bytes):
    """"ddp", "zero2" or "fsdp": the first, in that order, whose bytes per GPU fit in gpu_bytes
    under mixed-precision Adam (2-byte parameters and gradients, K = 12 bytes of state per
    parameter), activations included; "none" if even FSDP does not fit."""
    raise NotImplementedError
'''

EXERCISES = [
    Exercise(
        key="07.1",
        kind="predict",
        title="DDP's advantage on a smaller job",
        answer="ddp_advantage_on_small",
        starter='ddp_advantage_on_small = ...  # "grow" or "shrink"\n',
        solution='ddp_advantage_on_small = "shrink"  # less compute per step, the same fixed costs\n',
        judge=_judge_small,
        wrong=(('ddp_advantage_on_small = "grow"', "fixed costs"),
               ('ddp_advantage_on_small = "same"', "the ratio moves")),
    ),
    Exercise(
        key="07.2",
        kind="predict",
        title="FSDP's model state against DDP's",
        answer="fsdp_fraction",
        starter="fsdp_fraction = ...  # fsdp_2's model state per process / ddp_2's\n",
        solution="fsdp_fraction = 0.5  # every tensor split over 2 ranks\n",
        judge=_judge_fsdp_fraction,
        wrong=(("fsdp_fraction = 0.75", "is ZeRO-1 (zero1_2)"),
               ("fsdp_fraction = 0.25", "not in four"),
               ("fsdp_fraction = 1.0", "FSDP is ZeRO-3")),
    ),
    Exercise(
        key="07.3",
        kind="implement",
        title="the decision guide's memory rule",
        answer="choose_strategy",
        starter=_CHOOSE_STARTER,
        solution='''def choose_strategy(parameters, gpu_bytes, gpus, activation_bytes):
    """See the question."""
    per_gpu = {
        "ddp": 16 * parameters,
        "zero2": 2 * parameters + (2 + 12) * parameters / gpus,
        "fsdp": 16 * parameters / gpus,
    }
    for strategy, state in per_gpu.items():
        if state + activation_bytes <= gpu_bytes:
            return strategy
    return "none"
''',
        judge=_judge_choose,
        wrong=(('''def choose_strategy(parameters, gpu_bytes, gpus, activation_bytes):
    for strategy, state in (("ddp", 16 * parameters), ("zero2", 2 * parameters + 14 * parameters / gpus),
                            ("fsdp", 16 * parameters / gpus)):
        if state <= gpu_bytes:
            return strategy
    return "none"
''', "the activations need room too"),
               ('''def choose_strategy(parameters, gpu_bytes, gpus, activation_bytes):
    for strategy, state in (("ddp", 16 * parameters), ("zero2", 4 * parameters + 12 * parameters / gpus),
                            ("fsdp", 16 * parameters / gpus)):
        if state + activation_bytes <= gpu_bytes:
            return strategy
    return "none"
''', "that is ZeRO-1's figure"),
               ('''def choose_strategy(parameters, gpu_bytes, gpus, activation_bytes):
    for strategy, state in (("fsdp", 16 * parameters / gpus),
                            ("zero2", 2 * parameters + 14 * parameters / gpus), ("ddp", 16 * parameters)):
        if state + activation_bytes <= gpu_bytes:
            return strategy
    return "none"
''', "DDP first")),
    ),
]
