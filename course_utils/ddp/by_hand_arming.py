"""When the hooks of DDP by hand act, against torch's DDP (notebook 06, section 4).

DDP's reducer acts on a backward pass only after a forward run with gradients outside
``no_sync()`` (it *arms* its hooks), and stops once that backward has started every bucket (it
disarms them). :data:`ARMING_CASES` are sequences of forwards and backward passes in which a
wrapper that decided per forward, or per backward, would part from that rule;
:func:`arming_rank` runs each under :class:`~course_utils.ddp.by_hand.DDPByHand` and under
torch's DDP and returns what each ended with.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..devices import rank_device, wrap_ddp
from .by_hand import DDPByHand
from .by_hand_runs import lesson_model

__all__ = ["ARMING_CASES", "arming_rank"]

#: name -> moves: "synced" (a forward outside no_sync), "quiet" (a forward inside it), "backward K"
#: (backward of the K-th forward's loss, its graph kept), "backward head" (a loss of the last layer
#: alone: the other parameters get no gradient)
ARMING_CASES: dict[str, tuple[str, ...]] = {
    "a forward, then one in no_sync, one backward of the second": ("synced", "quiet", "backward 2"),
    "a forward in no_sync, then one outside, one backward of the first": ("quiet", "synced", "backward 1"),
    "one forward, two backward passes of its graph": ("synced", "backward 1", "backward 1"),
    "a parameter left out, then a forward in no_sync": ("synced", "backward head", "quiet"),
    "a parameter left out, then a backward of the whole graph": ("synced", "backward head", "backward 1"),
}


def _play(wrapped: Any, model: torch.nn.Module, moves: tuple[str, ...], rank: int,
          device: torch.device) -> str | None:
    """Play ``moves`` on ``wrapped`` (whose module is ``model``); the error, if one was raised."""
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    head = model[6]
    losses: list[torch.Tensor] = []
    try:
        for i, move in enumerate(moves):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank)).to(device)
            target = torch.zeros(4, head.out_features, device=device)
            if move == "synced":
                losses.append(F.mse_loss(wrapped(x), target))
            elif move == "quiet":
                with wrapped.no_sync():
                    losses.append(F.mse_loss(wrapped(x), target))
            elif move == "backward head":
                F.mse_loss(head(torch.ones(4, head.in_features, device=device)), target).backward()
            else:
                losses[int(move.split()[1]) - 1].backward(retain_graph=True)
        finish()  # DDPByHand: nothing left to do after a complete backward; else it raises
    except RuntimeError as err:
        return str(err)
    return None


def arming_rank(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Each case of :data:`ARMING_CASES` by hand and under torch's DDP, on the lesson model (a tied
    and a frozen weight): ``(case, "by hand" | "torch DDP") -> {"error", "grads", "ranks equal"}``,
    the gradients on the CPU and whether every rank holds the same ones, bit for bit."""
    device = rank_device()
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for case, moves in ARMING_CASES.items():
        for name in ("by hand", "torch DDP"):
            model = lesson_model(tied=True, frozen=True).to(device)
            wrapped = DDPByHand(model, 0.0005) if name == "by hand" else wrap_ddp(model, device)
            error = _play(wrapped, model, moves, rank, device)
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            same = True
            for grad in grads.values():
                every = [torch.empty_like(grad) for _ in range(world_size)]
                dist.all_gather(every, grad)
                same = same and all(torch.equal(e, every[0]) for e in every)
            found[case, name] = {"error": error, "ranks equal": same,
                                 "grads": {n: g.cpu() for n, g in grads.items()}}
            dist.barrier()
            wrapped = model = None  # DDP gone before the process group (gloo's clean exit)
            gc.collect()
    return found
