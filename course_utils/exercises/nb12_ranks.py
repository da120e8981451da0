"""What the checks of notebook 12's exercises run on each rank (launch sends these by name).

The judges, in ``nb12.py``, compare what these return with the course's references.
"""

from __future__ import annotations

from typing import Any


def accumulation_rank(rank: int, world_size: int, step: Any, k: int, micro: int, steps: int) -> dict:
    """One rank of exercise 12.5's check: ``train_accumulating`` with the answer as its step, counting
    the rounds of DDP's all-reduce and noting a ``zero_grad`` between two backward passes of a step."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from course_utils.debugging.training_bugs import train_accumulating

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


#: how long rank 0 takes to write the checkpoint in the notebook's example (a big one takes a
#: while); the check tries several (nb12.SAVE_DELAYS_S)
SAVE_S = 1.0


def save_and_load_rank(rank: int, world_size: int, save_and_load: Any, path: str,
                       delay: float = SAVE_S) -> dict:
    """One rank of exercise 12.8's check: a model seeded with the rank, and a slow ``torch.save``
    (to a file: pickling a tensor, as ``broadcast_object_list`` does, calls it on a buffer)."""
    import os
    import time

    import torch

    writers, written_at, loads_at = [], [], []  # the order of events, on this machine's clock
    real_save, real_load = torch.save, torch.load

    def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(f, (str, os.PathLike)):  # not a file: torch's own pickling of a tensor
            return real_save(obj, f, *args, **kwargs)
        writers.append(rank)
        if rank == 0:
            time.sleep(delay)
        done = real_save(obj, f, *args, **kwargs)
        written_at.append(time.time())
        return done

    def watched_load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(f, (str, os.PathLike)):
            loads_at.append(time.time())
        return real_load(f, *args, **kwargs)

    torch.save, torch.load = slow_save, watched_load
    try:
        torch.manual_seed(rank)
        got = save_and_load(torch.nn.Linear(3, 2), path)
    finally:
        torch.save, torch.load = real_save, real_load
    weights = {k: v.detach().cpu().clone() for k, v in got.items()} if isinstance(got, dict) else None
    return {"wrote": bool(writers), "weights": weights, "loads_at": loads_at,
            "written_at": written_at[-1] if writers else None}


def seeded_weights(seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in torch.nn.Linear(3, 2).state_dict().items()}


def evaluation_rank(rank: int, world_size: int, answer: Any, seed: int | None) -> dict:
    """One rank of exercise 12.1's check: the answer, with the classifier's right rows drawn from
    ``seed`` (None: the notebook's), the rows this rank evaluated and the collectives it ran
    (whatever it called them by)."""
    import torch

    from course_utils.debugging import failure_zoo

    from .on_ranks import collectives_called

    real, rows = failure_zoo._correct_on, []

    def watched(indices: list[int], size: int, device: Any) -> Any:  # the rows this rank evaluates
        rows.extend(int(i) for i in indices)
        if seed is None:
            return real(indices, size, device)
        right = torch.rand(size, generator=torch.Generator().manual_seed(seed)) < 0.5
        return right[indices].float().to(device)

    failure_zoo._correct_on = watched
    try:
        with collectives_called() as calls:
            value = answer(rank, world_size)
    finally:
        failure_zoo._correct_on = real
    return {"value": value, "kinds": [kind for kind, _ in calls], "rows": sorted(set(rows))}


def drawn_accuracy(seed: int | None, size: int = 10) -> float:
    """The accuracy over the whole set that :func:`evaluation_rank` gives with ``seed``."""
    import torch

    if seed is None:
        return 0.6  # the notebook's classifier on its 10 rows (its own output, asserted there)
    return (torch.rand(size, generator=torch.Generator().manual_seed(seed)) < 0.5).float().mean().item()


def order_rank(rank: int, world_size: int, answer: Any) -> dict:
    """One rank of exercise 12.3's check: what the answer returns (read as numbers), the collectives
    it ran and how many bytes it handed to those that combine the ranks' values."""
    from .answers import real, reals
    from .on_ranks import collectives_called

    with collectives_called() as calls:
        grads, flag = answer(rank, world_size)
    combining = ("all_reduce", "reduce", "reduce_scatter", "all_gather")
    summed = sum(size for kind, size in calls if kind in combining)
    return {"grads": reals(grads) or list(grads), "flag": flag if real(flag) is None else real(flag),
            "kinds": [kind for kind, _ in calls], "summed": summed}


def join_rank(rank: int, world_size: int, answer: Any, counts: list[int]) -> dict:
    """One rank of exercise 12.4's check: the weights, and how many values the rank all-reduced
    (DDP's reducer included, from the Flight Recorder; None where this torch has none).
    ``counts``: each rank's batches; the answer's ``my_batches`` (the notebook's, for [3, 2]) hands
    them out."""
    import functools

    from course_utils.debugging.training_bugs import uneven_batches

    from .on_ranks import reductions_recorded

    if "my_batches" in getattr(answer, "__globals__", {}):  # sent by value: this rank's own copy
        answer.__globals__["my_batches"] = functools.partial(uneven_batches, counts)

    with reductions_recorded() as recorded:
        weights = answer(rank, world_size)
    reduced = None if recorded is None else sum(n for kind, n in recorded if kind == "all_reduce")
    return {"weights": weights, "reduced": reduced}


def saving_rank(rank: int, world_size: int, save_and_load: Any, path: str, delay: float) -> dict:
    """One rank of one case of exercise 12.8's check: rank 0's ``torch.save`` takes ``delay`` s, on
    a path that holds last run's checkpoint; the case notes the collectives the answer ran."""
    from .on_ranks import collectives_called

    with collectives_called() as calls:
        result = save_and_load_rank(rank, world_size, save_and_load, path, delay)
    result.update(kinds=[kind for kind, _ in calls])
    return result
