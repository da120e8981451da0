"""Judges of the exercises of notebook 05 (DistributedDataParallel); their content is in nb05.toml."""

from __future__ import annotations

from typing import Any

import torch

from .answers import reals, whole
from .core import load_bank, untimed
from .on_ranks import Plan
from .together import by_plan

__all__ = ["CASES", "EXERCISES"]


#: 05.1's ring sizes, for 4096 float32 values: at 4 ranks "1.5 times the tensor" or "a step sends as
#: many bytes as the tensor has values" give the right bytes too; at 8 they do not
RING_RANKS, RING_VALUES, RING_ITEMSIZE = (4, 8), 4096, 4
#: 05.2's data sets on 4 ranks, drop_last=False: at 9 samples "the remainder" or "one padded sample"
#: do not give the duplicates; at 12 (no duplicates) "ranks minus the remainder" does not
SAMPLER_SIZES, SAMPLER_RANKS = (9, 12), 4


def _wholes(answer: Any, length: int) -> list[int] | None:
    """``answer`` as ``length`` whole numbers, however each is written; else None."""
    numbers = reals(answer, length) if not isinstance(answer, (str, bytes)) else None
    if numbers is None or any(not n.is_integer() for n in numbers):
        return None
    return [int(n) for n in numbers]


def _judge_ring_bytes(answer: Any) -> str | None:
    got = _wholes(answer, len(RING_RANKS))
    if got is None:
        return (f"write a pair of whole numbers of bytes (each rank's sends on {RING_RANKS[0]} ranks, on "
                f"{RING_RANKS[1]} ranks), not a {type(answer).__name__}")
    for ranks, sent in zip(RING_RANKS, got, strict=True):
        hint = _ring_hint(ranks, sent)
        if hint:
            return hint
    return None


def _ring_hint(ranks: int, answer: int) -> str | None:
    from course_utils.ddp.collectives import ring_bytes_per_rank

    size = RING_VALUES * RING_ITEMSIZE
    right = int(ring_bytes_per_rank(size, ranks))
    if answer == right:
        return None
    on = f"on {ranks} ranks: "
    if answer == right // RING_ITEMSIZE:
        return on + "that counts values, not bytes: a float32 value is 4 bytes"
    if answer in (right / 1024, right / 1000):
        return on + "that is in KiB (or kB): the question asks for bytes"
    if answer == right // 2:
        return on + "you counted one phase: the ring has a second one, after the reduce-scatter"
    if answer == 2 * (ranks - 1) * RING_VALUES:
        return (on + "a step sends one chunk: the tensor's bytes split over the ranks, not as many bytes "
                "as the tensor has values")
    if answer == 2 * size:
        return (on + "that is twice the whole tensor: at each step of the ring a rank sends one chunk, not "
                "the whole tensor; count the steps in each phase")
    if answer == 2 * (ranks - 1) * size:
        return (on + "that is what rank 0 moves when everyone sends the whole tensor to it; in the ring "
                "every step sends one chunk")
    if answer == size:
        return on + "that is the whole tensor once; count one rank's sends step by step, in both phases"
    if answer * 2 == 3 * size:
        return (on + "the share of the tensor a rank sends grows with the number of ranks: count the "
                "steps of each phase and the size of a chunk for this ring")
    return (on + "count one rank's sends over the two phases above: how many steps each has, and how "
            "big is what a rank sends at each step?")


def _judge_sampler_reads(answer: Any) -> str | None:
    what = "(samples per rank, duplicate reads)"
    if not (isinstance(answer, (tuple, list)) and len(answer) == len(SAMPLER_SIZES)):
        return (f"write a pair of pairs, one for {SAMPLER_SIZES[0]} samples, one for {SAMPLER_SIZES[1]}: "
                f"{what}")
    for size, pair in zip(SAMPLER_SIZES, answer, strict=True):
        got = _wholes(pair, 2)
        if got is None:
            return f"for {size} samples write a pair of whole numbers {what}, not a {type(pair).__name__}"
        hint = _reads_hint(size, *got)
        if hint:
            return hint
    return None


def _reads_hint(size: int, per_rank: int, duplicates: int) -> str | None:
    from torch.utils.data.distributed import DistributedSampler

    ranks = SAMPLER_RANKS
    shards = [list(DistributedSampler(range(size), num_replicas=ranks, rank=r, shuffle=False))
              for r in range(ranks)]
    right_per_rank, right_duplicates = len(shards[0]), sum(map(len, shards)) - size
    if per_rank != right_per_rank:
        if per_rank * ranks < size:
            return (f"with {size} samples: with drop_last=False nothing is dropped: every sample is read, "
                    "and every rank reads the same number")
        return (f"with {size} samples: every rank reads the same number of samples, but no more than it "
                "takes to read them all")
    if duplicates != right_duplicates:
        if duplicates == 0:
            return (f"with {size} samples: {ranks} ranks times the samples per rank is more than {size}: "
                    "the sampler pads with samples from the start, so some are read twice")
        if right_duplicates == 0:
            return (f"with {size} samples the ranks' reads add up to the data set exactly: the sampler pads "
                    "only to make the shards equal, and here they already are")
        return (f"with {size} samples: a duplicate is a read beyond the {size} samples the data set has: "
                "count the reads of all ranks together")
    return None


#: 05.3's cases: (samples, ranks, epochs): the notebook's, and one that does not divide evenly
EPOCH_CASES = [(20, 2, 4), (11, 3, 3)]
#: 05.4's cases: the world sizes, each rank training on its own rows
TWO_HEADS_WORLDS = (2, 3)
#: how far the epochs an answer tells its sampler may go (set_epoch(epoch + 1) is right too)
_EPOCHS_TRIED = 64

CASES: dict[str, list[str]] = {
    "05.1": [f"{RING_VALUES} float32 values, {n} ranks" for n in RING_RANKS],
    "05.2": [f"{n} samples, {SAMPLER_RANKS} ranks, drop_last=False" for n in SAMPLER_SIZES],
    "05.3": [f"{n} samples on {w} ranks, {e} epochs" for n, w, e in EPOCH_CASES],
    "05.4": [f"world_size={w}, 2 SGD steps, each rank its own rows" for w in TWO_HEADS_WORLDS],
}


def _judge_epoch_orders(answer: Any) -> str | None:
    for case in EPOCH_CASES:
        hint = _epoch_orders_case(answer, *case)
        if hint is not None:
            return hint
    return None


def _indices(order: Any) -> list[int] | None:
    """An epoch's order as a list of whole numbers (a list, a tensor, NumPy's), else None."""
    if order is None or isinstance(order, (str, bytes)) or not hasattr(order, "__iter__"):
        return None
    values = [whole(v) for v in order]
    return None if any(v is None for v in values) else values  # type: ignore[return-value]


def _epoch_orders_case(answer: Any, size: int, world_size: int, epochs: int) -> str | None:
    from torch.utils.data.distributed import DistributedSampler

    def sampler(rank: int) -> DistributedSampler:
        return DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=0)

    runs = []
    for rank in range(world_size):  # the same answer on every rank, as a training script runs it
        got = answer(sampler(rank), epochs)
        orders = [_indices(got.get(epoch)) for epoch in range(epochs)] if isinstance(got, dict) else None
        if orders is None or len(got) != epochs or any(order is None for order in orders):
            return ("return a dict with one list of indices per epoch: "
                    "{0: [...], 1: [...], 2: [...], 3: [...]}")
        runs.append(orders)
    per_epoch = [[run[epoch] for run in runs] for epoch in range(epochs)]  # every rank's order
    samplers = [sampler(rank) for rank in range(world_size)]
    given = []  # for each sampler epoch, every rank's order
    with untimed():  # the course's own reference
        for value in range(_EPOCHS_TRIED):
            for s in samplers:
                s.set_epoch(value)
            given.append([list(s) for s in samplers])
    told = [next((v for v in range(_EPOCHS_TRIED) if given[v] == orders), None) for orders in per_epoch]
    mine = runs[0]
    for epoch, value in enumerate(told):
        if value is not None:
            continue
        orders = per_epoch[epoch]
        together = sorted(i for order in orders for i in order)
        if sorted(set(together)) != list(range(size)) and all(len(o) == len(orders[0]) for o in orders):
            return (f"in epoch {epoch} the ranks read some of the same samples and missed others: "
                    "each rank's sampler was told a different epoch, so their shards no longer fit "
                    "together")
        if all(set(order) == set(mine[0]) for order in mine):
            return ("the order changes, but every epoch this rank reads the same samples: the "
                    "sampler itself must reshuffle, so that the ranks' shards change together")
        return ("these are not orders the sampler gives: it alone knows the data set, the ranks "
                "and the seed, so let the sampler shuffle, and tell it which epoch it is")
    if len(set(told)) == 1:
        return ("every epoch read the same order: the sampler shuffles with its seed plus the epoch it "
                "was last told, and here every epoch was told the same one (or none)")
    if told[0] == 0 and told[1:] == list(range(epochs - 1)):
        return ("each epoch read the order of the epoch before: the sampler must know the epoch before "
                "you read it, not after")
    if len(set(told)) < len(told):
        return "two of the epochs read the same order: each epoch must tell the sampler a value of its own"
    return None  # a new shuffle every epoch, the same on every rank (set_epoch(epoch + 1) is fine too)


def two_heads_rank(rank: int, world_size: int, answer: Any) -> dict:
    """One rank of exercise 05.4's check: the answer's parameters, and how many values the rank
    all-reduced (DDP's reducer included, from the Flight Recorder; None where this torch has none)."""
    from .on_ranks import reductions_recorded

    with reductions_recorded() as recorded:
        params = answer(rank, world_size)
    return {"params": params, "reduced": None if recorded is None else
            sum(n for kind, n in recorded if kind == "all_reduce")}


def _two_heads_plan(answer: Any) -> Plan:
    for world_size in TWO_HEADS_WORLDS:
        hint = _two_heads_case(world_size, *(yield (two_heads_rank, world_size, answer)))
        if hint is not None:
            return hint
    return None


_judge_two_heads = by_plan(_two_heads_plan, "the ranks hung and were stopped: one rank waits in a collective "
                                            "the other never calls; both must build and train the model "
                                            "the same way")


def _two_heads_case(world_size: int, results: list | None, hint: str | None) -> str | None:
    """05.4's hint for what ``world_size`` ranks returned (``results``), or for their hang or error."""
    from ..ddp.demos import TwoHeads
    if hint is not None and "finished reduction" in hint:
        return ("DDP still waits for a gradient of every parameter, and forward never uses "
                "unused_head: either tell DDP, when you wrap the model, to look for the parameters "
                "forward leaves out, or do not give it parameters that forward never uses")
    if hint is not None:
        return hint
    ranks = [r["params"] for r in results]
    if not all(isinstance(r, dict) for r in ranks):
        return "return this rank's parameters: a dict of name -> tensor (the model's state_dict)"
    names = [n for n in ("body.weight", "body.bias", "used_head.weight", "used_head.bias") if n in ranks[0]]
    if len(names) < 4:
        return "return the state_dict of the inner model (ddp_model.module), with body and used_head"
    for name in names:
        if not all(torch.equal(ranks[0][name].cpu(), r[name].cpu()) for r in ranks[1:]):
            return ("the error is gone, but the ranks' parameters differ: their gradients were not "
                    "all-reduced (DDP all-reduces what goes through its own forward), so each rank trained "
                    "on its own rows only")
    torch.manual_seed(0)
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generators = [torch.Generator().manual_seed(r) for r in range(world_size)]
    for _ in range(2):
        loss = torch.stack([model(torch.randn(8, 4, generator=g)).square().mean() for g in generators]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = model.state_dict()
    for name in names:
        if not torch.allclose(ranks[0][name].cpu(), state[name], atol=1e-5):
            return (f"with {world_size} ranks the ranks agree, but not with one process training on "
                    "every rank's rows: keep the training loop as it was and change only how the "
                    "model is wrapped")
    used = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("unused"))
    if any(r["reduced"] is not None and r["reduced"] < 2 * used for r in results):  # 2 steps' gradients
        return ("the parameters are right, but no rank all-reduced its gradients: each rank computed the "
                "other ranks' rows itself, which only works because the check can; train each rank "
                "on its own rows under DDP")
    return None


EXERCISES = load_bank(__name__)
