r"""`fully_shard`, `FSDPModule` and `register_fsdp_forward_method`: FSDP2's calls, on zerokit's records.

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)                      # the root last: bottom-up, as FSDP2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the parameters are DTensors

Each call makes one group of the parameters its module holds that no earlier call took (a
ShardedParam each, one ParamGroup, one ModuleState with the hooks), and changes the module's
class to a subclass of it and of `FSDPModule`, whose methods are the per-module controls.
The policy objects are torch's own (`torch.distributed.fsdp.MixedPrecisionPolicy`,
`OffloadPolicy`, `CPUOffloadPolicy`); the mesh is a torch `DeviceMesh`, 1-D to shard, 2-D
(replicate, shard) for hybrid sharding (HSDP).
"""

import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.contract import _get_registry
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from .group import ParamGroup
from .param import ShardedParam
from .state import ModuleState, state_of

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]


def _default_mesh():
    if not dist.is_initialized():
        raise RuntimeError("zerokit.fully_shard needs an initialised torch.distributed process group: run your "
                           "code on several ranks with zerokit.launch (or torchrun)")
    device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _device(mesh):
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.cuda.current_device())


_NODE_MESHES = {}  # (device type, the mesh's ranks, k) -> the 2-D mesh hpZ reshards to


def _post_forward_mesh(value, mesh):
    """The mesh a group reshards to after forward: None (keep it unsharded), `mesh` (reshard), or for an
    int k, a 2-D mesh whose rows are nodes of k consecutive ranks (hpZ: keep 1/k, gather inside the node)."""
    size = mesh.size(mesh.ndim - 1)
    if isinstance(value, bool):
        return mesh if value else None
    if not isinstance(value, int) or value < 1 or value > size or size % value:
        raise ValueError(f"reshard_after_forward is True, False, None or a divisor of the shard world size "
                         f"({size}): the ranks of a node; got {value!r}")
    if value == 1:
        warnings.warn("reshard_after_forward=1 keeps the whole unsharded parameters (a 'node' of one rank): "
                      "that is reshard_after_forward=False", stacklevel=3)
        return None
    if value == size:
        return mesh
    ranks = mesh.mesh.flatten()
    key = (mesh.device_type, tuple(ranks.tolist()), value)
    if key not in _NODE_MESHES:
        _NODE_MESHES[key] = DeviceMesh(mesh.device_type, ranks.view(-1, value))
    return _NODE_MESHES[key]


def _replicated(module):
    """torch's composable replicate() was applied to `module`: its parameters are DDP's, not ours (read from
    the registry torch's composable APIs keep; FSDP2 asks the same)."""
    return "replicate" in (_get_registry(module) or {})


def _managed_modules(modules):
    """The modules whose own parameters this call takes: `modules` and everything inside them, except
    what an earlier fully_shard call took (a module with a state of its own and everything inside it)
    and what torch's replicate() took."""
    found, seen, roots = [], set(), set(modules)

    def visit(module):
        if _replicated(module) or (module not in roots and state_of(module) is not None):
            return
        seen.add(module)
        for child in module.children():
            if child not in seen:
                visit(child)
        found.append(module)

    for module in modules:
        visit(module)
    return found


def _places(params, modules):
    """{parameter: every (module, name) inside `modules` that holds it}: a shared parameter has several."""
    wanted = {id(p): p for p in params}
    places = {id(p): [] for p in params}
    for root in modules:
        for _, module in root.named_modules(remove_duplicate=False):
            for name, p in module._parameters.items():
                if p is not None and id(p) in wanted and (module, name) not in places[id(p)]:
                    places[id(p)].append((module, name))
    return places


_FSDP_CLASSES = {}  # the original class -> its FSDP subclass


def _refuse_deepcopy(self, memo):
    raise RuntimeError("a module zerokit.fully_shard sharded cannot be deep-copied (its parameters are this rank's "
                       "shards): copy the model before sharding it, or save a state_dict")


def _become_fsdp_module(module):
    cls = type(module)
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _refuse_deepcopy})
    module.__class__ = _FSDP_CLASSES[cls]


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(), ignored_params=None):
    """Shard `module`'s parameters (those no earlier call took) along dim 0 across `mesh`, in place, as
    FSDP2's fully_shard does, and return it; `module` may be a list of modules sharded as one group.

    reshard_after_forward: True (free the gathered parameters after forward, gather again in backward),
        False (keep them until backward), an int k (hpZ: keep 1/k, gather inside nodes of k ranks), or
        None (True, but False for the root: its backward comes first).
    mp_policy: torch's MixedPrecisionPolicy: param_dtype (the compute and all-gather dtype), reduce_dtype
        (the reduce-scatter's; None: the compute dtype), output_dtype, cast_forward_inputs.
    offload_policy: torch's OffloadPolicy, or CPUOffloadPolicy: shards, gradients and the optimizer's
        state in host memory, each group's all-gather input copied to the device.
    ignored_params: parameters left as they are: not sharded, not gathered, not reduced.
    """
    if shard_placement_fn is not None:
        raise NotImplementedError("zerokit.fully_shard shards every parameter on dim 0 (Shard(0)), FSDP2's "
                                  "default: shard_placement_fn is not supported")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy is a torch.distributed.fsdp.MixedPrecisionPolicy, not {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy is a torch.distributed.fsdp.OffloadPolicy (or CPUOffloadPolicy), not "
                        f"{type(offload_policy).__name__}")
    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(f"fully_shard needs a module with a forward: {type(m).__name__} has none (shard the "
                             "modules inside it, or pass them as a list)")
        if state_of(m) is not None:
            raise ValueError(f"{type(m).__name__} is already sharded by zerokit.fully_shard")
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard takes a 1-D mesh (shard) or a 2-D one (replicate, shard), not {mesh.ndim}-D")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError("a 2-D mesh for hybrid sharding needs mesh_dim_names (replicate, shard): "
                         "init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard'))")
    device = _device(mesh)
    post_forward = _post_forward_mesh(True if reshard_after_forward is None else reshard_after_forward, mesh)
    ignored = {id(p) for p in ignored_params or ()}
    params, seen = [], set()
    for m in _managed_modules(modules):
        for p in m.parameters(recurse=False):
            if id(p) not in ignored and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for name, b in m._buffers.items():
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[name] = b.to(device)
    group = None
    if params:
        offload = isinstance(offload_policy, CPUOffloadPolicy)
        shard_rank, shard_size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
        post = None
        if post_forward is not None and post_forward is not mesh:
            post = (post_forward, post_forward.get_local_rank(1), post_forward.size(1))
        places = _places(params, modules)
        records = [ShardedParam(p, places[id(p)], mesh, shard_rank, shard_size, post, device, offload) for p in params]
        group = ParamGroup(records, modules, mesh, post_forward, device, mp_policy, offload)
    ModuleState(modules, group, mp_policy, auto_reshard_after_forward=reshard_after_forward is None)
    for m in modules:
        _become_fsdp_module(m)
    return module


def _states(module, recurse):
    found = []
    for m in (module.modules() if recurse else (module,)):
        state = state_of(m)
        if state is not None and all(state is not s for s in found):
            found.append(state)
    return found


class UnshardHandle:
    """What unshard(async_op=True) returns: wait() finishes the all-gather and shows the parameters (the
    module's forward waits for it anyway)."""

    def __init__(self, group):
        self._group = group

    def wait(self):
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """What fully_shard adds to a module's class (FSDP2's FSDPModule): the per-module controls."""

    _original_class_index = 2  # in the MRO of FSDP<Orig>: [FSDP<Orig>, FSDPModule, <Orig>, ...]

    def __new__(cls, *args, **kwargs):
        """Build the original class (a container indexed by a slice makes a new one of its own class)."""
        original = cls.__mro__[cls._original_class_index]
        self = original.__new__(original, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _state(self):
        return state_of(self)

    def unshard(self, async_op=False):
        """All-gather this module's parameters now (not those of the modules inside it). async_op: return a
        handle whose wait() finishes the gather."""
        group = self._state().group
        if group is not None:
            group.lazy_init()
            group.unshard(async_op=async_op)
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self):
        """Free this module's gathered parameters: it shows the sharded DTensors again."""
        group = self._state().group
        if group is not None:
            group.reshard()

    def set_is_last_backward(self, is_last_backward):
        """False: the next backward is not a step's last (microbatching), so keep what backward prefetches by."""
        self._state().shared.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """False: backward keeps the full local gradients (in the reduce dtype) and sends nothing; the first
        backward with True reduces their sum once. On a 2-D mesh both the reduce-scatter and the all-reduce."""
        for state in _states(self, recurse):
            for group in state.groups:
                group.reduce_grads = group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP: False reduce-scatters but keeps the replicas' sums apart, to be all-reduced once later."""
        for state in _states(self, recurse):
            for group in state.groups:
                group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        """Change reshard_after_forward (a bool) from the next forward on, e.g. the root's to True."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool, not {type(reshard_after_forward).__name__}")
        for state in _states(self, recurse):
            state.auto_reshard_after_forward = False
            for group in state.groups:
                group.post_forward_mesh = group.mesh if reshard_after_forward else None

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """False: keep the gathered parameters after backward (accumulation: no gather before the next forward)."""
        for state in _states(self, recurse):
            for group in state.groups:
                group.reshard_after_backward = reshard_after_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params, *, recurse=True):
        """True: a trainable parameter that got no gradient on this rank sends zeros, so that ranks whose forwards
        used different parameters still reduce-scatter the same sizes (DDP's find_unused_parameters)."""
        for state in _states(self, recurse):
            for group in state.groups:
                group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_unshard_in_backward(self, unshard_in_backward):
        """False: backward needs none of this module's parameters (an embedding's), so it gathers none."""
        for group in self._state().groups:
            group.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules):
        """This module's forward starts the all-gathers of `modules` (FSDPModules) once its own is done."""
        self._state().forward_prefetch = _fsdp_states(modules)

    def set_modules_to_backward_prefetch(self, modules):
        """This module's backward starts the all-gathers of `modules`, instead of the previous one in forward."""
        self._state().backward_prefetch = _fsdp_states(modules)

    def set_custom_all_gather(self, comm):
        """Swap the all-gather: comm(output, input, group, async_op) -> work or None (collectives.AllGather)."""
        for group in self._state().groups:
            group.all_gather = comm

    def set_custom_reduce_scatter(self, comm):
        """Swap the reduce-scatter: comm(output, input, group, op, async_op) (collectives.ReduceScatter)."""
        for group in self._state().groups:
            group.reduce_scatter = comm

    def set_all_reduce_hook(self, hook, *, stream=None):
        """hook(reduced): run on each group's reduced gradient (after the HSDP all-reduce), before the division."""
        for group in self._state().groups:
            group.all_reduce_hook = hook

    def set_post_optim_event(self, event):
        """FSDP2 waits on it before the next all-gather; zerokit's gathers run on the current stream, in order."""

    def reset_iter_state(self):
        """After a forward or backward that raised: reshard everything and forget the step (on the root)."""
        self._state().reset_iter_state()

    def _apply(self, *args, **kwargs):
        # module.to(), .float(), ...: reshard first, then adopt the converted shards as the records' storage
        self.reshard()
        result = super()._apply(*args, **kwargs)
        for group in self._state().groups:
            with torch.no_grad():
                for p in group.params:
                    p.reset_sharded_param()
        return result


def _fsdp_states(modules):
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"prefetch lists hold modules fully_shard sharded; {type(m).__name__} is not one")
    return [state_of(m) for m in modules]


def register_fsdp_forward_method(module, method_name):
    """Run fully_shard's forward hooks around `module.<method_name>` too (a method called instead of forward,
    such as a generate); a no-op on a module fully_shard did not shard."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name}")
    method = getattr(module, method_name)
    state = state_of(module)

    @functools.wraps(method)
    def hooked(self, *args, **kwargs):
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, hooked.__get__(module, type(module)))
