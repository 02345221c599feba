r"""The hooks of one `fully_shard` call (FSDP2's FSDPState), and what all of a model's calls share.

Each call's module gets a forward pre-hook and a forward hook; they run its group's
`pre_forward` and `post_forward`, cast inputs and outputs as the MixedPrecisionPolicy says,
and hang a hook on every output that requires grad, whose first gradient starts the group's
backward (`pre_backward`). The module that runs forward first is the **root**: at that first
forward it finds every fully_shard call inside it (`lazy_init`), shares one context with them
(the forward order, the backward in progress), and leaves its own parameters gathered after
forward unless told otherwise (its backward comes first). Once per backward the root queues a
callback into autograd's engine that finishes what hooks could not: the groups whose inputs
needed no gradient (so their post-backward function never ran), and, on the last backward of a
step (`set_is_last_backward`), the forgetting of the forward order.

Inputs and outputs are walked as trees (tuples, lists, dicts, named tuples, dataclasses), so a
block may take or return any of them and still be hooked on every tensor inside.
"""

import copy
import dataclasses
import weakref
from functools import partial

import torch
from torch.autograd import Variable

from .group import ParamGroup, Phase

__all__ = ["ModuleState", "map_tensors", "tensors_in", "state_of"]

_STATES = weakref.WeakKeyDictionary()  # module -> the ModuleState fully_shard gave it


def state_of(module):
    """The ModuleState fully_shard gave `module`, or None."""
    return _STATES.get(module)


def map_tensors(fn, obj):
    """`obj` with every tensor t inside it (any nesting of tuples, lists, dicts, named tuples and
    dataclasses) replaced by fn(t); containers rebuilt, everything else kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, map_tensors(fn, getattr(obj, f.name)))
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(map_tensors(fn, x) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        new = copy.copy(obj)  # keeps the dict's type (OrderedDict, a subclass)
        for k, v in obj.items():
            new[k] = map_tensors(fn, v)
        return new
    return obj


def tensors_in(obj):
    """Every tensor inside `obj`, in the order map_tensors visits them."""
    found = []
    map_tensors(lambda t: found.append(t) or t, obj)
    return found


def _replace_grad_tensors(obj, replacements):
    """`obj` with each tensor that requires grad replaced by the next of `replacements`."""
    return map_tensors(lambda t: next(replacements) if t.requires_grad else t, obj)


def _cast(dtype, t):
    return t.to(dtype) if torch.is_floating_point(t) and t.dtype != dtype else t


class Shared:
    """What every fully_shard call of one model shares, made by the root at its first forward."""

    def __init__(self):
        self.states = []  # every ModuleState inside the root, the root first
        self.forward_root = None  # the state whose forward this step began with
        self.post_forward_order = []  # groups in the order their forwards ended (backward prefetches by it)
        self.callback_queued = False
        self.is_last_backward = True
        self.reducing = []  # reduce-scatters in flight (group.Reducing), oldest first


class ModuleState:
    """One fully_shard call: its modules (one, or a list given together), its ParamGroup (None if it
    owns no parameter), its MixedPrecisionPolicy, and the hooks that drive the group."""

    def __init__(self, modules, group, mp_policy, auto_reshard_after_forward):
        self.modules, self.group, self.mp_policy = modules, group, mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root = None
        self.shared = Shared()
        self.phase = Phase.IDLE
        self.forward_prefetch, self.backward_prefetch = [], []  # explicit lists of ModuleStates
        self.to_run = set()  # a list of modules: those whose forward has not run yet in this pass
        for module in modules:
            _STATES[module] = self
        if len(modules) == 1:
            modules[0].register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            modules[0].register_forward_hook(self._post_forward, prepend=False)
        else:
            for module in modules:
                module.register_forward_pre_hook(self._pre_forward_of_list, prepend=True, with_kwargs=True)
                module.register_forward_hook(partial(self._post_forward_of_list, module), prepend=False,
                                             always_call=True)

    @property
    def groups(self):
        return [] if self.group is None else [self.group]

    # ---- the root ------------------------------------------------------------------------------------------

    def lazy_init(self):
        """At the root's first forward: find every fully_shard call inside it and share one context."""
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError("fully_shard's root must be one module, not a list: call fully_shard on the "
                               "model that holds them last")
        self.is_root = True
        root = self.modules[0]
        seen = []
        for name, module in root.named_modules():
            state = state_of(module)
            if state is None or any(state is s for s in seen):
                continue
            if module is not root:
                if state.is_root is not None:
                    raise RuntimeError(f"fully_shard on {name} ran a forward before the root's first forward: "
                                       "run the first forward through the model the last fully_shard was given")
                state.is_root = False
            seen.append(state)
            if state.group is not None and state.group.name is None:
                state.group.name = name or type(module).__name__
        if self.auto_reshard_after_forward and self.group is not None:
            self.group.post_forward_mesh = None  # reshard_after_forward=None: the root stays gathered
        owner = {}
        for state in seen:
            state.shared = self.shared
            for group in state.groups:
                group.shared = self.shared
                group.lazy_init()
                for p in group.params:
                    if p.orig_id in owner:
                        raise ValueError(f"{p.name} is shared between {owner[p.orig_id]} and {group.name}, two "
                                         "fully_shard calls: shard the modules that share it in one call, "
                                         "fully_shard([a, b])")
                    owner[p.orig_id] = group.name
        self.shared.states = seen

    def _root_pre_forward(self, args, kwargs):
        self.lazy_init()
        if self.shared.forward_root is None:
            self.shared.forward_root = self
            device = self.group.device if self.group is not None else None
            if device is not None and device.type != "cpu":  # inputs to the device, as DDP and FSDP2 move them
                args, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (args, kwargs))
        return args, kwargs

    # ---- forward ------------------------------------------------------------------------------------------

    def _pre_forward(self, module, args, kwargs):
        if self.phase is Phase.PRE_BACKWARD:  # forward again inside backward: recomputation
            if self.group is not None and not self.group.is_unsharded:
                self.group.unshard()
                self.group.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first = self.phase is not Phase.FORWARD
        self.phase = Phase.FORWARD
        if first:
            args, kwargs = self._root_pre_forward(args, kwargs)
        args, kwargs = self._cast_inputs(args, kwargs)
        if self.group is not None:
            args, kwargs = self.group.pre_forward(args, kwargs, tensors_in, _replace_grad_tensors)
        if first:
            for state in self.forward_prefetch:
                for group in state.groups:
                    ParamGroup.prefetch(group, Phase.FORWARD)
        return args, kwargs

    def _post_forward(self, module, inputs, output):
        if self.phase is Phase.PRE_BACKWARD:
            return self._cast_output(output)
        if self.group is not None:
            self.group.post_forward()
        output = self._hook_backward(output)
        self.phase = Phase.IDLE
        if self.shared.forward_root is self:
            output = self._finish_lists(output)
            self.shared.forward_root = None
        return self._cast_output(output)

    def _pre_forward_of_list(self, module, args, kwargs):
        if not self.to_run:
            self.to_run.update(self.modules)
        return self._pre_forward(module, args, kwargs)

    def _post_forward_of_list(self, module, hooked, inputs, output):
        if module in self.to_run:
            self.to_run.discard(module)
            if not self.to_run:
                return self._post_forward(hooked, inputs, output)
        return self._cast_output(output)

    def _finish_lists(self, output):
        """At the root's post-forward: a list of modules some of which never ran this pass ends its forward."""
        for state in reversed(self.shared.states):
            if state is self or not state.to_run:
                continue
            if state.group is not None:
                state.group.post_forward()
            output = state._hook_backward(output)
            state.phase = Phase.IDLE
            output = state._cast_output(output)
            state.to_run.clear()
        return output

    def _cast_inputs(self, args, kwargs):
        dtype = self.mp_policy.param_dtype
        if not (self.mp_policy.cast_forward_inputs and dtype):
            return args, kwargs
        return map_tensors(partial(_cast, dtype), args), map_tensors(partial(_cast, dtype), kwargs)

    def _cast_output(self, output):
        dtype = self.mp_policy.output_dtype
        return output if dtype is None else map_tensors(partial(_cast, dtype), output)

    def _hook_backward(self, output):
        if torch.is_grad_enabled():
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    # ---- backward ------------------------------------------------------------------------------------------

    def _pre_backward(self, grad):
        self.phase = Phase.PRE_BACKWARD
        if not self.shared.callback_queued:
            self.shared.callback_queued = True
            Variable._execution_engine.queue_callback(self._after_backward)
        for group in self.groups:
            group.pre_backward(default_prefetch=not self.backward_prefetch)
        for state in self.backward_prefetch:
            for group in reversed(state.groups):
                ParamGroup.prefetch(group, Phase.PRE_BACKWARD)
        return grad

    def _after_backward(self):
        """Autograd's engine calls this once the backward is over (queued by the first pre-backward)."""
        shared = self.shared
        shared.forward_root = None
        for state in shared.states:
            state.to_run.clear()
            for group in reversed(state.groups):
                if group.phase is not Phase.POST_BACKWARD:
                    group.post_backward()  # a group none of whose inputs needed a gradient
                group.phase = Phase.IDLE
            state.phase = Phase.IDLE
        while shared.reducing:  # every gradient lands before the optimizer can read it
            shared.reducing[0].group.finish_reduce()
        for state in shared.states:
            if shared.is_last_backward:
                for group in state.groups:
                    group.finalize_backward()
        if shared.is_last_backward:
            shared.post_forward_order.clear()
        shared.callback_queued = False

    def reset_iter_state(self):
        if self.is_root is False:
            raise RuntimeError("reset_iter_state is for the root: call it on the model the last fully_shard was given")
        for state in self.shared.states or [self]:
            state.to_run.clear()
            state.phase = Phase.IDLE
            for group in state.groups:
                group.reset_iter_state()
        self.shared.post_forward_order.clear()
        self.shared.forward_root = None
        self.shared.callback_queued = False
