"""What differs between the PyTorch releases the course runs on, in one place.

The course pins torch 2.13 (what nbval checks) and runs on Colab's release too (2.11 in 2026);
``make compat`` proves both (``compat_check.TESTED_RELEASES``). Every call whose name or behaviour
changed between those releases goes through here, so that a lesson module never asks which
release it is on.

- ``reduce_scatter_single`` / ``all_gather_single``: the collectives on one flat tensor (notebook
  09). Torch 2.13 named them so; every earlier release calls them ``reduce_scatter_tensor`` and
  ``all_gather_into_tensor``, names that 2.13 still accepts with a ``FutureWarning``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVE_NAMES", "all_gather_single", "collective_name", "reduce_scatter_single",
           "torch_release"]

#: The flat-tensor collectives: torch 2.13's name, and the name every earlier release uses.
COLLECTIVE_NAMES = {"reduce_scatter_single": "reduce_scatter_tensor",
                    "all_gather_single": "all_gather_into_tensor"}


def torch_release() -> tuple[int, int]:
    """The running torch's (major, minor), e.g. ``(2, 13)`` for ``2.13.0+cpu``."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def collective_name(name: str) -> str:
    """The name under which this torch offers the flat-tensor collective ``name`` (2.13's name)."""
    if name not in COLLECTIVE_NAMES:
        raise ValueError(f"name must be one of {sorted(COLLECTIVE_NAMES)}, got {name!r}")
    return name if hasattr(dist, name) else COLLECTIVE_NAMES[name]


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:  # noqa: A002
    """Sum ``input`` (N equal slices) over the ranks; this rank's slice lands in ``output``."""
    return getattr(dist, collective_name("reduce_scatter_single"))(output, input, **kwargs)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:  # noqa: A002
    """Every rank's ``input``, in rank order, concatenated into ``output`` (N times its size)."""
    return getattr(dist, collective_name("all_gather_single"))(output, input, **kwargs)
