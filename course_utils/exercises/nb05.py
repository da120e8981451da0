"""Judges of the exercises of notebook 05 (DistributedDataParallel); their content is in nb05.toml."""

from __future__ import annotations

from typing import Any

import torch

from .core import load_bank, not_a_pair
from .on_ranks import run_on_ranks

__all__ = ["EXERCISES"]


def _whole_number(answer: Any, what: str) -> str | None:
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return f"write {what} as a number, not {type(answer).__name__}"
    if answer != int(answer):
        return f"{what} is a whole number"
    return None


def _judge_ring_bytes(answer: Any) -> str | None:
    wrong_type = _whole_number(answer, "the bytes each rank sends")
    if wrong_type:
        return wrong_type
    from course_utils.collectives import ring_bytes_per_rank

    values, ranks, itemsize = 4096, 4, 4
    size = values * itemsize
    right = int(ring_bytes_per_rank(size, ranks))
    if answer == right:
        return None
    if answer == right // itemsize:
        return "that counts values, not bytes: a float32 value is 4 bytes"
    if answer in (right / 1024, right / 1000):
        return "that is in KiB (or kB): the question asks for bytes"
    if answer == right // 2:
        return "you counted one phase: the ring has a second one, after the reduce-scatter"
    if answer == 2 * size:
        return ("that is twice the whole tensor: at each step of the ring a rank sends one chunk, not the "
                "whole tensor; count the steps in each phase")
    if answer == 2 * (ranks - 1) * size:
        return ("that is what rank 0 moves when everyone sends the whole tensor to it; in the ring "
                "every step sends one chunk")
    if answer == size:
        return "that is the whole tensor once; count one rank's sends step by step, in both phases"
    return ("count one rank's sends over the two phases above: how many steps each has, and how big "
            "is what a rank sends at each step?")


def _judge_sampler_reads(answer: Any) -> str | None:
    # each number's own type hint follows (_whole_number)
    wrong_shape = not_a_pair(answer, "(samples each rank reads per epoch, duplicate reads in total)",
                             whole=False)
    if wrong_shape:
        return wrong_shape
    per_rank, duplicates = answer
    for value, what in ((per_rank, "samples per rank"), (duplicates, "duplicate reads")):
        wrong_type = _whole_number(value, what)
        if wrong_type:
            return wrong_type
    from torch.utils.data.distributed import DistributedSampler

    shards = [list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    right_per_rank, right_duplicates = len(shards[0]), sum(map(len, shards)) - 10
    if per_rank != right_per_rank:
        if per_rank * 4 < 10:
            return ("with drop_last=False nothing is dropped: every sample is read, and every rank "
                    "reads the same number")
        return "every rank reads the same number of samples, but no more than it takes to read them all"
    if duplicates != right_duplicates:
        if duplicates == 0:
            return ("4 ranks times the samples per rank is more than 10: the sampler pads with samples "
                    "from the start, so some are read twice")
        return ("a duplicate is a read beyond the 10 samples the data set has: count the reads of all "
                "ranks together")
    return None


def _judge_epoch_orders(answer: Any) -> str | None:
    from torch.utils.data.distributed import DistributedSampler

    from course_utils.failure_zoo import sampler_orders

    runs = []
    for rank in (0, 1):  # the same answer on both ranks, as a training script runs it
        got = answer(DistributedSampler(range(20), num_replicas=2, rank=rank, shuffle=True, seed=0), 4)
        if not (isinstance(got, dict) and sorted(got) == [0, 1, 2, 3]):
            return ("return a dict with one list of indices per epoch: "
                    "{0: [...], 1: [...], 2: [...], 3: [...]}")
        runs.append([list(got[epoch]) for epoch in range(4)])
    mine, other = runs
    expected = sampler_orders(0, 2, 20, 4, set_epoch=True)  # notebook 10's right loop
    for epoch in range(4):
        if sorted(mine[epoch] + other[epoch]) != list(range(20)):
            if len(mine[epoch]) == len(other[epoch]) == 10 and set(mine[epoch]) & set(other[epoch]):
                return (f"in epoch {epoch} the two ranks read some of the same samples and missed others: "
                        "each rank's sampler was told a different epoch, so their shards no longer fit "
                        "together")
            return "each epoch should read this rank's shard: half of the 20 indices, from the sampler itself"
    if all(order == mine[0] for order in mine):
        return ("every epoch read the same order: the sampler shuffles with its seed plus the epoch it "
                "was last told, and here every epoch was told the same one (or none)")
    if mine[0] == expected[0] and mine[1:] == expected[:-1]:
        return ("each epoch read the order of the epoch before: the sampler must know the epoch before "
                "you read it, not after")
    if any(mine[i] == mine[j] for i in range(4) for j in range(i + 1, 4)):
        return "two of the epochs read the same order: each epoch must tell the sampler a value of its own"
    if all(set(order) == set(mine[0]) for order in mine):
        return ("the order changes, but every epoch this rank reads the same 10 samples: the sampler "
                "itself must reshuffle, so that the ranks' shards change together")
    return None  # a new shuffle every epoch, the same on both ranks (set_epoch(epoch + 1) is fine too)


def _judge_two_heads(answer: Any) -> str | None:
    from ..ddp_demos import TwoHeads
    ranks, hint = run_on_ranks(answer, 2, hang_hint=(
        "the ranks hung and were stopped: one rank waits in a collective the other never calls; "
        "both must build and train the model the same way"))
    if hint is not None and "finished reduction" in hint:
        return ("DDP still waits for a gradient of every parameter, and forward never uses "
                "unused_head: either tell DDP, when you wrap the model, to look for the parameters "
                "forward leaves out, or do not give it parameters that forward never uses")
    if hint is not None:
        return hint
    if not all(isinstance(r, dict) for r in ranks):
        return "return this rank's parameters: a dict of name -> tensor (the model's state_dict)"
    names = [n for n in ("body.weight", "body.bias", "used_head.weight", "used_head.bias") if n in ranks[0]]
    if len(names) < 4:
        return "return the state_dict of the inner model (ddp_model.module), with body and used_head"
    for name in names:
        if not torch.equal(ranks[0][name].cpu(), ranks[1][name].cpu()):
            return ("the error is gone, but the ranks' parameters differ: their gradients were not "
                    "all-reduced (DDP all-reduces what goes through its own forward), so each rank trained "
                    "on its own rows only")
    torch.manual_seed(0)
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generators = [torch.Generator().manual_seed(r) for r in range(2)]
    for _ in range(2):
        loss = torch.stack([model(torch.randn(8, 4, generator=g)).square().mean() for g in generators]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = model.state_dict()
    for name in names:
        if not torch.allclose(ranks[0][name].cpu(), state[name], atol=1e-5):
            return ("the ranks agree, but not with one process training on both ranks' rows: keep "
                    "the training loop as it was and change only how the model is wrapped")
    return None


EXERCISES = load_bank(__name__)
