"""The judge of exercise 10.4 (bytes one rank sends between nodes under HSDP), a function of psi,
nodes and gpus tried on several clusters against the ring model's count; its content is in
nb10.toml, and nb10 names it."""

from __future__ import annotations

import math
import os
from typing import Any

from .answers import NOT_A_NUMBER, real
from .evidence import calls_recorded

__all__ = ["CLUSTERS", "hsdp_between", "judge_between_nodes"]

CLUSTERS = [(10**9, 2, 8), (10**9, 4, 8), (7 * 10**9, 16, 8), (10**8, 3, 4), (1732, 2, 2), (10**9, 1, 8)]


def hsdp_between(psi: float, nodes: int, gpus: int) -> float:
    """fp32 gradients: each rank's shard (the model split over a node's GPUs) all-reduced over
    the replicate group, one rank per node, in a ring."""
    return 2 * (4 * psi / gpus) * (nodes - 1) / nodes


#: wrong formulas learners write -> the hint each one gets
_BETWEEN_WRONG = [
    (lambda p, n, g: 3 * 4 * p * (n * g - 1) / (n * g),
     "that is FSDP over all the ranks, whose every collective spans the nodes: under HSDP the "
     "parameters are gathered inside the node, and only gradients leave it"),
    (lambda p, n, g: 2 * 4 * p * (n - 1) / n,
     "that is G times one rank's bytes: a whole gradient all-reduced between nodes, which is what the G "
     "ranks of a node send together; one rank all-reduces only what is left of its gradient once the "
     "ranks of its node have reduce-scattered it"),
    (lambda p, n, g: 3 * 4 * p * (g - 1) / g + hsdp_between(p, n, g),
     "that adds what the rank sends inside its node: count only the collectives whose group spans nodes"),
    (lambda p, n, g: 3 * 4 * p * (g - 1) / g,
     "that is what stays inside the node: the reduce-scatter and all-gathers run on the shard group"),
    (lambda p, n, g: 2 * (4 * p / g) * (n * g - 1) / (n * g),
     "that is a ring over every rank (DDP's figure per GPU): the all-reduce between nodes runs on the "
     "replicate group: how many ranks are in it?"),
    (lambda p, n, g: 2 * (4 * p / g) * (g - 1) / g,
     "the all-reduce between nodes runs on the replicate group: how many ranks are in it?"),
    (lambda p, n, g: 2 * (4 * p / (n * g)) * (n - 1) / n,
     "a rank's shard is the model split over the GPUs of its node, not over every rank"),
    (lambda p, n, g: (4 * p / g) * (n - 1) / n,
     "that is half of it: either one half of the all-reduce (it is a reduce-scatter followed by an "
     "all-gather, notebook 05: count what both halves send) or 2-byte gradients (these are fp32, 4 bytes "
     "each)"),
    (lambda p, n, g: 2 * (p / g) * (n - 1) / n,
     "that counts gradient elements: the question asks for bytes, and an fp32 element is 4 of them"),
    (lambda p, n, g: 2 * (4 * p / g),
     "in a ring a rank never sends its own share back to itself: try your function with one node, "
     "where nothing crosses between nodes"),
    (lambda p, n, g: 2 * 4 * p * (n - 1),
     "that is what crosses summed over all N·G ranks: the question asks what one rank sends"),
    (lambda p, n, g: 4 * p / g * (n - 1),
     "that agrees on 2 nodes only: how much of its tensor does one rank send in a ring all-reduce "
     "over N ranks (notebook 05)? Try your function with 4 nodes"),
    (lambda p, n, g: 2 * 4 * p / g / n,
     "that agrees on 2 nodes only: how much of its tensor does one rank send in a ring all-reduce "
     "over N ranks (notebook 05)? Try your function with 4 nodes"),
]


#: the folder of the course's ledgers, whose formulas an answer must not call for the number
_LEDGERS = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "sharding", "")


def _calls_the_ledgers(ran: set) -> bool:
    """Whether a function of ``course_utils.sharding`` ran (``calls_recorded``), however it was reached."""
    files = {code.co_filename for code in ran if hasattr(code, "co_filename")}
    return any(os.path.realpath(f).startswith(_LEDGERS) for f in files)


def judge_between_nodes(answer: Any) -> str | None:
    if not callable(answer):
        return (f"write a function of psi, nodes and gpus (a lambda, as shipped), not "
                f"{type(answer).__name__}: the check tries several clusters")
    got = []
    for psi, nodes, gpus in CLUSTERS:
        with calls_recorded() as ran:
            value = answer(psi, nodes, gpus)
        if _calls_the_ledgers(ran):
            return ("your function calls the course's own ledger (course_utils.sharding), which gives the "
                    "number without the reasoning: write the formula yourself, from the collectives HSDP "
                    "runs, the groups they run on and what a rank sends in each")
        if value is Ellipsis:
            raise NotImplementedError  # the answer cell as shipped
        number = real(value)
        if number is None:
            return f"your function must return one number of bytes for each cluster: {NOT_A_NUMBER}"
        got.append(number)

    def matches(formula: Any) -> bool:
        return all(math.isclose(v, formula(*c), rel_tol=1e-6, abs_tol=1e-6)
                   for v, c in zip(got, CLUSTERS, strict=True))

    if matches(hsdp_between):
        return None
    for formula, hint in _BETWEEN_WRONG:
        if matches(formula):
            return hint
    if len(set(got)) == 1:
        return "your function gives the same number for every cluster: use psi, nodes and gpus"
    return ("list the collectives HSDP runs in a step and the group each runs on, keep those whose "
            "group spans nodes, then count what one rank sends in each (the ring of notebook 05)")
