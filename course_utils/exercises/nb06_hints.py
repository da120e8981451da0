"""What the judges of exercises 06.1 and 06.2 say, and how they tell a gradient from something
else: the hints shared by their rank functions (:mod:`.nb06_ranks`)."""

from __future__ import annotations

import torch

__all__ = ["FILL_ORDER", "NO_OVERLAP", "TOUCHED", "carries_gradients", "frozen_hint", "grad_hint",
           "written_in_flight"]

#: an all-reduce's tensor written while the all-reduce ran
TOUCHED = ("a gradient was changed (divided, say) while its all-reduce was still in flight: until the "
           "handle is waited for, the backend may still be reading or writing that tensor, so what it "
           "holds afterwards depends on timing, even when the numbers come out right on this machine")
#: every all-reduce started only once the last gradient was ready
NO_OVERLAP = ("every all-reduce started only in the hook of the last gradient to be ready, at the end of "
              "the backward pass: nothing can overlap it; the fixed order must follow the order the "
              "gradients usually arrive in (last layer first), so that each all-reduce can start as soon "
              "as its own gradient is ready")
#: the ranks issued their all-reduces in different orders
FILL_ORDER = ("the ranks started their all-reduces in different orders (each in the order its gradients "
              "arrived, which here depends on the rank: two layers of the same shape run in a "
              "rank-dependent order): all-reduces pair up across ranks in the order they are started, so "
              "the ranks summed different gradients with no error; every rank must start them in one "
              "fixed order, whatever order its gradients become ready in")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def frozen_hint(err: Exception) -> str | None:
    text = str(err)
    if "NoneType" in text or "doesn't require gradient" in text or "does not require grad" in text:
        return ("a parameter with requires_grad=False has no gradient (its .grad stays None) and takes no "
                "part in the averaging: leave the parameters that do not train alone")
    return None


def grad_hint(got: torch.Tensor, mean: torch.Tensor, own: torch.Tensor, world_size: int) -> str | None:
    """What is wrong with a gradient that should be ``mean`` (``own``: this rank's, before)."""
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6)  # noqa: E731
    if close(got, mean):
        return None
    if close(got, mean * world_size):
        return ("each gradient holds the sum over the ranks: DDP averages, so that N ranks train as one "
                "process on the whole batch")
    if close(got, mean / world_size):
        return "each gradient holds the mean divided once more: divide the sum by the world size once"
    if close(got, own):
        return ("each gradient is still this rank's own: nothing reached the other ranks; all_reduce "
                "writes the sum into the tensor it is handed, so reducing a temporary (a quotient, a "
                "copy) loses the sum")
    if close(got, own / world_size):
        return ("each gradient is this rank's own, divided: all_reduce writes the sum into the tensor it "
                "is handed, so reducing a temporary (a quotient, a copy) loses the sum")
    ratio = (mean * world_size @ got / (got @ got).clamp_min(1e-30)).item()
    if close(got * ratio, mean * world_size):
        return ("each gradient is the sum divided by a fixed number, not by the world size: this check "
                "runs on several world sizes")
    return "the gradients are not the mean of the ranks' gradients"


def carries_gradients(record: dict, grads: set[int], own: list[torch.Tensor], world_size: int) -> bool:
    """Whether an all-reduce (a record of ``all_reduces_watched``) reduced gradients: a parameter's
    ``.grad`` (``grads``: their addresses when the answer started), or values that were, when it
    started, one or more of this rank's gradients ``own`` laid end to end (each whole, or divided
    by the world size: a flat bucket)."""
    if any(ptr in grads for ptr in record["ptrs"]):
        return True
    sent, at, left = record["sent"], 0, list(range(len(own)))
    while at < sent.numel():
        for i in left:
            g = own[i].flatten()
            chunk = sent[at:at + g.numel()]
            if _close(chunk, g) or _close(chunk, g / world_size):
                left.remove(i)
                at += g.numel()
                break
        else:
            return False
    return sent.numel() > 0


def written_in_flight(records: list[dict], world_size: int) -> bool:
    """Whether the answer wrote into a tensor while its all-reduce was in flight, by any means (an
    in-place division, ``.data``, NumPy): what the tensor held the moment the all-reduce finished is
    not the sum (or, for ``ReduceOp.AVG``, the mean) of what the ranks sent, or it changed between
    then and the answer's first wait other than by a callback chained to the all-reduce. The sums are
    worked out here with one blocking all-reduce per record (a collective: every rank calls this at
    the same point, with as many records; if the counts differ, other checks say why)."""
    import torch.distributed as dist

    counts: list = [None] * world_size
    dist.all_gather_object(counts, len(records))
    if len(set(counts)) != 1:
        return False
    moved = any(r["touched"] for r in records)
    for record in records:
        total = record["sent"].clone()
        dist.all_reduce(total)
        if record["average"]:
            total /= world_size
        after = record["after"]
        moved |= after is not None and not (after.shape == total.shape
                                            and torch.allclose(after, total, rtol=1e-5, atol=1e-6))
    return moved
