r"""The machinery under zerokit.FullyShard and zerokit.fully_shard: ZeRO-3 with the optimizer left out.

Lesson 05's ZeRO3Adam is two jobs in one object: it shards the model (gathers each unit's
weights before use and frees them after) and it is the optimizer (Adam on the shards).
FSDP2 gives the first job to the model and lets the user bring the second: the model shows
the optimizer this rank's *shards* as its parameters, and the optimizer, which knows
nothing of ranks, steps them. That an unchanged optimizer may step a piece of a tensor is
lesson 03's reason again (zerokit.elementwise): an elementwise update of some elements is
the update of the whole tensor at those elements.

`Sharding` is ZeRO3Adam (with reshard_after_forward: reshard.py) whose per-bucket state holds
no optimizer state (only the fp32 master when the model computes in 16 bits) and whose step()
is never called. What it adds:

- the shard parameters: for each trainable parameter, a Parameter that is a *view* of its piece
  of this rank's fp32 shard storage (of the fp32 master, when computing in 16 bits; an empty
  one where this rank's shard holds none of it). The optimizer's in-place update writes the
  shard, and the next forward's all-gather carries it to every rank;
- the gradients: when backward ends and every reduce-scatter has landed, each piece of the
  mean gradient shard goes into its shard parameter's .grad (fp32, shaped like it, a
  ShardGrad: clip.py), added to a .grad already there, as autograd accumulates. A
  parameter no rank got a gradient for keeps .grad None, so the optimizer skips it as torch's
  optimizers do on one process. Knowing that costs one tiny all-reduce of presence flags per
  synchronised backward;
- FSDP2's controls, per unit (an index into `units`, 0 the root): `unshard(u)` / `reshard(u)`,
  explicit prefetch lists (`forward_prefetch[u]`, `backward_prefetch[u]`: which units' gathers
  u's forward, or backward, starts; they replace the implicit prefetch of the next unit),
  `requires_gradient_sync` (False: backward keeps the full local gradients and sends nothing,
  the next synchronised backward reduce-scatters their sum once; ZeRO2Adam's no_sync()), and
  the casts of FSDP2's MixedPrecisionPolicy at every unit: floating-point inputs to the compute
  dtype (`cast_forward_inputs`), floating-point outputs to `output_dtype`.
"""

from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..activations import in_backward
from ..collectives import all_gather  # torch's, but direct on gloo
from ..zero2 import weak_hook
from ..zero3 import members
from .clip import ShardGrad, clip_sharded_grad_norm_
from .reshard import ReshardZeRO3Adam

__all__ = ["Sharding", "ShardMaster"]


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


class _Unsharding:
    """What unshard(u, async_op=True) returns: wait() installs the unit's gathered parameters."""

    def __init__(self, sharding, u):
        self._sharding, self._u = sharding, u

    def wait(self):
        for bi in self._sharding._buckets_of_unit[self._u]:
            self._sharding._finish_gather(bi)


class Sharding(ReshardZeRO3Adam):
    """ZeRO3Adam without its Adam, with FSDP2's controls (see the module's docstring)."""

    def __init__(self, module, units=None, prefetch=True, group=None, precision=None, reshard_after_forward=None,
                 cast_forward_inputs=True, output_dtype=None):
        self.names = list(module.named_parameters())  # before ZeRO-3 empties them: name -> the compute parameter
        super().__init__(module, units=units, prefetch=prefetch, group=group, precision=precision,
                         reshard_after_forward=reshard_after_forward)
        # compute parameter -> its shard parameter; bucket -> [(segment, shard parameter)]
        self.shard_params = {}
        self.pieces = []
        for bi, bucket in enumerate(self.buckets):
            shard = self._param_shard(bi)  # the fp32 shard, or its fp32 master
            where = {s.index: s for s in bucket.segments}
            mine = []
            for j, p in enumerate(bucket.params):
                s = where.get(j)
                piece = shard[s.shard_lo:s.shard_hi] if s is not None else shard.new_empty(0)
                self.shard_params[p] = nn.Parameter(piece)
                if s is not None:
                    mine.append((s, self.shard_params[p]))
            self.pieces.append(mine)
        self.requires_gradient_sync = True
        self._unsharded = set()  # buckets unshard() gathered since the last forward began
        self.forward_prefetch, self.backward_prefetch = {}, {}  # unit -> [units], where set explicitly
        self.cast_forward_inputs, self.output_dtype = cast_forward_inputs, output_dtype
        module.register_forward_pre_hook(weak_hook(self._settle), prepend=True)  # before the root's gather
        for unit in self.units:
            for m in members(unit):
                m.register_forward_pre_hook(weak_hook(self._cast_inputs), with_kwargs=True)
                m.register_forward_hook(weak_hook(self._cast_output))

    def _new_state(self, bucket):
        return ShardMaster()

    def step(self, closure=None):
        raise RuntimeError("zerokit's FullyShard does not step: build any torch optimizer on the model's parameters()")

    # ---- the gradients --------------------------------------------------------------------

    def set_requires_gradient_sync(self, flag):
        """False: the next backwards reduce nothing and keep their full gradients, summed, on the
        compute parameters (G Psi bytes); the first backward with True reduce-scatters the sum."""
        self.requires_gradient_sync = self._sync = bool(flag)  # ZeRO2Adam's no_sync() flag

    def _end_of_backward(self):
        super()._end_of_backward()  # every reduce-scatter sent and landed, every unit freed
        if self._sync:  # under no-sync nothing was reduced: no presence all-reduce either
            self._deliver_gradients()

    @torch.no_grad()
    def _deliver_gradients(self):
        present = self._presence(self._has_grad)  # the same answer on every rank
        for bi, bucket in enumerate(self.buckets):
            grad = self.grad_shards[bi]
            where = {s.index: s for s in bucket.segments}
            for j, p in enumerate(bucket.params):
                if not present[bi][j]:
                    continue  # no rank had one: .grad stays as it was (None after zero_grad)
                param, s = self.shard_params[p], where.get(j)
                g = grad[s.shard_lo:s.shard_hi] if s is not None else grad.new_empty(0)
                if param.grad is None:
                    param.grad = g.as_subclass(ShardGrad)  # a view: 1/N of one fp32 buffer per bucket
                else:
                    param.grad.add_(g)
        # the next backward starts from nothing: what it reduces is added to .grad above
        self.grad_shards = [None] * len(self.buckets)
        self._has_grad = [[False] * len(b.params) for b in self.buckets]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """torch.nn.utils.clip_grad_norm_ over the whole model: the norm of every rank's pieces
        (clip.py). A collective; call it after backward, before the optimizer's step."""
        if not self._sync or any(p.grad is not None for b in self.buckets for p in b.params):
            raise RuntimeError("clip_grad_norm_: gradients are waiting, unreduced, on the compute parameters "
                               "(requires_gradient_sync is off): clip after the backward that reduces them")
        device = self.buckets[0].params[0].device if self.buckets else None
        return clip_sharded_grad_norm_(list(self.shard_params.values()), max_norm, self.group, norm_type,
                                       error_if_nonfinite, device)

    def memory_categories(self):
        cats = super().memory_categories()
        # under no-sync: the full gradients, waiting on the compute parameters for the next reduction
        cats["gradients"] = cats["gradients"] + [p.grad for b in self.buckets for p in b.params
                                                 if p.grad is not None]
        return cats

    # ---- the units: unshard, reshard, prefetch ----------------------------------------------

    def unshard(self, u, async_op=False):
        """Gather unit u now (its next forward then finds it full). async_op: return a handle
        whose wait() installs it (the unit's forward waits for it anyway)."""
        for bi in self._buckets_of_unit[u]:
            self._start_gather(bi)
            self._unsharded.add(bi)
        handle = _Unsharding(self, u)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self, u):
        """Unit u back to this rank's shard: its gathered parameters freed."""
        for bi in self._buckets_of_unit[u]:
            self._free(bi)

    def _prefetch(self, units):
        for v in units:
            for bi in self._buckets_of_unit[v]:
                self._start_gather(bi)  # each new one first finishes the one in flight (zerokit.zero3)

    def _pre_forward(self, u, module, args):
        if in_backward() or u not in self.forward_prefetch:
            return super()._pre_forward(u, module, args)
        self._gather_unit(u)  # set explicitly: these units instead of the next one in the last forward's order
        self._prefetch(self.forward_prefetch[u])

    def _pre_backward(self, u, grad):
        if u not in self.backward_prefetch:
            return super()._pre_backward(u, grad)
        self._gather_unit(u)
        self._prefetch(self.backward_prefetch[u])

    # ---- around every forward ------------------------------------------------------------

    def _settle(self, module, args):
        """Before the root's forward (not a recomputation inside backward): start clean after a
        backward that raised, and drop any unit still gathered. A forward with grad enabled and no
        backward after it leaves units gathered, and the optimizer may have stepped the shards
        since: this forward would skip the gather and compute with stale weights (ZeRO3Adam drops
        them in its own step(), which is not ours to see here)."""
        if in_backward():
            return
        if self._callback_queued:  # a backward began and never reached its end
            self.zero_grad()  # ZeRO-2's recovery: wait for its transfers, forget its gradients
        for bi in range(len(self.buckets)):
            if bi not in self._unsharded:  # gathered by unshard() for this forward: kept
                self._free(bi)
        self._unsharded = set()

    def _cast_inputs(self, module, args, kwargs):
        dtype = self.precision.param_dtype
        if not self.cast_forward_inputs or dtype is None:
            return None
        cast = partial(_cast_floating, dtype)
        return tree_map_only(torch.Tensor, cast, args), tree_map_only(torch.Tensor, cast, kwargs)

    def _cast_output(self, module, args, output):
        if self.output_dtype is None:
            return None
        return tree_map_only(torch.Tensor, partial(_cast_floating, self.output_dtype), output)

    # ---- the full tensors ----------------------------------------------------------------

    @torch.no_grad()
    def full_parameters(self):
        """{name: the full fp32 tensor} of every parameter of the model, trainable or frozen,
        as copies: a collective (one all-gather per bucket), every rank calls it."""
        full = {}
        for bi, bucket in enumerate(self.buckets):
            shard = self._param_shard(bi)  # fp32: not the 16-bit copy a forward gathers
            flat = torch.empty(bucket.padded_numel, dtype=torch.float32, device=shard.device)
            all_gather(flat, shard, group=self.group)
            full.update((p, v.clone()) for p, v in zip(bucket.params, bucket.views(flat)))
        return {name: full[p] if p in full else p.detach().float().clone() for name, p in self.names}


def _cast_floating(dtype, t):
    return t.to(dtype) if t.is_floating_point() else t
