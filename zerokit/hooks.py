"""Hooks into autograd and modules, the two small helpers every stage that hooks shares.

    weak_hook(method)   a hook that calls `method` without keeping its object alive
    in_backward()       whether this code runs inside autograd's backward
    EndOfBackward       a callback once the backward under way ends, and a nested backward refused

ZeRO-2 hooks each parameter's gradient (lesson 04), ZeRO-3 each unit's forward and backward
(lesson 05), and a recomputed forward (activation checkpointing, lesson 08) runs those hooks
again inside backward: the stages, zerokit.DataParallel and lesson 11's hpZ all call these.
"""

import weakref

import torch

__all__ = ["weak_hook", "in_backward", "EndOfBackward"]


def weak_hook(method):
    """A hook that calls `method` without keeping its object alive.

    Hooks on parameters are held by C++, where Python's garbage collector cannot see the
    cycle parameter -> hook -> optimizer -> parameter; a bound method there would keep
    every optimizer ever built (and its shards) alive for as long as the model lives.
    """
    ref = weakref.WeakMethod(method)

    def hook(*args):
        target = ref()
        return None if target is None else target(*args)

    return hook


def in_backward() -> bool:
    """Whether this code runs inside autograd's backward (a hook, or a recomputed forward).

    The autograd engine numbers each backward call (a "graph task") while it executes it;
    outside of one the id is -1. PyTorch's FSDP asks the same question the same way.
    """
    return torch._C._current_graph_task_id() != -1


class EndOfBackward:
    """Call `callback` once the backward under way is over: what reduces gradients bucket by
    bucket needs the end to send the buckets not yet complete and wait for every transfer.

    Each gradient hook calls `arm()`; the first of a backward queues the callback with autograd's
    engine, which runs it after the last gradient of that backward is written. `pending` says
    whether one is queued (a backward that raised leaves it so); its owner calls `reset()` when it
    starts afresh. `who` names the owner in the refusal.

    A backward run inside another one (torch.utils.checkpoint with use_reentrant=True) is refused:
    it is a graph task of its own that ends first, and its end would send every bucket not yet
    complete, with zeros, buckets that would be sent again when their gradients came.
    """

    def __init__(self, callback, who):
        self.callback, self.who = weak_hook(callback), who  # weak: the owner holds this object
        self.task = None  # the backward (graph task) whose end is queued; None: none

    @property
    def pending(self):
        return self.task is not None

    def arm(self):
        task = torch._C._current_graph_task_id()
        if self.task is None:
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
            self.task = task
        elif task != self.task:
            self.refuse()

    def reset(self):
        self.task = None

    def _end(self):
        if torch._C._current_autograd_node() is not None:  # a nested backward's end, not ours
            self.refuse()
        self.callback()

    def refuse(self):
        raise RuntimeError(f"a backward ran inside another backward (torch.utils.checkpoint with use_reentrant=True?): "
                           f"{self.who}; use torch.utils.checkpoint(..., use_reentrant=False)")
