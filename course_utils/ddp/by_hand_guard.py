"""What keeps a DDPByHand from being used wrongly without a word (notebook 06): an optimizer's step
over its parameters while a backward pass left all-reduces unfinished, a gradient written by a hook
after the wrapper's, parameters converted after wrapping, a backward pass that builds a graph of
the gradients, and a wrapper whose parameters a newer wrapper has taken over."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["guard_steps", "own_gradient", "refuse_changed_parameters", "refuse_late_writes", "take_over"]

#: the wrappers alive in this process: an optimizer's step checks that none of them has all-reduces
#: of its parameters unfinished (the hook is registered once, with the first wrapper)
_WRAPPERS: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK: list = []


def _no_step_before_finish(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped = {p for group in optimizer.param_groups for p in group["params"]}
    for wrapper in list(_WRAPPERS):
        if wrapper.ready and not stepped.isdisjoint(wrapper.index_of):
            raise RuntimeError("optimizer.step() after a backward pass that left all-reduces "
                               "unfinished (a parameter that trains got no gradient, so some buckets "
                               "never started): .grad is not the mean over the ranks. "
                               "finish_gradient_synchronization() says which bucket")


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


def refuse_late_writes(wrapper: Any) -> None:
    """At the end of a synchronised backward pass: raise if a gradient was replaced, or written in
    place, after the wrapper's hook took it (a hook registered on the parameter after wrapping
    runs after the wrapper's; DDP's reducer runs after every hook of a parameter)."""
    late = [wrapper._name(p) for p, (grad, version, _) in wrapper.ready.items()
            if p.grad is not grad or grad._version != version]
    if late:
        raise RuntimeError(f"{late[:3]} changed after the wrapper had started their all-reduce: a "
                           "hook registered on a parameter after wrapping runs after the wrapper's, "
                           "so register such hooks before building DDPByHand")


def own_gradient(param: torch.nn.Parameter) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """``param.grad``, its version and, if it had to be copied, the tensor it was. A gradient that
    is a slice of a larger tensor (autograd's gradients of a ``torch.cat`` of parameters, or a view
    of a flat buffer of one's own) shares its version counter with the other slices, which may be
    written rightly: it is copied into a tensor of its own until the wrapper has finished, so that
    a write to it shows in its version; finish then copies the mean into the original tensor and
    puts it back in ``.grad``, as DDP leaves the mean in the gradient the backward pass made."""
    if param.grad.requires_grad:
        raise RuntimeError("backward(create_graph=True) reached a parameter: the all-reduce is not "
                           "part of the gradient's graph, so a second backward would differentiate "
                           "this rank's gradient alone (torch's DDP raises here too: it writes the "
                           "mean into .grad in place)")
    grad = original = param.grad
    if grad.numel() * grad.element_size() != grad.untyped_storage().nbytes():
        param.grad = grad = grad.clone(memory_format=torch.contiguous_format)
    else:
        original = None
    return grad, grad._version, original


def refuse_changed_parameters(wrapper: Any) -> None:
    """Raise if a parameter changed dtype or device since ``wrapper`` was built (``model.double()``
    after wrapping: its buckets would round the gradients to the old dtype; torch's DDP stops
    synchronising them without a word)."""
    if [(p.dtype, p.device) for p in wrapper.trainable] != wrapper.layout:
        raise RuntimeError("a parameter changed dtype or device after wrapping (model.double(), "
                           ".to(...)): convert or move the model first, then wrap it, as DDP asks")
