"""The rank side of the judge of notebook 07's exercise 07.3: the answer trains on one gloo rank
of :class:`course_utils.ddp.by_hand.DDPByHand`, and the rank reports what the judge (``nb07``)
compares with the references: the weights, the all-reduces of each optimizer step (from the
process group's Flight Recorder), the rows of each forward pass, the backward passes of each
optimizer step (a post-accumulate-grad hook on each parameter counts the gradients that reached
``.grad``), and whether an optimizer step ran before the step's all-reduce was finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ACCUMULATION_LR", "ACCUMULATION_STEPS", "accumulation_answer_rank", "global_batches",
           "reference_weights"]

#: 07.3 trains this many optimizer steps at this learning rate (SGD, momentum 0.9)
ACCUMULATION_STEPS, ACCUMULATION_LR = 3, 0.5


def global_batches(world_size: int, rows_per_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of 07.3's check, the same on every rank and in the judge."""
    from ..ddp import batch_task

    generator = torch.Generator().manual_seed(13 * world_size + rows_per_rank)
    return [batch_task.batch(generator, world_size * rows_per_rank) for _ in range(ACCUMULATION_STEPS)]


def reference_weights(world_size: int, rows_per_rank: int, k: int, how: str) -> torch.Tensor:
    """One process on 07.3's global batches (what N·k ranks end with), or a look-alike: ``"k times"``
    (each micro-batch's loss not divided by k), ``"last only"`` (each rank's last micro-batch alone,
    its loss divided by k)."""
    from ..ddp import batch_task
    from ..ddp.batch_size import MOMENTUM

    model = batch_task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=ACCUMULATION_LR, momentum=MOMENTUM)
    for x, y in global_batches(world_size, rows_per_rank):
        if how == "last only":
            x = torch.cat([part.tensor_split(k)[-1] for part in x.tensor_split(world_size)])
            y = torch.cat([part.tensor_split(k)[-1] for part in y.tensor_split(world_size)])
        scale = {"right": 1.0, "k times": float(k), "last only": 1.0 / k}[how]
        optimizer.zero_grad()
        (torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y) * scale).backward()
        optimizer.step()
    return model.weight.detach()[0]


def accumulation_answer_rank(rank: int, world_size: int, answer: Any, ks: Sequence[int],
                             rows_per_rank: int) -> dict[int, dict]:
    """For each ``k`` of ``ks``: a fresh model under ``DDPByHand``, ``ACCUMULATION_STEPS`` calls of
    ``answer(ddp_model, optimizer, x, y, k)`` on this rank's slice of each global batch."""
    from ..ddp import batch_task
    from ..ddp.accumulation import all_reduce_records
    from ..ddp.batch_size import MOMENTUM
    from ..ddp.by_hand import DDPByHand
    from ..devices import rank_device

    device = rank_device()
    out = {}
    for k in ks:
        model = batch_task.model().to(device)
        ddp_model = DDPByHand(model)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=ACCUMULATION_LR, momentum=MOMENTUM)
        report: dict[str, Any] = {"all_reduces": [], "rows": [], "backwards": []}
        model.register_forward_pre_hook(lambda _, args, rows=report["rows"]: rows.append(len(args[0])))
        arrivals = {param: 0 for param in model.parameters()}  # backward passes that reached each .grad
        for param in arrivals:
            param.register_post_accumulate_grad_hook(lambda p, n=arrivals: n.__setitem__(p, n[p] + 1))
        last = max(all_reduce_records(), default=-1)
        for x, y in global_batches(world_size, rows_per_rank):
            x, y = x.tensor_split(world_size)[rank].to(device), y.tensor_split(world_size)[rank].to(device)
            arrivals.update(dict.fromkeys(arrivals, 0))
            answer(ddp_model, optimizer, x, y, k)
            report["backwards"].append(min(arrivals.values()))  # a parameter's gradient arrived this often
            ids = all_reduce_records()
            report["all_reduces"].append(sum(1 for i in ids if i > last))
            last = max(ids, default=last)
        report["weights"] = model.weight.detach().cpu()[0].clone()
        out[k] = report
        torch.distributed.barrier()
    return out
