r"""ZeRO stage 3 ($P_{os+g+p}$): shard the parameters too.

After ZeRO-2 every rank still holds all the weights ($P\Psi$ bytes). ZeRO-3 keeps only
this rank's shard of each module's parameters between uses; a module's full weights
exist just while it computes:

- before a module's **forward**: all-gather its parameters; after it: free them;
- before its **backward**: all-gather them again; when all its gradients are in:
  reduce-scatter the gradients (ZeRO-2's hook) and free the parameters;
- step(): Adam on the shards; nothing to all-gather, the next forward will.

Communication: $\Psi$ (forward gathers) + $\Psi$ (backward gathers) + $\Psi$ (gradient
reduce-scatter) = $3\Psi$, 1.5x data parallel, for parameters that shrink to $P\Psi/N$.
To hide the extra latency the gather of the *next* module is started (asynchronously)
while the current one computes: prefetching, in forward order during forward and in
reverse order during backward.

Units. Each module that directly owns trainable parameters is a unit (pass `units=` to
group differently, e.g. one unit per transformer block). A parameter owned by two
modules (tied weights) belongs to the root unit, the model itself, which stays gathered
from the start of forward to the end of backward. A parameter must be used inside the
forward of the module that owns it, as with PyTorch's FSDP. Frozen parameters are left
alone (replicated); every rank must run the same modules in the same order.

At rest a parameter's `.data` is an empty tensor: use `with opt.gathered():` to look at
the full weights.

Mixed precision (`precision=`, lesson 06): the parameters are sharded like the optimizer
state, so the fp32 master shard can itself be the parameter storage at rest; it is cast to
16 bits just before each all-gather, and no separate 16-bit shard is kept (as in PyTorch's
FSDP2). `MixedPrecision(half_shard=True)` keeps one anyway, as the ZeRO paper counts it.
"""

from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from .comm import all_gather
from .flat import FlatBucket
from .zero2 import ZeRO2Adam, weak_hook

__all__ = ["ZeRO3Adam"]


def _default_units(module):
    """Every module that directly owns a trainable parameter, in registration order."""
    return [m for m in module.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


class ZeRO3Adam(ZeRO2Adam):
    """AdamW with optimizer state, gradients and parameters sharded across ranks (ZeRO-3).

    Takes the model, not its parameters: it hooks each unit's forward and backward.
    units: modules whose parameters (all of their subtree, minus what a nested unit owns)
        are gathered and freed together; default: every module that owns parameters
        directly. prefetch: start the next unit's gather early.
    """

    def __init__(self, module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 units=None, prefetch=True, group=None, precision=None):
        if not isinstance(module, nn.Module):
            raise TypeError("ZeRO3Adam takes the model (an nn.Module), not its parameters: "
                            "it hooks each module's forward to gather the weights")
        self.module = module
        self.prefetch = prefetch
        self.units = [module] + [m for m in (units if units is not None else _default_units(module))
                                 if m is not module]
        self._unit_of = self._assign_parameters()
        # bucket_mb is unused here: a bucket is a unit, sent when the unit's gradients are in
        super().__init__(module.parameters(), lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, group=group, precision=precision)
        self._buckets_of_unit = [[bi for bi, b in enumerate(self.buckets) if b.unit == u]
                                 for u in range(len(self.units))]
        self._full = [None] * len(self.buckets)  # gathered flat buffer, while a unit is in use
        self._gathering = {}  # bucket -> (work, buffer): an all-gather in flight
        self._order = []  # units in the order this forward ran them so far
        self._last_order = []  # ... and the whole order of the previous forward
        for u, m in enumerate(self.units):
            m.register_forward_pre_hook(partial(weak_hook(self._pre_forward), u))
            m.register_forward_hook(partial(weak_hook(self._post_forward), u))

    def _assign_parameters(self):
        """parameter -> unit index: the innermost unit whose subtree holds it.

        A parameter held by two units, neither inside the other (a tied weight), goes to
        the root (0), which contains every unit and stays gathered through backward.
        """
        inside = [{id(m) for m in unit.modules()} for unit in self.units]
        owners = {}
        for u, unit in enumerate(self.units):
            for p in unit.parameters():
                owners.setdefault(p, []).append(u)
        unit_of = {}
        for p, us in owners.items():
            # drop every unit that contains another candidate: what is left is innermost
            innermost = [u for u in us if not any(v != u and id(self.units[v]) in inside[u] for v in us)]
            unit_of[p] = innermost[0] if len(innermost) == 1 else 0
        return unit_of

    def _make_buckets(self, params):
        """One bucket per unit, the last unit first: backward finishes units in that order."""
        buckets = []
        for u in reversed(range(len(self.units))):
            mine = [p for p in params if self._unit_of[p] == u]
            if mine:
                bucket = FlatBucket(mine, self.world_size, self.rank)
                bucket.unit = u
                buckets.append(bucket)
        return buckets

    @torch.no_grad()
    def _install_flat_params(self, i):
        """Keep only this rank's shard; the module's parameters become empty tensors.

        Mixed precision: the fp32 master shard is the shard kept at rest (with
        half_shard=True, a 16-bit copy of it is kept as well and is what gets gathered).
        """
        bucket = self.buckets[i]
        shard = bucket.shard_of([p.data for p in bucket.params])
        for p in bucket.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.precision.cast_parameters_(bucket.params)  # the (empty) parameters compute in 16 bits
        master = self.shards[i].master = self.precision.master_copy(shard)  # fp32 runs: none
        if master is not None:
            shard = self.precision.to_half(master) if self.precision.config.half_shard else master
        return shard  # in ZeRO-3, flat_params[i] is this rank's shard only

    # ---- gather and free ---------------------------------------------------------------

    def _start_gather(self, bi):
        if self._full[bi] is not None or bi in self._gathering:
            return
        # an fp32 master at rest is sent in 16 bits (a 16-bit shard as it is)
        shard = self.precision.to_half(self.flat_params[bi])
        # The same buffer at every gather, its memory allocated here and released by _free
        # (storage resized to 0, PyTorch FSDP's trick). Autograd saves some weights for
        # backward as views of this buffer (a linear layer keeps its transposed weight): with
        # a fresh buffer per gather, those views would keep every unit's full weights alive
        # from forward to backward. Resized in place, the saved views hold no memory in
        # between and see the weights again once backward's gather refills the buffer.
        bucket = self.buckets[bi]
        full = getattr(bucket, "gather_buffer", None)
        if full is None or full.dtype != shard.dtype:
            full = bucket.gather_buffer = torch.empty(bucket.padded_numel, dtype=shard.dtype, device=shard.device)
        full.untyped_storage().resize_(full.numel() * full.element_size())
        work = all_gather(full, shard, group=self.group, async_op=True)
        self._gathering[bi] = (work, full, shard)  # the input must outlive the transfer

    @torch.no_grad()
    def _finish_gather(self, bi):
        self._start_gather(bi)
        if bi in self._gathering:
            work, full, _shard = self._gathering.pop(bi)
            work.wait()
            for p, view in zip(self.buckets[bi].params, self.buckets[bi].views(full)):
                p.data = view
            self._full[bi] = full

    @torch.no_grad()
    def _free(self, bi):
        full = self._full[bi]
        if bi in self._gathering:  # a prefetch nobody used
            work, full, _shard = self._gathering.pop(bi)
            work.wait()
        if self._full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._full[bi] = None
        if full is not None:
            full.untyped_storage().resize_(0)  # also under views autograd saved (see _start_gather)

    def _gather_unit(self, u, prefetch_next=None):
        for bi in self._buckets_of_unit[u]:
            self._start_gather(bi)
        if self.prefetch and prefetch_next is not None:
            for bi in self._buckets_of_unit[prefetch_next]:
                self._start_gather(bi)
        for bi in self._buckets_of_unit[u]:
            self._finish_gather(bi)

    @staticmethod
    def _neighbour(order, u, delta):
        """The unit that ran just after (delta=1) or before (delta=-1) u in `order`."""
        if u in order:
            k = order.index(u) + delta
            if 0 <= k < len(order):
                return order[k]
        return None

    # ---- hooks ------------------------------------------------------------------------

    def _pre_forward(self, u, module, args):
        if u == 0:  # a new forward: what ran last time predicts what runs next
            self._last_order, self._order = self._order or self._last_order, []
        if u not in self._order:
            self._order.append(u)
        self._gather_unit(u, prefetch_next=self._neighbour(self._last_order, u, +1))

    def _post_forward(self, u, module, args, output):
        backward_coming = torch.is_grad_enabled()
        if backward_coming:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(weak_hook(self._pre_backward), u), mode="any")
        if u != 0 or not backward_coming:  # the root stays gathered until backward ends
            for bi in self._buckets_of_unit[u]:
                self._free(bi)

    def _pre_backward(self, u, grad):
        # backward visits units in reverse forward order; the root's turn comes first
        following = self._order[-1] if u == 0 and self._order else self._neighbour(self._order, u, -1)
        self._gather_unit(u, prefetch_next=following)

    def _send(self, bi):
        super()._send(bi)  # reduce-scatter this unit's gradients ...
        self._free(bi)  # ... and its full weights are no longer needed

    def _end_of_backward(self):
        super()._end_of_backward()
        for bi in range(len(self.buckets)):
            self._free(bi)

    # ---- step: the updated shards stay where they are --------------------------------

    def _param_shard(self, i):
        master = self.shards[i].master
        return self.flat_params[i] if master is None else master

    def _publish(self, i):
        if self._param_shard(i) is not self.flat_params[i]:  # a separate 16-bit shard (half_shard)
            self.flat_params[i].copy_(self._param_shard(i))
        # Nothing to send: the next forward gathers the updated shards. A full copy still
        # gathered now holds the weights from before this step (a forward with grad enabled
        # and no backward after it leaves the root unit gathered): drop it, or the next
        # forward would skip its gather and compute with stale weights.
        self._free(i)

    @contextmanager
    def gathered(self):
        """Full parameters inside the block (to evaluate, save or compare); freed after."""
        for u in range(len(self.units)):
            for bi in self._buckets_of_unit[u]:
                self._finish_gather(bi)
        try:
            yield self.module
        finally:
            for bi in range(len(self.buckets)):
                self._free(bi)

    def memory_categories(self):
        cats = super().memory_categories()
        # an fp32 master that is also the parameter storage at rest counts as optimizer state
        masters = [s.master for s in self.shards]
        at_rest = [t for t in self.flat_params if not any(t is m for m in masters)]
        cats["parameters"] = at_rest + [f for f in self._full if f is not None]
        return cats
