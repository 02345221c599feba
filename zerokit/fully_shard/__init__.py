r"""ZeRO-3 in PyTorch FSDP2's shape, any optimizer: a wrapper, `FullyShard`, and in place, `fully_shard`.

    model = zerokit.FullyShard(model, compute_dtype=torch.bfloat16)  # a wrapper: model.module is yours
    zerokit.fully_shard(model, compute_dtype=torch.bfloat16)        # in place, as FSDP2's fully_shard
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)             # any elementwise torch optimizer
    loss_fn(model(x_local).float(), y_local).backward(); opt.step(); opt.zero_grad()

(The package is `zerokit/fully_shard/`: this file, the two faces; `sharding.py`, the machinery;
`reshard.py`, reshard_after_forward and hpZ; `clip.py`, the global gradient norm. After `import
zerokit`, the name `zerokit.fully_shard` is the function, as in torch: import the package's
parts by their full names, `from zerokit.fully_shard.reshard import ReshardZeRO3Adam`.)

Both faces are one machinery, sharding.py's Sharding (ZeRO3Adam without its Adam, with FSDP2's
controls): the same units, buckets, hooks, shard parameters and gradients. They differ
in what the model shows:

- `FullyShard(model)` is a new module around yours. Its parameters() are this rank's shard
  parameters (a parameter with no piece on this rank is left out); `.module` is your model,
  whose own parameters are the compute parameters: empty outside forward and backward, full
  while their unit computes, and with .grad None (their gradients are reduce-scattered and
  freed as backward goes).
- `fully_shard(model)` returns your model itself, its class changed (to a subclass of it and of
  `FullyShardedModule`, as FSDP2 does): its parameters *are* the shard parameters, flat 1-D
  pieces with a .grad shaped like them (an empty one where this rank holds no piece), so
  `model.named_parameters()` has your names and the optimizer is built on `model.parameters()`.
  While a unit is gathered (its forward, and until its backward where reshard_after_forward
  keeps it), its modules show the compute parameters instead, as FSDP2 shows the unsharded
  ones. The units become FullyShardedModules too, with the per-unit controls below.

The controls, FSDP2's name first, then zerokit's (the README's package section has the table):

- `fully_shard(m, reshard_after_forward=...)`: the same; True, False, None, or k (hpZ), reshard.py;
- `mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`: `compute_dtype=`; the
  gathered weights, forward and backward in 16 bits, the shards, optimizer and reduce-scatter fp32;
- `MixedPrecisionPolicy(output_dtype=, cast_forward_inputs=)`: `output_dtype=`,
  `cast_forward_inputs=`, at every unit: floating outputs cast to output_dtype, inputs to compute_dtype;
- `fully_shard([a, b])`: `units=[[a, b], ...]`, modules gathered and freed as one unit;
- `fully_shard(b)` for each block, then `fully_shard(model)`: `fully_shard(model, units=blocks)`, one
  call (zerokit prefetches across units, so it wants them all at once);
- `m.unshard(async_op)`, `m.reshard()`: the same (the wrapper: `fs.unshard(m)`), gather unit m now or free it;
- `m.set_modules_to_forward_prefetch(ms)`, `m.set_modules_to_backward_prefetch(ms)`: the same (the
  wrapper: `fs.set_modules_to_forward_prefetch(m, ms)`): m starts the gathers of ms, not the next unit's;
- `model.set_requires_gradient_sync(False)`: the same, on the whole model only: no-sync accumulation,
  full local gradients, one reduce-scatter later;
- `torch.nn.utils.clip_grad_norm_(model.parameters(), c)`: `model.clip_grad_norm_(c)`, the norm over
  every rank (torch's raises on zerokit's pieces: clip.py);
- `{n: p.full_tensor() for n, p in model.named_parameters()}`: `model.full_parameters()`, the full
  fp32 tensors, a collective.

Where it differs from FSDP2: a shard parameter is a flat 1-D piece of a parameter (the flat
buffer is cut anywhere; FSDP2 cuts each tensor along dim 0 and wraps the piece in a DTensor),
so only elementwise optimizers see the right thing; frozen parameters stay whole and
replicated (in compute_dtype); reduce_dtype is always fp32, and under no-sync the gradients
accumulate in the compute dtype (FSDP2: in reduce_dtype); state_dict() is refused: use
full_parameters(), or zerokit.checkpoint.save(path, fs, opt) with the wrapper.
"""

import torch
import torch.distributed as dist
from torch import nn

from ..elementwise import SegmentShard
from ..mixed_precision import MixedPrecision, as_dtype
from ..zero3 import members
from .sharding import ShardMaster, Sharding

__all__ = ["FullyShard", "fully_shard", "FullyShardedModule", "ShardMaster"]


def _settings(model, compute_dtype, units, who):
    """The checks both faces make, and the MixedPrecision their compute_dtype means."""
    if not dist.is_initialized():
        raise RuntimeError(f"zerokit.{who} needs an initialised torch.distributed process group: run your code on "
                           "several ranks with zerokit.launch (or torchrun)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"zerokit.{who} takes a model (an nn.Module), not {type(model).__name__}")
    inside = {id(m) for m in model.modules()}
    stray = [m for u in (units or ()) for m in (u if isinstance(u, (list, tuple)) else (u,)) if id(m) not in inside]
    if stray:
        raise ValueError(f"units must be modules inside the model: {type(stray[0]).__name__} "
                         f"({len(stray)} of them) is not one of model.modules()")
    dtype = None if compute_dtype is None else as_dtype(compute_dtype)
    if dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, not {dtype}")
    dtype = None if dtype == torch.float32 else dtype
    precision = None if dtype is None else MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32,
                                                          loss_scaling=False)
    return dtype, precision


def _unit_of(sharding, module):
    """The index of the unit `module` is (or is a module of; a group may be named by its list)."""
    wanted = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    for u, unit in enumerate(sharding.units):
        if all(any(m is w for m in members(unit)) for w in wanted):
            return u
    raise ValueError(f"{type(module).__name__} is not a unit of this model: pass the model or one of the units "
                     "given at construction")


class FullyShard(nn.Module):
    """Shard `model`'s parameters, gradients and (through its shard parameters) the state of
    any optimizer built on it across the ranks of `group`: ZeRO-3, FSDP2's shape, as a wrapper.

    compute_dtype: None (fp32), torch.bfloat16 or torch.float16: the dtype the gathered
        weights compute in; the shards, and so the optimizer, stay fp32, and gradients are
        reduce-scattered in fp32 (MixedPrecision(compute_dtype, reduce_dtype=float32,
        loss_scaling=False)).
    units: the modules gathered and freed together (e.g. each transformer block; a list of
        modules is one unit), as in ZeRO3Adam; default: every module that directly owns a
        trainable parameter. The root (the model itself) keeps what no unit owns.
    prefetch: start the next unit's all-gather while the current one computes.
    reshard_after_forward: True, False, None (True but for the root) or a node's size k (hpZ):
        what each unit keeps between forward and backward (reshard.py's table).
    output_dtype, cast_forward_inputs: FSDP2's MixedPrecisionPolicy fields, at every unit.

    parameters() / named_parameters(): this rank's fp32 shard parameters, named after the
    parameter each is a piece of (a parameter with no piece here is left out). `.module` is
    the wrapped model, whose own parameters are empty outside forward and backward. Every
    rank must run the same units in the same order. Move the model to its device first.
    Memory, for zerokit.memory.census(fs, fs): memory_categories().
    """

    def __init__(self, model, compute_dtype=None, units=None, group=None, prefetch=True, reshard_after_forward=None,
                 output_dtype=None, cast_forward_inputs=True):
        super().__init__()
        self.compute_dtype, precision = _settings(model, compute_dtype, units, "FullyShard")
        self.module = model
        self._sharding = Sharding(model, units, prefetch, group, precision, reshard_after_forward,
                                  cast_forward_inputs, output_dtype)
        shard_params = self._sharding.shard_params
        self._shard_params = {name: shard_params[p] for name, p in self._sharding.names
                              if p in shard_params and shard_params[p].numel()}

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)  # the root unit's hooks gather, cast and settle

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for name, param in self._shard_params.items():
            yield (f"{prefix}.{name}" if prefix else name), param

    # ---- FSDP2's controls (a unit named by its module; None: the root) -------------------------

    def unshard(self, module=None, async_op=False):
        return self._sharding.unshard(self._unit(module), async_op)

    def reshard(self, module=None):
        self._sharding.reshard(self._unit(module))

    def set_modules_to_forward_prefetch(self, module, modules):
        self._sharding.forward_prefetch[self._unit(module)] = [self._unit(m) for m in modules]

    def set_modules_to_backward_prefetch(self, module, modules):
        self._sharding.backward_prefetch[self._unit(module)] = [self._unit(m) for m in modules]

    def set_requires_gradient_sync(self, requires_gradient_sync):
        self._sharding.set_requires_gradient_sync(requires_gradient_sync)

    def set_reshard_after_forward(self, reshard_after_forward, module=None):
        self._sharding.set_reshard_after_forward(reshard_after_forward,
                                                 None if module is None else [self._unit(module)])

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        return self._sharding.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def full_parameters(self):
        """{name: the full fp32 tensor} of every parameter of the model, trainable or frozen,
        as copies: a collective (one all-gather per bucket), every rank calls it."""
        return self._sharding.full_parameters()

    def memory_categories(self):
        """The tensors the sharding holds, by category (parameters: the shards and any unit
        gathered now; gradients: reduced shards, transfers in flight, unreduced ones; masters)."""
        return self._sharding.memory_categories()

    def _unit(self, module):
        return 0 if module is None else _unit_of(self._sharding, module)

    # ---- lesson 07: what a checkpoint saves and restores -------------------------------

    def state_shards(self):
        """This rank's shards, one SegmentShard per bucket (unit), for zerokit.checkpoint: the fp32
        shard of the flat weights and the shard parameters that view it (their optimizer state is
        whatever optimizer the user built on them)."""
        sharding = self._sharding
        return [SegmentShard(bucket, None, sharding._param_shard(bi), [param for _, param in pieces], None)
                for bi, (bucket, pieces) in enumerate(zip(sharding.buckets, sharding.pieces))]

    def loaded(self):
        """The shards were overwritten in place (a checkpoint was loaded): drop any unit still
        gathered, so the next forward gathers the loaded weights."""
        self._sharding.loaded()

    def state_dict(self, *args, **kwargs):
        raise NotImplementedError("zerokit.FullyShard holds only this rank's shards, so a state_dict() of one rank "
                                  "would be a sliver of the model: use full_parameters() (a collective) for the "
                                  "full tensors by name, or zerokit.checkpoint.save(path, model, opt) on every "
                                  "rank for the model and the optimizer's state (any world size can load it)")

    def load_state_dict(self, state_dict, strict=True, assign=False):
        raise NotImplementedError("zerokit.FullyShard cannot load a state_dict: load the full weights into the "
                                  "model before wrapping it (rank 0's are broadcast at construction), or "
                                  "zerokit.checkpoint.load(path, model, opt) a checkpoint on every rank")


# ---- in place ---------------------------------------------------------------------------


class _InPlace(Sharding):
    """Sharding whose modules show the shard parameters at rest and the compute parameters
    while their unit is gathered: each (module, name) that holds a parameter is switched."""

    def __init__(self, module, *args, **kwargs):
        self.places = {}  # compute parameter -> every (module, name) holding it (a tied one: several)
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None and p.requires_grad:
                    self.places.setdefault(p, []).append((m, name))
        super().__init__(module, *args, **kwargs)
        for bi in range(len(self.buckets)):
            self._show(bi)

    def _show(self, bi):
        if not hasattr(self, "shard_params"):  # still inside Sharding.__init__
            return
        full = self._full[bi] is not None
        for p in self.buckets[bi].params:
            for m, name in self.places[p]:
                m._parameters[name] = p if full else self.shard_params[p]

    def _finish_gather(self, bi):
        super()._finish_gather(bi)
        self._show(bi)

    def _free(self, bi):
        super()._free(bi)
        self._show(bi)


class FullyShardedModule:
    """What zerokit.fully_shard adds to the model's class and to each unit's (FSDP2's FSDPModule):
    the per-unit controls, and on the root (the model) the whole model's."""

    # index in the MRO of the original class: [FullySharded<Orig>, FullyShardedModule, <Orig>, ...]
    _original_class_index = 2

    def __new__(cls, *args, **kwargs):
        """Construct the original class (a container indexed by a slice builds a new one of its own class)."""
        original = cls.__mro__[cls._original_class_index]
        self = original.__new__(original, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    # ---- per unit (FSDP2's FSDPModule methods) -------------------------------------------------

    def unshard(self, async_op=False):
        """Gather this unit's parameters now; async_op: a handle whose wait() installs them (the
        unit's forward waits for it anyway). Not recursive, as FSDP2's."""
        return self._zerokit_sharding.unshard(self._zerokit_unit, async_op)

    def reshard(self):
        """Free this unit's gathered parameters: its modules show the shard parameters again."""
        self._zerokit_sharding.reshard(self._zerokit_unit)

    def set_modules_to_forward_prefetch(self, modules):
        """This unit's forward starts the all-gathers of `modules` (units), instead of the next unit's."""
        self._zerokit_sharding.forward_prefetch[self._zerokit_unit] = [self._unit_index(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        """This unit's backward starts the all-gathers of `modules` (units), instead of the next unit's."""
        self._zerokit_sharding.backward_prefetch[self._zerokit_unit] = [self._unit_index(m) for m in modules]

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        """This unit's policy (and, with recurse, that of every unit inside it) from the next forward on."""
        sharding, mine = self._zerokit_sharding, self._zerokit_unit
        inside = {id(m) for unit_module in members(sharding.units[mine]) for m in unit_module.modules()}
        chosen = [u for u, unit in enumerate(sharding.units)
                  if u == mine or (recurse and all(id(m) in inside for m in members(unit)))]
        sharding.set_reshard_after_forward(reshard_after_forward, chosen)

    def set_requires_gradient_sync(self, requires_gradient_sync, recurse=True):
        """False: backward keeps full local gradients and reduces nothing; the first backward after
        setting True again reduce-scatters their sum once. zerokit sets it for the whole model."""
        self._whole_model("set_requires_gradient_sync")
        self._zerokit_sharding.set_requires_gradient_sync(requires_gradient_sync)

    # ---- the whole model (the root) -----------------------------------------------------------

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """Clip the gradients of every shard parameter by their norm over all ranks (a collective)."""
        self._whole_model("clip_grad_norm_")
        return self._zerokit_sharding.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def full_parameters(self):
        """{name: the full fp32 tensor} of every parameter, as copies: a collective."""
        self._whole_model("full_parameters")
        return self._zerokit_sharding.full_parameters()

    def memory_categories(self):
        self._whole_model("memory_categories")
        return self._zerokit_sharding.memory_categories()

    def state_dict(self, *args, **kwargs):
        raise NotImplementedError("zerokit.fully_shard made this model's parameters this rank's pieces of them, "
                                  "so its state_dict() would be a sliver of the model: use full_parameters() (a "
                                  "collective) for the full tensors by name, or wrap the model in zerokit.FullyShard "
                                  "to save it with zerokit.checkpoint")

    def load_state_dict(self, state_dict, strict=True, assign=False):
        raise NotImplementedError("a model zerokit.fully_shard sharded cannot load a state_dict: load the full "
                                  "weights into the model before sharding it (rank 0's are broadcast then)")

    def _whole_model(self, what):
        if self._zerokit_unit != 0:
            raise RuntimeError(f"{what} is for the whole model: call it on the model zerokit.fully_shard was given, "
                               "not on one of its units")

    def _unit_index(self, module):
        if not isinstance(module, FullyShardedModule) or module._zerokit_sharding is not self._zerokit_sharding:
            raise ValueError(f"{type(module).__name__} is not a unit of this model (zerokit.fully_shard(model, "
                             "units=...) makes the units)")
        return module._zerokit_unit


_CLASSES = {}  # original class -> its FullySharded subclass


def _make_fully_sharded(module, sharding, u):
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FullySharded{cls.__name__}", (FullyShardedModule, cls), {})
    module.__class__ = _CLASSES[cls]
    module._zerokit_sharding, module._zerokit_unit = sharding, u


def fully_shard(module, *, compute_dtype=None, units=None, group=None, prefetch=True, reshard_after_forward=None,
                output_dtype=None, cast_forward_inputs=True):
    """Shard `module` in place across the ranks of `group` (ZeRO-3, FSDP2's fully_shard) and return it.

    The arguments are FullyShard's. Afterwards `module.parameters()` are this rank's fp32 shard
    parameters (flat pieces, each with a .grad of its shape after backward): build the optimizer
    on them. The module and its units are FullyShardedModules (see the module's docstring)."""
    if isinstance(module, FullyShardedModule):
        raise ValueError("this module is already sharded by zerokit.fully_shard (it, or a module around it: "
                         "give every unit in one call, units=[...])")
    if any(isinstance(m, FullyShardedModule) for m in module.modules()):
        raise ValueError("a module inside this one was sharded by zerokit.fully_shard already: zerokit shards a "
                         "model in one call, fully_shard(model, units=[...]), not bottom-up as FSDP2")
    _, precision = _settings(module, compute_dtype, units, "fully_shard")
    sharding = _InPlace(module, units, prefetch, group, precision, reshard_after_forward, cast_forward_inputs,
                        output_dtype)
    for u, unit in enumerate(sharding.units):
        for m in members(unit):
            _make_fully_sharded(m, sharding, u)
    return module
