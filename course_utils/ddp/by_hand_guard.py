"""What keeps a DDPByHand from being used wrongly without a word (notebook 06): an optimizer's step
over its parameters while a backward pass left all-reduces unfinished, parameters converted after
wrapping, and a wrapper whose parameters a newer wrapper has taken over."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["guard_steps", "refuse_changed_parameters", "refuse_unfinished", "take_over"]

#: the wrappers alive in this process: an optimizer's step checks that none of them has all-reduces
#: of its parameters unfinished (the hook is registered once, with the first wrapper)
_WRAPPERS: weakref.WeakSet = weakref.WeakSet()
_STEP_HOOK: list = []


def _no_step_before_finish(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped = {p for group in optimizer.param_groups for p in group["params"]}
    for wrapper in list(_WRAPPERS):
        if wrapper.ready and not stepped.isdisjoint(wrapper.index_of):
            raise RuntimeError("optimizer.step() after a synchronised backward pass that did not "
                               "finish its all-reduces (a parameter that trains got no gradient, or "
                               "the backward pass raised): .grad is not the mean over the ranks "
                               "(finish_gradient_synchronization() says which bucket is missing)")


def guard_steps(wrapper: Any) -> None:
    """From now on, an optimizer's step over ``wrapper``'s parameters while its all-reduces are
    unfinished raises."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_no_step_before_finish))
    _WRAPPERS.add(wrapper)


def take_over(param: torch.nn.Parameter, wrapper: Any, hook: Any) -> None:
    """``wrapper`` hooks ``param``'s gradient accumulator with ``hook`` (a function of the
    accumulator's two arguments): remove the hook an earlier wrapper gave it, and mark that wrapper
    replaced (its forward raises: it would no longer synchronise anything). Who hooked it is noted
    in the accumulator's metadata, not on the parameter, which stays picklable (``torch.save``)."""
    accumulator = get_gradient_edge(param).node  # autograd's AccumulateGrad of param
    if "by_hand" in accumulator.metadata:
        owner, handle = accumulator.metadata["by_hand"]
        earlier = owner()
        if earlier is not None and (earlier.ready or earlier.armed):
            raise RuntimeError("the wrapper these parameters had is inside a step (a forward with "
                               "gradients whose backward pass has not finished synchronising): "
                               "finish that step, or run that forward under torch.no_grad(), before "
                               "wrapping them again")
        handle.remove()
        if earlier is not None:
            _WRAPPERS.discard(earlier)
            earlier.replaced = True
    wrapper.accumulators.append(accumulator)  # held: autograd then uses it in every graph
    accumulator.metadata["by_hand"] = (weakref.ref(wrapper), accumulator.register_hook(hook))


def refuse_changed_parameters(wrapper: Any) -> None:
    """Raise if a parameter changed dtype or device since ``wrapper`` was built (``model.double()``
    after wrapping: its buckets would round the gradients to the old dtype; torch's DDP stops
    synchronising them without a word)."""
    if [(p.dtype, p.device) for p in wrapper.trainable] != wrapper.layout:
        raise RuntimeError("a parameter changed dtype or device after wrapping (model.double(), "
                           ".to(...)): convert or move the model first, then wrap it, as DDP asks")


def refuse_unfinished(wrapper: Any) -> None:
    """A forward with gradients after a synchronised backward pass that did not finish (a bucket
    never started, or the pass raised before its end): raise, as DDP's forward does."""
    if wrapper.next_bucket < len(wrapper.buckets):
        wrapper.finish_gradient_synchronization()  # raises, naming the bucket
    for _, _, handle in wrapper.in_flight:
        handle.wait()
    wrapper._reset()
    raise RuntimeError("the last synchronised backward pass raised (or was interrupted) after its "
                       "all-reduces started, so its gradients were never averaged: zero them before "
                       "the next step (torch's DDP raises at this forward too)")
