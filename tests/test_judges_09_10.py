"""The judges of notebooks 10 and 11 that read numbers read them through exercises/answers.py, the
same way for every exact type a learner may write, and try the cases where a look-alike answer
parts from the right one (issue 40, point 12)."""

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from course_utils.exercises import nb10, nb11, verdict

#: ways of writing one number x
WRITINGS = [lambda x: x, float, lambda x: Fraction(x).limit_denominator(10**12),
            lambda x: Decimal(repr(float(x))), np.float64,
            lambda x: torch.tensor(float(x), dtype=torch.float64), lambda x: np.array(float(x))]
IDS = ["as is", "float", "Fraction", "Decimal", "np.float64", "0-d tensor", "0-d array"]
ZERO2 = (2 * 10**9, 2 * 10**9 // 8, 12 * 10**9 // 8)


@pytest.mark.parametrize("write", WRITINGS, ids=IDS)
def test_09_1_reads_three_numbers_however_written(write):
    assert verdict("10.1", tuple(write(x) for x in ZERO2)).right
    assert verdict("10.1", [write(x) for x in ZERO2]).right
    assert verdict("10.1", np.array(ZERO2, dtype=np.float64)).right
    assert verdict("10.1", torch.tensor(ZERO2, dtype=torch.float64)).right


def test_09_1_tells_stage_2_from_its_look_alike_by_the_parts():
    swapped = (ZERO2[1], ZERO2[0], ZERO2[2])  # the parameters sharded, the gradients whole
    assert sum(swapped) == sum(ZERO2)  # the same total: only the parts part them
    assert "keeps every gradient" in verdict("10.1", swapped).hint
    assert "write three numbers" in verdict("10.1", sum(ZERO2)).hint
    assert "write three numbers" in verdict("10.1", (True, ZERO2[1], ZERO2[2])).hint
    assert "missing" in verdict("10.1", (0, ZERO2[1], ZERO2[2])).hint  # zero is a number, not absent


@pytest.mark.parametrize("write", WRITINGS, ids=IDS)
def test_09_4_reads_what_the_function_returns_however_written(write):
    def answer(psi, nodes, gpus):
        return write(Fraction(8 * psi * (nodes - 1), nodes * gpus))
    assert verdict("10.4", answer).right


def test_09_4_catches_the_rules_that_agree_on_two_nodes_only():
    right = nb10._hsdp_between
    for wrong, fragment in ((lambda p, n, g: 4 * p / g * (n - 1), "2 nodes only"),
                            (lambda p, n, g: 8 * p / g / n, "2 nodes only"),
                            (lambda p, n, g: 8 * p * (n - 1), "summed over all")):
        assert wrong(1732, 2, 2) == right(1732, 2, 2) or fragment == "summed over all"
        assert fragment in verdict("10.4", wrong).hint
    assert "one number" in verdict("10.4", lambda p, n, g: True).hint  # True is not a number
    assert "one number" in verdict("10.4", lambda p, n, g: None if n == 1 else right(p, n, g)).hint


@pytest.mark.parametrize("write", WRITINGS, ids=IDS)
def test_10_1_reads_what_the_function_returns_however_written(write):
    assert verdict("11.1", lambda n: write(Fraction(2 * n + 2, 4 * n))).right


def test_10_1_tells_keeping_a_share_from_dropping_one():
    keep, drop = nb11._zero1, (lambda n: (2 + 2 * (n - 1) / n) / 4)
    assert keep(2) == drop(2) == 0.75  # the harness's two ranks cannot part them
    assert 2 in nb11.ZERO1_RANKS and any(keep(n) != drop(n) for n in nb11.ZERO1_RANKS)
    assert "two ranks only" in verdict("11.1", drop).hint
    assert "write a function of n" in verdict("11.1", 0.75).hint
    assert "one number" in verdict("11.1", lambda n: np.bool_(True)).hint


def test_10_3_catches_activations_left_out_of_one_strategy():
    def partial(parameters, gpu_bytes, gpus, activation_bytes):  # FSDP's bytes without the activations
        if 16 * parameters + activation_bytes <= gpu_bytes:
            return "ddp"
        if 4 * parameters + 12 * parameters / gpus + activation_bytes <= gpu_bytes:
            return "zero2"
        return "fsdp" if 16 * parameters / gpus <= gpu_bytes else "none"

    assert any(partial(*case) != nb11._choose(*case) for case in nb11._CASES)
    assert "the activations need room too" in verdict("11.3", partial).hint


def test_09_2_counts_an_all_to_all_as_the_share_it_sends():
    from course_utils.exercises.dispatched import ring_bytes_sent

    n, nbytes = 4, 4096
    assert ring_bytes_sent([("all_to_all", nbytes)], n) == ring_bytes_sent([("reduce_scatter", nbytes)], n)
    assert ring_bytes_sent([("all_to_all", nbytes)], n) == nbytes * (n - 1) / n
    assert ring_bytes_sent([("all_reduce", nbytes), ("barrier", 0)], n) == 2 * nbytes * (n - 1) / n


def test_09_4_refuses_the_course_s_ledger_however_it_is_reached():
    from course_utils.sharding import ledgers, mesh

    def through_the_ledger(psi, nodes, gpus):
        return ledgers.link_bytes_per_step(psi, nodes, gpus, "hsdp")["between nodes"]

    bound = mesh.run_link_bytes
    assert "the course's own ledger" in verdict("10.4", through_the_ledger).hint
    def bound_before(psi, nodes, gpus):
        return bound("hsdp", psi, nodes, gpus)["between nodes"]

    assert "the course's own ledger" in verdict("10.4", bound_before).hint
    assert verdict("10.4", nb10._hsdp_between).right


@pytest.mark.parametrize(("case", "right", "wrong_rule", "fragment"), [
    ((12e9, 80e9, 8, 10e9), "zero2", "_PARAMETERS_TWICE", "counts the parameters twice"),
    ((4e9, 80e9, 8, 10e9), "ddp", "_DDP_20", "more than 16 bytes per parameter")])
def test_10_3_tries_the_cases_where_a_wrong_memory_rule_parts_from_the_right_one(case, right, wrong_rule,
                                                                                 fragment):
    rule = getattr(nb11, wrong_rule)
    assert case in nb11._CASES and nb11._choose(*case) == right
    assert nb11._choose(*case, state_bytes=rule) != right
    others = [c for c in nb11._CASES if c != case]
    assert all(nb11._choose(*c, state_bytes=rule) == nb11._choose(*c) for c in others)  # only this case

    def answer(parameters, gpu_bytes, gpus, activation_bytes):
        return nb11._choose(parameters, gpu_bytes, gpus, activation_bytes, state_bytes=rule)

    assert fragment in verdict("11.3", answer).hint
