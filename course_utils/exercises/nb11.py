"""Judges of the exercises of notebook 11 (choosing a strategy); their content is in nb11.toml."""

from __future__ import annotations

import math
from typing import Any

from .answers import NOT_A_NUMBER, real
from .core import load_bank

__all__ = ["CASES", "EXERCISES"]


#: 11.1's numbers of ranks: 2 is the harness's, where keeping 1/n and keeping (n-1)/n of the
#: moments agree; the others part them, and the rules of the other strategies
ZERO1_RANKS = (1, 2, 3, 4, 8, 64)


def _zero1(n: int) -> float:
    """Per parameter a DDP process keeps four fp32 tensors (the parameter, its gradient, AdamW's
    two moments); a ZeRO-1 process keeps the first two whole and 1/n of the moments, on average."""
    return (1 + 1 + 2 / n) / 4


#: wrong rules learners write -> the hint each one gets, the first that matches at every n
_ZERO1_WRONG = [
    (lambda n: 1 / n, "that is what an FSDP process keeps, which splits everything; ZeRO-1 splits "
                      "only AdamW's state"),
    (lambda n: (1 + 3 / n) / 4,
     "that splits the gradients too (ZeRO-2): ZeRO-1 splits only AdamW's state"),
    (lambda n: 1.0,
     "a ZeRO-1 process holds less than a DDP process: AdamW's state is split between the ranks"),
    (lambda n: (1 + 1 + 2 * (n - 1) / n) / 4,
     "right for two ranks only: with more ranks, each one keeps the moments of a smaller share of the "
     "parameters, not a larger one"),
    (lambda n: (1 + 1 + 1 + 1 / n) / 4,
     "AdamW's state is both moments: each rank keeps its share of each of them"),
    (lambda n: n * _zero1(n), "that adds up the n processes: the question asks for one process, on average"),
    (lambda n: (1 + 1 + 2 / (2 * n)) / 4, "what ZeRO-1 splits is split n ways, one share per rank"),
]


def _judge_zero1_fraction(answer: Any) -> str | None:
    if not callable(answer):
        return (f"write a function of n (a lambda, as shipped), not {type(answer).__name__}: the check "
                "tries several numbers of ranks")
    got = []
    for n in ZERO1_RANKS:
        value = answer(n)
        if value is Ellipsis:
            raise NotImplementedError  # the answer cell as shipped
        number = real(value)
        if number is None:
            return f"your function must return one number for each n: {NOT_A_NUMBER}"
        got.append(number)

    def matches(rule: Any) -> bool:
        return all(math.isclose(v, rule(n), rel_tol=1e-3, abs_tol=1e-9)
                   for v, n in zip(got, ZERO1_RANKS, strict=True))

    if matches(_zero1):
        return None
    for rule, hint in _ZERO1_WRONG:
        if matches(rule):
            return hint
    if len(set(got)) == 1:
        return "your function gives the same fraction for every n: what ZeRO-1 splits depends on the ranks"
    if any(v > 1 or v < 0 for v in got):
        return "a fraction of a DDP process's state: a number between 0 and 1, for every n"
    return ("count the tensors a DDP process keeps for every parameter, then which of them ZeRO-1 "
            "splits between its n ranks")


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
# accounting of notebook 11's ledger (sharding.BYTES_PER_PARAMETER["autocast"]): parameters,
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


# two rules that part from the right one only where the model state sits just under the limit
_PARAMETERS_TWICE = {  # ZeRO-2 counting the whole parameters and a share of them again
    "ddp": lambda psi, n: 16 * psi,
    "zero2": lambda psi, n: 4 * psi + 16 * psi / n,
    "fsdp": lambda psi, n: 16 * psi / n,
}
_DDP_20 = {  # DDP at 20 bytes per parameter: a master copy beside parameters that are already fp32
    "ddp": lambda psi, n: 20 * psi,
    "zero2": lambda psi, n: 4 * psi + (4 + 8) * psi / n,
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
    (38e9, 80e9, 8, 10e9),  # none: FSDP's 76 GB of state fits only without the activations
    (12e9, 80e9, 8, 10e9),  # zero2 at 76 GB; counting the parameters twice (82 GB) says fsdp
    (4e9, 80e9, 8, 10e9),  # ddp at 74 GB; 20 bytes per parameter (90 GB) says zero2
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
        if got == _choose(psi, gpu, n, 0.0):
            return (f"{call} gave {got!r}: the model state fits there, but the activations need room too: "
                    "add them to every strategy's bytes")
        if got == _choose(*args, state_bytes=_MASTER_WEIGHTS):
            return (f"{call} gave {got!r}: that counts 2-byte parameters and gradients beside an fp32 "
                    "master copy, DeepSpeed's and Apex O2's accounting; with torch.autocast or FSDP2's "
                    "mixed precision the parameters and their gradients stay fp32")
        if got == _choose(*args, state_bytes=_PARAMETERS_TWICE):
            return (f"{call} gave {got!r}: your ZeRO-2 figure counts the parameters twice, whole on every "
                    "GPU and again in each GPU's share: ZeRO-2 keeps them whole and splits only the "
                    "gradients and AdamW's state")
        if got == _choose(*args, state_bytes=_DDP_20):
            return (f"{call} gave {got!r}: your DDP figure is more than 16 bytes per parameter: with "
                    "torch.autocast the fp32 parameters are the only copy, there is no master copy beside "
                    "them")
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
    "11.1": [f"ZeRO-1 against DDP on {n} rank(s), AdamW in fp32" for n in ZERO1_RANKS],
    "11.2": ["DDP on 2 ranks, a narrower model and fewer rows per step"],
    "11.3": [f"{_call(args)}: parameters, GPU bytes, GPUs, activation bytes" for args in _CASES],
}

EXERCISES = load_bank(__name__)
