"""Which gradients share a bucket, by DDP's rule (notebook 06, DDP by hand).

Torch's DDP groups the gradients it all-reduces into buckets of about ``bucket_cap_mb`` MiB. The
rule that fills a bucket is the same everywhere: walk the parameters in some order; each joins the
current bucket, and the bucket closes as soon as its size has **reached** the cap, so a bucket can
pass the cap by its last parameter; a parameter is never split (:func:`fill_buckets`). What
differs is the order walked:

- :func:`assign_buckets`: the reverse of registration order, the order backward usually produces
  the gradients in. It is what DDP's rebuild makes after its first iteration when the gradients
  did arrive in that order (DDP rebuilds in the order they arrived), and what ``DDPByHand`` starts
  from before it rebuilds the same way.
- :func:`ddp_construction_buckets`: what DDP makes when it is built: registration order, then the
  list of buckets reversed. DDP keeps these forever with ``find_unused_parameters=True`` (no
  rebuild); by default it sends its first iteration in one bucket instead, then rebuilds.

Both give the same buckets on many models and different ones on others: on
``comm_heavy_model(512)`` with a cap of 0.75 MiB, 4 buckets after a rebuild, 5 as built.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["assign_buckets", "ddp_construction_buckets", "fill_buckets"]


def fill_buckets(parameters: Iterable[nn.Parameter], bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """``parameters``, in the order given, into buckets that each close once they reach
    ``bucket_cap_mb`` MiB (2**20 bytes, rounded down to whole bytes as DDP does). ``None``: a bucket
    per parameter. As in DDP, parameters of different dtypes or devices never share a bucket (one
    flat tensor holds a bucket): each (dtype, device) fills a bucket of its own. The buckets are
    listed in the order of their first parameters (DDP may list buckets of different dtypes in
    another order; they hold the same parameters and sum to the same values)."""
    cap_bytes = 0 if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)  # whole bytes, as DDP counts
    done: list[tuple[int, list[nn.Parameter]]] = []  # (position of the first parameter, bucket)
    open_: dict[tuple, tuple[int, list[nn.Parameter], int]] = {}  # (dtype, device) -> first, bucket, bytes
    for position, param in enumerate(parameters):
        key = (param.dtype, param.device)
        first, current, size = open_.pop(key, (position, [], 0))
        current.append(param)
        size += param.numel() * param.element_size()
        if size >= cap_bytes:
            done.append((first, current))
        else:
            open_[key] = (first, current, size)
    done += [(first, current) for first, current, _ in open_.values()]
    return [bucket for _, bucket in sorted(done, key=lambda pair: pair[0])]


def assign_buckets(parameters: Iterable[nn.Parameter],
                   bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """The buckets of ``parameters`` walked last first (the order in which backward produces their
    gradients when the layers run in the order they were defined), each filled until it reaches
    ``bucket_cap_mb`` MiB, DDP's rule: what torch's DDP rebuilds after its first iteration when the
    gradients arrived in that order. ``None``: every parameter in a bucket of its own.

    A parameter always joins the current bucket; the bucket closes as soon as its size has reached
    the cap, so a bucket can pass the cap by its last parameter, and a parameter larger than the cap
    closes the bucket it lands in. A parameter is never split, and parameters of different dtypes
    or devices never share a bucket. (An explicit ``bucket_cap_mb`` caps DDP's first bucket too, in
    torch 2.13.)
    """
    return fill_buckets(reversed(list(parameters)), bucket_cap_mb)


def ddp_construction_buckets(parameters: Iterable[nn.Parameter],
                             bucket_cap_mb: float | None) -> list[list[nn.Parameter]]:
    """The buckets torch's DDP makes when it is built with ``find_unused_parameters=True`` (and
    keeps, since it then never rebuilds): ``parameters`` filled in registration order by the same
    rule, then the list of buckets reversed, so that the last layers' bucket comes first."""
    return list(reversed(fill_buckets(parameters, bucket_cap_mb)))
