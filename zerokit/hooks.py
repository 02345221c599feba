"""Hooks into autograd and modules, the two small helpers every stage that hooks shares.

    weak_hook(method)   a hook that calls `method` without keeping its object alive
    in_backward()       whether this code runs inside autograd's backward

ZeRO-2 hooks each parameter's gradient (lesson 04), ZeRO-3 each unit's forward and backward
(lesson 05), and a recomputed forward (activation checkpointing, lesson 08) runs those hooks
again inside backward: the stages, zerokit.DataParallel and lesson 11's hpZ all call these two.
"""

import weakref

import torch

__all__ = ["weak_hook", "in_backward"]


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
