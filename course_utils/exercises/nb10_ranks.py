"""What the checks of notebook 10's exercises run on each rank (launch sends these by name).

The judges, in ``nb10.py``, compare what these return with the course's references.
"""

from __future__ import annotations

from typing import Any


def accumulation_rank(rank: int, world_size: int, step: Any, k: int, micro: int, steps: int) -> dict:
    """One rank of exercise 10.5's check: ``train_accumulating`` with the answer as its step, counting
    the rounds of DDP's all-reduce and noting a ``zero_grad`` between two backward passes of a step."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from course_utils.training_bugs import train_accumulating

    rounds: list[int] = []  # one entry per all-reduce of the first bucket: one per synced backward
    cleared_between = []  # steps in which zero_grad ran between two backward passes

    def counting_hook(state, bucket):  # unannotated: DDP refuses a bucket annotated other than GradBucket
        if bucket.index() == 0:
            rounds.append(1)
        return allreduce_hook(None, bucket)  # DDP's own averaging all-reduce, in Python

    def watched(ddp_model: Any, optimizer: Any, micro_batches: list) -> None:
        if not hasattr(optimizer, "_course_events"):  # the first step: install the watchers
            optimizer._course_events = []
            ddp_model.register_comm_hook(None, counting_hook)
            first = next(ddp_model.module.parameters())
            first.register_hook(lambda grad: optimizer._course_events.append("backward"))
            zero_grad = optimizer.zero_grad

            def noted_zero_grad(*args: Any, **kwargs: Any) -> Any:
                optimizer._course_events.append("zero_grad")
                return zero_grad(*args, **kwargs)
            optimizer.zero_grad = noted_zero_grad
        events = optimizer._course_events
        events.clear()
        step(ddp_model, optimizer, micro_batches)
        backward = [i for i, e in enumerate(events) if e == "backward"]
        if any(e == "zero_grad" and backward and backward[0] < i < backward[-1]
               for i, e in enumerate(events)):
            cleared_between.append(True)

    weights = train_accumulating(rank, world_size, watched, k, micro, steps)
    return {"weights": weights, "rounds": len(rounds), "cleared_between": bool(cleared_between)}


SAVE_S = 1.0  # how long rank 0 takes to write the checkpoint in the check (a big one takes a while)


def save_and_load_rank(rank: int, world_size: int, save_and_load: Any, path: str) -> dict:
    """One rank of exercise 10.8's check: a model seeded with the rank, and a slow ``torch.save``."""
    import time

    import torch

    writers = []
    real_save = torch.save

    def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        writers.append(rank)
        if rank == 0:
            time.sleep(SAVE_S)
        return real_save(obj, f, *args, **kwargs)

    torch.save = slow_save
    try:
        torch.manual_seed(rank)
        got = save_and_load(torch.nn.Linear(3, 2), path)
    finally:
        torch.save = real_save
    weights = {k: v.detach().cpu().clone() for k, v in got.items()} if isinstance(got, dict) else None
    return {"wrote": bool(writers), "weights": weights}


def seeded_weights(seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in torch.nn.Linear(3, 2).state_dict().items()}
