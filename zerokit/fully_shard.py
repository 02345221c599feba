r"""ZeRO-3 as a module wrapper, in the shape of PyTorch FSDP2's `fully_shard`: any optimizer.

    model = zerokit.FullyShard(model, compute_dtype=torch.bfloat16)  # ~ fully_shard(model, mp_policy=...)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)             # any elementwise torch optimizer
    loss_fn(model(x_local).float(), y_local).backward(); opt.step(); opt.zero_grad()

Lesson 05's ZeRO3Adam is two jobs in one object: it shards the model (gathers each unit's
weights before use and frees them after) and it is the optimizer (Adam on the shards).
FSDP2 gives the first job to the model and lets the user bring the second: the model shows
the optimizer this rank's *shards* as its parameters, and the optimizer, which knows
nothing of ranks, steps them. That an unchanged optimizer may step a piece of a tensor is
lesson 03's reason again (zerokit.elementwise): an elementwise update of some elements is
the update of the whole tensor at those elements.

How it is built: ZeRO3Adam's machinery as it is (units, one flat bucket per unit, the hooks
that gather, free and prefetch, each unit's gradients reduce-scattered as backward finishes
it), with a per-bucket state that holds no optimizer state (only the fp32 master when the
model computes in 16 bits), and a step() that is never called. What it adds:

- the shard parameters: for each parameter with a piece in this rank's flat shard, a
  Parameter that is a *view* of that piece of the fp32 shard storage (of the fp32 master,
  when computing in 16 bits). The optimizer's in-place update writes the shard, and the
  next forward's all-gather carries it to every rank;
- the gradients: when backward ends and every reduce-scatter has landed, each piece of the
  mean gradient shard goes into its shard parameter's .grad (fp32, shaped like it), added
  to a .grad already there, as autograd accumulates. A parameter no rank got a gradient
  for keeps .grad None, so the optimizer skips it as torch's optimizers do on one process
  (a zero gradient would not do: AdamW would still decay the weight and move m and v).
  Knowing that costs one tiny all-reduce of presence flags per backward.

Mixed precision (`compute_dtype`, FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=
float32)): the shards stay fp32 and are cast to 16 bits just before each all-gather, so the
gathered weights and the whole forward and backward are 16-bit, and the gradients are
reduce-scattered in fp32. Floating-point inputs of forward are cast to compute_dtype as
well (FSDP2's cast_forward_inputs); the output is left in it. No loss scaling: with fp16,
bring a scaler (FSDP2 leaves that to the user too).

Where it differs from FSDP2: a shard parameter is a flat 1-D piece of a parameter (the
flat buffer is cut anywhere; FSDP2 cuts each tensor along dim 0 and wraps the piece in a
DTensor), so only elementwise optimizers see the right thing; frozen parameters stay whole
and replicated (in compute_dtype) and are not among parameters(); and state_dict() is not
implemented: use full_parameters(), or zerokit.checkpoint.save(path, fs, opt) for the whole job.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from .activations import in_backward
from .collectives import all_gather  # torch's, but direct on gloo
from .elementwise import SegmentShard
from .mixed_precision import MixedPrecision, as_dtype
from .zero3 import ZeRO3Adam

__all__ = ["FullyShard", "ShardMaster"]


class ShardMaster:
    """One bucket's state when the optimizer lives elsewhere: nothing but the fp32 master of
    this rank's shard under mixed precision (None in fp32), which is also the shard's storage.
    The interface ZeRO-3 asks of zerokit.zero1.ShardedAdamState, less the Adam."""

    def __init__(self):
        self.master = None

    def keep_master(self, master, weights):
        self.master = master

    def copy_master(self, shard):
        shard.copy_(self.master)

    def tensors(self):
        return [self.master]


class _Sharding(ZeRO3Adam):
    """ZeRO3Adam without its Adam: it gathers, frees and reduce-scatters, and hands each
    backward's gradient shards to the shard parameters instead of stepping them itself."""

    def __init__(self, module, units, prefetch, group, precision):
        super().__init__(module, units=units, prefetch=prefetch, group=group, precision=precision)
        # bucket -> [(segment, shard parameter)]: _param_shard is the fp32 shard or its fp32 master
        self.pieces = [[(s, nn.Parameter(self._param_shard(bi)[s.shard_lo:s.shard_hi])) for s in bucket.segments]
                       for bi, bucket in enumerate(self.buckets)]

    def _new_state(self, bucket):
        return ShardMaster()

    def step(self, closure=None):
        raise RuntimeError("FullyShard does not step: build any torch optimizer on FullyShard.parameters()")

    def _end_of_backward(self):
        super()._end_of_backward()  # every reduce-scatter sent and landed, every unit freed
        self._deliver_gradients()

    @torch.no_grad()
    def _deliver_gradients(self):
        present = self._presence(self._has_grad)  # the same answer on every rank
        for bi, pieces in enumerate(self.pieces):
            grad = self.grad_shards[bi]
            for s, param in pieces:
                if not present[bi][s.index]:
                    continue  # no rank had one: .grad stays as it was (None after zero_grad)
                g = grad[s.shard_lo:s.shard_hi]
                if param.grad is None:
                    param.grad = g  # a view: the shards of a bucket share one fp32 buffer, 1/N of it
                else:
                    param.grad.add_(g)
        # the next backward starts from nothing: what it reduces is added to .grad above
        self.grad_shards = [None] * len(self.buckets)
        self._has_grad = [[False] * len(b.params) for b in self.buckets]

    def settle(self):
        """Before a forward (not a recomputation inside backward): start clean after a backward
        that raised, and drop any unit still gathered. A forward with grad enabled and no
        backward after it leaves the root gathered, and the optimizer may have stepped the
        shards since: this forward would skip the gather and compute with stale weights
        (ZeRO3Adam drops it in step(), which is not ours to see here)."""
        if self._callback_queued:  # a backward began and never reached its end
            self.zero_grad()  # ZeRO-2's recovery: wait for its transfers, forget its gradients
        for bi in range(len(self.buckets)):
            self._free(bi)


class FullyShard(nn.Module):
    """Shard `model`'s parameters, gradients and (through its shard parameters) the state of
    any optimizer built on it across the ranks of `group`: ZeRO-3, FSDP2's shape.

    compute_dtype: None (fp32), torch.bfloat16 or torch.float16: the dtype the gathered
        weights compute in; the shards, and so the optimizer, stay fp32, and gradients are
        reduce-scattered in fp32 (MixedPrecision(compute_dtype, reduce_dtype=float32,
        loss_scaling=False)).
    units: the modules gathered and freed together (e.g. each transformer block), as in
        ZeRO3Adam; default: every module that directly owns a trainable parameter. The root
        (the model itself) keeps what no unit owns, gathered from the start of forward to
        the end of backward, as FSDP2's fully_shard on the root does.
    prefetch: start the next unit's all-gather while the current one computes.

    parameters() / named_parameters(): this rank's fp32 shard parameters, named after the
    parameter each is a piece of (a parameter with no piece here is left out). `.module` is
    the wrapped model, whose own parameters are empty outside forward and backward. Every
    rank must run the same units in the same order. Move the model to its device first.
    Memory, for zerokit.memory.census(fs, fs): memory_categories().
    """

    def __init__(self, model, compute_dtype=None, units=None, group=None, prefetch=True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("zerokit.FullyShard needs an initialised torch.distributed process group: run "
                               "your code on several ranks with zerokit.launch (or torchrun)")
        if not isinstance(model, nn.Module):
            raise TypeError(f"zerokit.FullyShard wraps a model (an nn.Module), not {type(model).__name__}")
        inside = {id(m) for m in model.modules()}
        stray = [u for u in (units or ()) if id(u) not in inside]
        if stray:
            raise ValueError(f"units must be modules inside the model: {type(stray[0]).__name__} "
                             f"({len(stray)} of {len(units)}) is not one of model.modules()")
        dtype = None if compute_dtype is None else as_dtype(compute_dtype)
        if dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype must be None, torch.bfloat16 or torch.float16, not {dtype}")
        self.compute_dtype = None if dtype == torch.float32 else dtype
        precision = None if self.compute_dtype is None else MixedPrecision(
            param_dtype=self.compute_dtype, reduce_dtype=torch.float32, loss_scaling=False)
        self.module = model
        self._sharding = _Sharding(model, units, prefetch, group, precision)
        pieces = {bucket.params[s.index]: param
                  for bucket, ps in zip(self._sharding.buckets, self._sharding.pieces) for s, param in ps}
        self._shard_params = {name: pieces[p] for name, p in model.named_parameters() if p in pieces}

    def forward(self, *args, **kwargs):
        if not in_backward():
            self._sharding.settle()
        if self.compute_dtype is not None:
            args, kwargs = tree_map_only(torch.Tensor, self._cast, (args, kwargs))
        return self.module(*args, **kwargs)

    def _cast(self, t):
        return t.to(self.compute_dtype) if t.is_floating_point() else t

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for name, param in self._shard_params.items():
            yield (f"{prefix}.{name}" if prefix else name), param

    @torch.no_grad()
    def full_parameters(self):
        """{name: the full fp32 tensor} of every parameter of the model, trainable or frozen,
        as copies: a collective (one all-gather per bucket), every rank calls it."""
        sharding, full = self._sharding, {}
        for bi, bucket in enumerate(sharding.buckets):
            shard = sharding._param_shard(bi)  # fp32: not the 16-bit copy a forward gathers
            flat = torch.empty(bucket.padded_numel, dtype=torch.float32, device=shard.device)
            all_gather(flat, shard, group=sharding.group)
            full.update((p, v.clone()) for p, v in zip(bucket.params, bucket.views(flat)))
        return {name: full[p] if p in full else p.detach().float().clone()
                for name, p in self.module.named_parameters()}

    def memory_categories(self):
        """The tensors the sharding holds, by category (parameters: the shards and any unit
        gathered now; gradients: reduced shards and transfers in flight; masters)."""
        return self._sharding.memory_categories()

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
