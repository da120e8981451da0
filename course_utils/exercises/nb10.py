"""Judges of the exercises of notebook 10 (choosing a strategy); their content is in nb10.toml."""

from __future__ import annotations

from typing import Any

from .core import load_bank

__all__ = ["CASES", "EXERCISES"]


def _judge_zero1_fraction(answer: Any) -> str | None:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"write a fraction such as 0.3, not {type(answer).__name__}"

    def near(value: float) -> bool:
        return abs(answer - value) < 0.01

    # per parameter: the parameter, its gradient and AdamW's two moments, fp32 each; zero1_2 keeps
    # the first two whole and half of the moments
    if near((1 + 1 + 2 / 2) / 4):
        return None
    if near(0.5):
        return ("that is what an fsdp_2 process keeps, which splits everything; zero1_2 splits only "
                "AdamW's state")
    if near(0.625):
        return "that splits the gradients too (ZeRO-2): zero1_2 splits only AdamW's state"
    if near(1.0):
        return "a zero1_2 process holds less than a ddp_2 process: AdamW's state is split between the ranks"
    if near(0.25) or near(0.375):
        return "zero1_2 has two ranks: what it splits is split in two, not in four"
    if near(0.875):
        return "AdamW's state is both moments: each rank keeps half of each of them"
    if answer > 1:
        return "a fraction of ddp_2's state: a number between 0 and 1"
    return ("count the tensors a ddp_2 process keeps for every parameter, then which of them zero1_2 "
            "splits between its two ranks")


_SYNONYMS = {"shrink": "shrink", "shrinks": "shrink", "smaller": "shrink", "decrease": "shrink",
             "decreases": "shrink", "grow": "grow", "grows": "grow", "larger": "grow", "increase": "grow",
             "increases": "grow", "same": "same", "unchanged": "same"}


def _judge_small(answer: Any) -> str | None:
    word = _SYNONYMS.get(answer.strip().lower()) if isinstance(answer, str) else None
    if word is None:
        return f'answer "grow", "shrink" or "same", not {answer!r}'
    if word == "shrink":
        return None
    if word == "grow":
        return ("a narrower model and fewer rows mean much less compute per step, while each step "
                "still pays fixed costs (a barrier, starting the all-reduce): which way does that push "
                "the ratio?")
    return "the compute per step falls far more than the communication: the ratio moves"


# bytes per GPU of the model state under AdamW with torch.autocast or FSDP2's mixed precision, the
# accounting of notebook 10's ledger (sharding.BYTES_PER_PARAMETER["autocast"]): parameters,
# gradients and both moments stay fp32, 4 + 4 + 8 bytes per parameter
_STATE = {
    "ddp": lambda psi, n: 16 * psi,
    "zero2": lambda psi, n: 4 * psi + (4 + 8) * psi / n,
    "fsdp": lambda psi, n: 16 * psi / n,
}
# DeepSpeed's and Apex O2's accounting (16-bit parameters and gradients, an fp32 master copy
# beside the moments: 2 + 2 + 12): a wrong answer here, since the course's recipe keeps fp32
_MASTER_WEIGHTS = {
    "ddp": lambda psi, n: 16 * psi,
    "zero2": lambda psi, n: 2 * psi + (2 + 12) * psi / n,
    "fsdp": lambda psi, n: 16 * psi / n,
}


def _choose(parameters: float, gpu_bytes: float, gpus: int, activation_bytes: float,
            state_bytes: dict = _STATE) -> str:
    return next((s for s, state in state_bytes.items()
                 if state(parameters, gpus) + activation_bytes <= gpu_bytes), "none")


_CASES = [  # (parameters, gpu bytes, gpus, activation bytes)
    (1e9, 80e9, 8, 10e9),  # ddp
    (7e9, 80e9, 8, 10e9),  # zero2
    (30e9, 80e9, 8, 10e9),  # fsdp
    (70e9, 80e9, 8, 10e9),  # none
    (4e9, 80e9, 8, 30e9),  # zero2: the model state alone would fit DDP, not with the activations
    (10e9, 80e9, 8, 10e9),  # zero2: fits ZeRO-2 (65 GB), not ZeRO-1 (100 GB)
    (15e9, 80e9, 8, 10e9),  # fsdp: ZeRO-2 needs 92.5 GB here (66.25 GB with a 2-byte master-copy count)
    (3e9, 40e9, 8, 5e9),  # zero2 on a 40 GB GPU
    (10e9, 80e9, 2, 10e9),  # none on 2 GPUs
    (40e9, 80e9, 64, 10e9),  # fsdp on 64 GPUs
]


def _call(args: tuple) -> str:
    """choose_strategy(10e9, 80e9, 2, 10e9), as a learner would write it."""
    return "choose_strategy(" + ", ".join(f"{a / 1e9:g}e9" if a >= 1e9 else str(a) for a in args) + ")"


def _judge_choose(answer: Any) -> str | None:
    for args in _CASES:
        right = _choose(*args)
        got = answer(*args)
        if got == right:
            continue
        psi, gpu, n, act = args
        call = _call(args)
        if right == "zero2" and got == "ddp" and _STATE["ddp"](psi, n) <= gpu:
            return "the model state fits DDP here, but the activations need room too: add them"
        if got == _choose(*args, state_bytes=_MASTER_WEIGHTS):
            return (f"{call} gave {got!r}: that counts 2-byte parameters and gradients beside an fp32 "
                    "master copy, DeepSpeed's and Apex O2's accounting; with torch.autocast or FSDP2's "
                    "mixed precision the parameters and their gradients stay fp32")
        if right == "zero2" and got in ("fsdp", "none") and 8 * psi + 8 * psi / n + act > gpu:
            return ("your ZeRO-2 figure is ZeRO-1's: stage 2 shards more than the optimizer's state, "
                    "so it fits here")
        if got == _choose(psi, 80e9, n, act) and gpu != 80e9:
            return f"{call} gave {got!r}, as if every GPU had 80 GB: use gpu_bytes"
        if got == _choose(psi, gpu, 8, act) and n != 8:
            return f"{call} gave {got!r}, as if there were 8 GPUs: use gpus"
        if right == "fsdp" and got == "none":
            return (f"{call} gave 'none', but FSDP fits there: recount what each GPU "
                    "keeps once everything is sharded")
        if got == "fsdp" and right in ("ddp", "zero2"):
            return "prefer the strategy that sends the least when it fits: DDP first, FSDP last"
        return (f"{call} gave {got!r}: work out each strategy's bytes per GPU in turn, "
                "from DDP to FSDP, activations included, and keep the first that fits")
    return None


CASES: dict[str, list[str]] = {
    "10.1": ["zero1_2 against ddp_2, AdamW in fp32"],
    "10.2": ["DDP on 2 ranks, a narrower model and fewer rows per step"],
    "10.3": [f"{_call(args)}: parameters, GPU bytes, GPUs, activation bytes" for args in _CASES],
}

EXERCISES = load_bank(__name__)
