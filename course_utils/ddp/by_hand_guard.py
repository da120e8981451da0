"""What keeps a DDPByHand from being used wrongly without a word (notebook 06): an optimizer's step
over its parameters before ``finish_gradient_synchronization()``, a gradient written between the
backward pass and that call, and a wrapper whose parameters a newer wrapper has taken over."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["guard_steps", "own_gradient", "refuse_late_writes", "refuse_written_gradients", "take_over"]

#: the wrappers alive in this process: an optimizer's step checks that none of them has all-reduces
#: of its parameters unfinished (the hook is registered once, with the first wrapper)
_WRAPPERS: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK: list = []


def _no_step_before_finish(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped = {p for group in optimizer.param_groups for p in group["params"]}
    for wrapper in list(_WRAPPERS):
        if wrapper.ready and not stepped.isdisjoint(wrapper.index_of):
            raise RuntimeError("optimizer.step() before finish_gradient_synchronization(): the last "
                               "backward's all-reduces are not finished, so .grad is not yet the "
                               "mean over the ranks (torch's DDP finishes them at the end of backward)")


def guard_steps(wrapper: Any) -> None:
    """From now on, an optimizer's step over ``wrapper``'s parameters while its all-reduces are
    unfinished raises."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_no_step_before_finish))
    _WRAPPERS.add(wrapper)


def take_over(param: torch.nn.Parameter, wrapper: Any) -> None:
    """``wrapper`` is about to hook ``param``: remove the hook an earlier wrapper gave it, and mark
    that wrapper replaced (its forward raises: it would no longer synchronise anything)."""
    if hasattr(param, "by_hand_hook"):
        earlier = param.by_hand_owner()
        if earlier is not None and earlier.ready:
            raise RuntimeError("the wrapper these parameters had still has all-reduces unfinished: "
                               "call its finish_gradient_synchronization() before wrapping them again")
        param.by_hand_hook.remove()
        if earlier is not None:
            _WRAPPERS.discard(earlier)
            earlier.replaced = True
    param.by_hand_owner = weakref.ref(wrapper)


def refuse_written_gradients(wrapper: Any) -> None:
    """Raise if a gradient ``wrapper`` marked ready was replaced or written since the backward pass
    ended (``optimizer.zero_grad()``, in-place clipping): finish would put the means over it."""
    changed = [wrapper._name(p) for p, (grad, version) in wrapper.ready.items()
               if p.grad is not grad or grad._version != version]
    if changed:
        for _, _, handle in wrapper.in_flight:
            handle.wait()
        wrapper._reset()
        raise RuntimeError(f"{changed[:3]} changed between the backward pass and "
                           "finish_gradient_synchronization() (optimizer.zero_grad(), or another "
                           "write to .grad): finish right after each synchronised backward, as "
                           "torch's DDP has finished by then")


def refuse_late_writes(wrapper: Any) -> None:
    """At the end of a synchronised backward pass: raise if a gradient was replaced, or written in
    place, after the wrapper's hook took it (a hook registered on the parameter after wrapping
    runs after the wrapper's; DDP's reducer runs after every hook of a parameter)."""
    late = [wrapper._name(p) for p, (grad, version) in wrapper.ready.items()
            if p.grad is not grad or grad._version != version]
    if late:
        raise RuntimeError(f"{late[:3]} changed after the wrapper had started their all-reduce: a "
                           "hook registered on a parameter after wrapping runs after the wrapper's, "
                           "so register such hooks before building DDPByHand")


def own_gradient(param: torch.nn.Parameter) -> tuple[torch.Tensor, int]:
    """``param.grad`` and its version, for the checks above. A gradient that autograd handed as a
    slice of a larger tensor (the gradients of a ``torch.cat`` of parameters) shares its version
    counter with the other slices, which the wrapper rightly writes: it is first copied into a
    tensor of its own, so that any write to it shows in its version."""
    grad = param.grad
    if grad.numel() * grad.element_size() != grad.untyped_storage().nbytes():
        param.grad = grad = grad.clone(memory_format=torch.contiguous_format)
    return grad, grad._version
