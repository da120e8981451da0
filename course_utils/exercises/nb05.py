"""Exercises of notebook 05 (DistributedDataParallel), with their reference solutions."""

from __future__ import annotations

from typing import Any

import torch

from .core import Exercise, run_on_ranks

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
    values, ranks, itemsize = 4096, 4, 4
    size = values * itemsize
    chunk = size // ranks
    right = 2 * (ranks - 1) * chunk
    if answer == right:
        return None
    if answer == right // itemsize:
        return "that counts values, not bytes: a float32 value is 4 bytes"
    if answer == right // 2:
        return ("you counted one phase: after the reduce-scatter the finished chunks travel round the "
                "ring once more (the all-gather), with as many sends again")
    if answer == 2 * size:
        return ("that is 2 x the whole tensor: each of the ring's steps sends one chunk of "
                "size / N, not the whole tensor; count the steps in each phase")
    if answer == 2 * (ranks - 1) * size:
        return ("that is what rank 0 moves when everyone sends the whole tensor to it; in the ring "
                "every step sends one chunk of size / N")
    if answer == size:
        return ("that is the whole tensor once; count one rank's sends: N - 1 steps in each of the "
                "two phases")
    return ("count one rank's sends: N - 1 steps in each of the two phases, one chunk of "
            "size / N bytes per step")


def _judge_sampler_reads(answer: Any) -> str | None:
    if not (isinstance(answer, tuple) and len(answer) == 2):
        return "write a pair: (samples each rank reads per epoch, duplicate reads in total)"
    per_rank, duplicates = answer
    for value, what in ((per_rank, "samples per rank"), (duplicates, "duplicate reads")):
        wrong_type = _whole_number(value, what)
        if wrong_type:
            return wrong_type
    from torch.utils.data.distributed import DistributedSampler

    shards = [list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    right_per_rank, right_duplicates = len(shards[0]), sum(map(len, shards)) - 10
    if per_rank != right_per_rank:
        if per_rank * 4 <= 10:
            return ("with drop_last=False nothing is dropped: every rank reads the same number of "
                    "samples, enough that all 10 are read, rounding up")
        return "every rank reads the same number of samples: 10 over 4 ranks, rounded up, not more"
    if duplicates != right_duplicates:
        if duplicates == 0:
            return ("4 ranks times the samples per rank is more than 10: the sampler pads with samples "
                    "from the start, so some are read twice")
        return "the duplicates are the reads beyond the 10 samples: all ranks' reads together, minus 10"
    return None


def _judge_epoch_orders(answer: Any) -> str | None:
    if not callable(answer):
        return f"epoch_orders must stay a function, got {type(answer).__name__}"
    from torch.utils.data.distributed import DistributedSampler

    def sampler() -> DistributedSampler:
        return DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True, seed=0)

    expected = []
    reference = sampler()
    for epoch in range(4):
        reference.set_epoch(epoch)
        expected.append(list(reference))
    got = answer(sampler(), 4)
    if not (isinstance(got, dict) and sorted(got) == [0, 1, 2, 3]):
        return "return a dict with one list of indices per epoch: {0: [...], 1: [...], 2: [...], 3: [...]}"
    got = [list(got[epoch]) for epoch in range(4)]
    if got == expected:
        return None
    if all(order == got[0] for order in got):
        return ("every epoch read the same order: the sampler shuffles with its seed plus the epoch "
                "you last gave it, so it needs this epoch's number before each epoch")
    if got[0] == expected[0] and got[1:] == expected[:-1]:
        return ("each epoch read the order of the epoch before: tell the sampler the epoch before "
                "you read it, not after")
    if sorted(got[0]) != sorted(expected[0]):
        return "each epoch should read this rank's shard: half of the 20 indices, from the sampler itself"
    return "epoch e should read the order the sampler gives after set_epoch(e)"


def _judge_two_heads(answer: Any) -> str | None:
    if not callable(answer):
        return f"train_two_heads must stay a function, got {type(answer).__name__}"
    from ..ddp_demos import TwoHeads
    ranks, hint = run_on_ranks(answer, 2, timeout_s=20, hang_hint=(
        "the ranks did not finish within 20 s and were stopped: one rank waits in a "
        "collective the other never calls; both must build and train the model the same way"))
    if hint is not None and "finished reduction" in hint:
        return ("DDP still waits for a gradient of every parameter, and forward never uses "
                "unused_head: tell DDP, when you wrap the model, to look for the parameters "
                "forward leaves out")
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


_TWO_HEADS_CONTEXT = """\
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils.ddp_demos import TwoHeads
from course_utils.devices import rank_device
"""

_TWO_HEADS = '''def train_two_heads(rank, world_size):
    """Two SGD steps of TwoHeads under DDP; returns this rank's parameters."""
    device = rank_device()
    torch.manual_seed(0)
    ddp_model = DDP(TwoHeads().to(device){extra})
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)  # each rank its own rows
    for _ in range(2):
        loss = ddp_model(torch.randn(8, 4, generator=g).to(device)).square().mean()
        optimizer.zero_grad()
{backward}
        optimizer.step()
    params = {{k: v.detach().cpu() for k, v in ddp_model.module.state_dict().items()}}
    del ddp_model, optimizer
    return params
'''


def _two_heads(extra: str = "", backward: str = "        loss.backward()") -> str:
    return _TWO_HEADS.format(extra=extra, backward=backward)


_EPOCH_ORDERS = '''def epoch_orders(sampler, epochs):
    """The indices `sampler` gives this rank in each of `epochs` epochs: {{epoch: indices}}."""
    orders = {{}}
    for epoch in range(epochs):
{body}
    return orders
'''


def _epoch_orders(body: str) -> str:
    return _EPOCH_ORDERS.format(body=body)


EXERCISES = [
    Exercise(
        key="05.1",
        kind="predict",
        title="bytes one rank sends in a ring all-reduce",
        answer="ring_bytes",
        starter="ring_bytes = ...  # bytes each rank sends: 4096 float32 values, ring of 4 ranks\n",
        solution="ring_bytes = 24576  # 2 phases x 3 steps x one chunk of 16384 / 4 bytes\n",
        judge=_judge_ring_bytes,
        wrong=(("ring_bytes = 12288", "you counted one phase"),
               ("ring_bytes = 32768", "each of the ring's steps sends one chunk"),
               ("ring_bytes = 6144", "that counts values, not bytes")),
    ),
    Exercise(
        key="05.2",
        kind="predict",
        title="DistributedSampler pads an uneven data set",
        answer="reads",
        starter="reads = ...  # (samples each rank reads per epoch, duplicate reads in total)\n",
        solution="reads = (3, 2)  # 10 over 4 rounds up to 3 each; 12 reads of 10 samples\n",
        judge=_judge_sampler_reads,
        wrong=(("reads = (2, 0)", "with drop_last=False nothing is dropped"),
               ("reads = (3, 0)", "the sampler pads with samples from the start"),
               ("reads = (3, 1)", "all ranks' reads together, minus 10")),
    ),
    Exercise(
        key="05.3",
        kind="fix",
        title="every epoch in the same order",
        answer="epoch_orders",
        starter=_epoch_orders("        orders[epoch] = list(sampler)"),
        solution=_epoch_orders("        sampler.set_epoch(epoch)  # shuffle with seed + epoch\n"
                               "        orders[epoch] = list(sampler)"),
        judge=_judge_epoch_orders,
        wrong=((_epoch_orders("        sampler.set_epoch(0)\n        orders[epoch] = list(sampler)"),
                "every epoch read the same order"),
               (_epoch_orders("        orders[epoch] = list(sampler)\n        sampler.set_epoch(epoch)"),
                "each epoch read the order of the epoch before")),
    ),
    Exercise(
        key="05.4",
        kind="fix",
        title="a model with a head that forward never uses",
        answer="train_two_heads",
        starter=_two_heads(),
        solution=_two_heads(", find_unused_parameters=True"),
        judge=_judge_two_heads,
        wrong=((_two_heads(", find_unused_parameters=False"), "forward never uses unused_head"),
               (_two_heads(", find_unused_parameters=True").replace("loss = ddp_model(",
                                                                     "loss = ddp_model.module("),
                "the ranks' parameters differ"),
               (_two_heads().replace("ddp_model.parameters()",
                                     "[p for n, p in ddp_model.named_parameters() if 'unused' not in n]"),
                "DDP still waits for a gradient of every parameter")),
        context=_TWO_HEADS_CONTEXT,
    ),
]
