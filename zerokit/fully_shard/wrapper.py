"""`FullyShard(model)`: zerokit.fully_shard in one call, as a wrapper (the course's stage-3 shape).

    fs = zerokit.FullyShard(model, units=list(model.blocks), compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(fs.parameters(), lr=1e-3)

is `fully_shard(block, ...)` for each unit, then `fully_shard(model, ...)`, with the course's
names for FSDP2's settings (compute_dtype: `MixedPrecisionPolicy(param_dtype=compute_dtype,
reduce_dtype=torch.float32)`), and `fs.module` the model itself (sharded in place). Its
parameters are the model's: DTensors, each this rank's dim-0 rows.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .api import FSDPModule, fully_shard
from .state import state_of

__all__ = ["FullyShard", "default_units", "memory_categories"]


def default_units(model):
    """Every module below the root that directly owns a trainable parameter, innermost first; but a module
    that shares a parameter with one outside it (a tied embedding and head) is left to the root, as one
    fully_shard call must hold every place of a parameter."""
    owners = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(p, []).append(m)
    units = []
    for m in reversed(list(model.modules())):
        inside = set(m.modules())
        if m is not model and any(p.requires_grad for p in m.parameters(recurse=False)) \
                and all(o in inside for p in m.parameters(recurse=False) for o in owners[p]):
            units.append(m)
    return units


def _depth(model, unit):
    first = unit[0] if isinstance(unit, (list, tuple)) else unit
    for name, m in model.named_modules():
        if m is first:
            return name.count(".") + 1 if name else 0
    raise ValueError(f"units must be modules inside the model: {type(first).__name__} is not one of model.modules()")


class FullyShard(nn.Module):
    """Shard `model` in place with zerokit.fully_shard: each unit (a module, or a list gathered together)
    a group, then the model itself (the root) for what no unit holds.

    compute_dtype: None (fp32), torch.bfloat16 or torch.float16: the gathered weights compute in it, the
        shards (so the optimizer) stay fp32, gradients are reduce-scattered in fp32.
    units: default: every module that directly owns a trainable parameter (default_units).
    group: the process group to shard over (default: every rank).
    prefetch: each unit's forward starts the next unit's all-gather (FSDP2's explicit forward prefetch);
        backward prefetches the unit before it in forward order anyway, as FSDP2 does.
    reshard_after_forward, output_dtype, cast_forward_inputs: fully_shard's and MixedPrecisionPolicy's.
    """

    def __init__(self, model, compute_dtype=None, units=None, group=None, prefetch=True, reshard_after_forward=None,
                 output_dtype=None, cast_forward_inputs=True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("zerokit.FullyShard needs an initialised torch.distributed process group: run your "
                               "code on several ranks with zerokit.launch (or torchrun)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"zerokit.FullyShard takes a model (an nn.Module), not {type(model).__name__}")
        if compute_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, not {compute_dtype}")
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype,
                                      reduce_dtype=torch.float32 if self.compute_dtype else None,
                                      output_dtype=output_dtype, cast_forward_inputs=cast_forward_inputs)
        group = group or dist.group.WORLD
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend(group) == "nccl" else "cpu"
        mesh = DeviceMesh.from_group(group, device_type)
        units = default_units(model) if units is None else list(units)
        units.sort(key=lambda u: -_depth(model, u))  # bottom-up: a unit inside another is sharded first
        settings = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": policy}
        for unit in units:
            fully_shard(list(unit) if isinstance(unit, (list, tuple)) else unit, **settings)
        fully_shard(model, **settings)
        self.module = model
        self.units = [u[0] if isinstance(u, (list, tuple)) else u for u in units]
        if prefetch:
            order = [u for u in self.units if state_of(u).group is not None]
            for unit, following in zip(order, order[1:]):
                unit.set_modules_to_forward_prefetch([following])

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # ---- FSDP2's controls, a unit named by its module (None: the model) --------------------------------

    def _module(self, module):
        module = self.module if module is None else module
        if not isinstance(module, FSDPModule):
            raise ValueError(f"{type(module).__name__} is not a unit of this FullyShard")
        return module

    def unshard(self, module=None, async_op=False):
        return self._module(module).unshard(async_op=async_op)

    def reshard(self, module=None):
        self._module(module).reshard()

    def set_modules_to_forward_prefetch(self, module, modules):
        self._module(module).set_modules_to_forward_prefetch(list(modules))

    def set_modules_to_backward_prefetch(self, module, modules):
        self._module(module).set_modules_to_backward_prefetch(list(modules))

    def set_requires_gradient_sync(self, requires_gradient_sync):
        self.module.set_requires_gradient_sync(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward, module=None):
        self._module(module).set_reshard_after_forward(reshard_after_forward)

    def _reshard_all(self):
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()  # the root stays gathered after a forward: show the DTensors again

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch's clip_grad_norm_ on the DTensor gradients: the norm over every rank's rows (a collective)."""
        self._reshard_all()
        norm = torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm, norm_type, error_if_nonfinite)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def full_parameters(self):
        """{name: the full tensor} of every parameter, as copies: a collective (an all-gather each)."""
        self._reshard_all()
        return {name: p.full_tensor() for name, p in self.module.named_parameters()}

    def reset_iter_state(self):
        """After a forward or backward that raised: reshard everything and forget the step (FSDP2's)."""
        self.module.reset_iter_state()

    def memory_categories(self):
        """What the model's fully_shard calls hold now, by category (memory_categories(model))."""
        return memory_categories(self.module)


def memory_categories(model):
    """{category: tensors} that every fully_shard call inside `model` holds now (ParamGroup.memory_categories),
    for zerokit.memory.census: storage, not DTensors (a DTensor has none of its own)."""
    out = {"parameters": [], "gradients": []}
    seen = []
    for m in model.modules():
        state = state_of(m)
        if state is None or any(state is s for s in seen):
            continue
        seen.append(state)
        for group in state.groups:
            for category, tensors in group.memory_categories().items():
                out[category] += tensors
    return out
