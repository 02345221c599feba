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
group differently, e.g. one unit per transformer block; a list of modules in `units` is one
unit of them all, FSDP2's `fully_shard([a, b])`: ZeRO3Adam gathers it before each of its
modules' forwards and frees it after each, zerokit.FullyShard keeps it until the last). A
parameter owned by two
modules (tied weights) belongs to the root unit, the model itself, which stays gathered
from the start of forward to the end of backward. A parameter must be used inside the
forward of the module that owns it, as with PyTorch's FSDP. Frozen parameters are left
alone (replicated); every rank must run the same modules in the same order.

At rest a parameter's `.data` is an empty tensor: use `with opt.gathered():` to look at
the full weights.

One class in two parts, with the shape of lesson 05's two exercises. The storage (exercise 1,
the notebook's `ShardedParameters` on zerokit.ZeRO2Adam): units, one bucket per unit, the shards,
and moving a bucket between its shard and its full parameters (`start_gather`, `finish_gather`,
`free`). Then when (exercise 2, `MyZeRO3Adam`): the forward and backward hooks, prefetching.
What the exercises write is public (those three, the fields `full` and `gathering` they keep,
the hooks `pre_forward`, `post_forward`, `pre_backward`, `send` and the helpers they call):
code outside the class calls it, the module hooks and the lessons' checks (05, 08, 11). Lines
marked "beyond the exercise" are what the lesson's scaffold leaves out.

Lesson 08: a forward that backward recomputes (activation checkpointing) runs these hooks
again inside backward; `_pre_recompute` and `_post_recompute` (the last part of the file) are
what they do then, and under `no_sync()` a unit is freed once its gradients are in.

Mixed precision (`precision=`, lesson 06): the parameters are sharded like the optimizer
state, so the fp32 master shard can itself be the parameter storage at rest; it is cast to
16 bits just before each all-gather, and no separate 16-bit shard is kept (as in PyTorch's
FSDP2). `MixedPrecision(half_shard=True)` keeps one anyway, as the ZeRO paper counts it.
"""

from contextlib import contextmanager
from enum import Enum
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from .collectives import all_gather  # torch's, but direct on gloo
from .flat import FlatBucket
from .hooks import in_backward, weak_hook
from .zero2 import ZeRO2Adam

__all__ = ["ZeRO3Adam", "UnitState", "default_units", "unit_list", "assign_units",
           "bucket_plan", "install_unit_hooks", "members"]


class UnitState(Enum):
    """Where a bucket's (a unit's) parameters are, as FSDP2's ShardedState names it."""

    SHARDED = "sharded"  # only this rank's shard; the parameters are empty tensors
    GATHERING = "gathering"  # an all-gather in flight: its buffer is being written, not yet to be read
    GATHERED = "gathered"  # the full parameters installed, views of the gathered buffer


def default_units(model):
    """Every module that directly owns a trainable parameter, in registration order."""
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def members(unit):
    """The modules of a unit: the unit itself, or each module of a group (a tuple of modules)."""
    return unit if isinstance(unit, tuple) else (unit,)


def unit_list(module, units=None):
    """The units ZeRO-3 gathers and frees: the model itself first (the root unit, which gets
    every parameter no smaller unit owns alone), then `units` (default: default_units); a list
    of modules among them is one unit, kept as a tuple."""
    units = units if units is not None else default_units(module)
    units = [tuple(u) if isinstance(u, (list, tuple)) else u for u in units]
    return [module] + [m for m in units if m is not module]


def assign_units(units):
    """{parameter: unit index}: the innermost unit holding it; a parameter two units hold,
    neither inside the other (tied weights), goes to the root, unit 0.

    units[0] is the root: the model, which contains every other unit and stays gathered
    through backward.
    """
    inside = [{id(m) for member in members(unit) for m in member.modules()} for unit in units]
    owners = {}
    for u, unit in enumerate(units):
        for p in dict.fromkeys(p for member in members(unit) for p in member.parameters()):
            owners.setdefault(p, []).append(u)
    unit_of = {}
    for p, us in owners.items():
        # drop every unit that contains another candidate: what is left is innermost
        innermost = [u for u in us if not any(v != u and all(id(m) in inside[u] for m in members(units[v]))
                                              for v in us)]
        unit_of[p] = innermost[0] if len(innermost) == 1 else 0
    return unit_of


def bucket_plan(units, params):
    """[(unit index, its parameters)]: one bucket per unit that owns any of `params`, the last
    unit first, because backward finishes the units in that order."""
    unit_of = assign_units(units)
    plan = []
    for u in reversed(range(len(units))):
        mine = [p for p in params if unit_of[p] == u]
        if mine:
            plan.append((u, mine))
    return plan


def install_unit_hooks(opt):
    """ZeRO-3's forward hooks on every unit of `opt` (lesson 05, exercise 2): `record_order` notes
    the order the units run in (the prefetch's guide), `pre_forward` gathers the unit,
    `post_forward` frees it and hooks its backward."""
    opt._order, opt._last_order = [], []  # units in the order this (the last) forward ran them
    for u, unit in enumerate(opt.units):
        for m in members(unit):  # a group: every module of it (beyond the exercise)
            m.register_forward_pre_hook(partial(weak_hook(opt.record_order), u))  # runs first
            m.register_forward_pre_hook(partial(weak_hook(opt.pre_forward), u))
            m.register_forward_hook(partial(weak_hook(opt.post_forward), u))


class ZeRO3Adam(ZeRO2Adam):
    """AdamW with optimizer state, gradients and parameters sharded across ranks (ZeRO-3):
    ZeRO-2 whose parameters keep only this rank's shard between uses, one bucket per unit, the
    unit's parameters empty until gathered (lesson 05, exercise 1), gathered and freed by hooks
    on each unit's forward and, through its outputs, its backward (exercise 2).

    Takes the model, not its parameters.
    units: modules whose parameters (all of their subtree, minus what a nested unit owns)
        are gathered and freed together; default: every module that owns parameters
        directly. prefetch: start the next unit's gather early.
    """

    def __init__(self, module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 units=None, prefetch=True, group=None, precision=None, offload=None, foreach=None):
        if not isinstance(module, nn.Module):  # beyond the exercise: a clear message
            raise TypeError(f"{type(self).__name__} takes the model (an nn.Module), not its parameters: "
                            "it hooks each module's forward to gather the weights")
        self.module, self.prefetch = module, prefetch
        self.units = unit_list(module, units)  # unit 0, the root, is the model itself
        self._unit_of = assign_units(self.units)  # parameter -> the index of its unit
        # bucket_mb is unused here: a bucket is a unit, sent when the unit's gradients are in
        super().__init__(module.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, group=group,
                         precision=precision, offload=offload, foreach=foreach)
        self.bucket_units = [self._unit_of[b.params[0]] for b in self.buckets]  # bucket -> the index of its unit
        self.buckets_of_unit = [[bi for bi, v in enumerate(self.bucket_units) if v == u]
                                for u in range(len(self.units))]
        self.full = [None] * len(self.buckets)  # bucket -> the gathered flat buffer, while in use
        self.gathering = {}  # bucket -> (work, full buffer, shard): an all-gather in flight
        self._gather_buffers = [None] * len(self.buckets)  # bucket -> its full-size buffer (see gather_buffer)
        install_unit_hooks(self)  # exercise 2: the hooks that decide when

    def _make_buckets(self, params):
        """One bucket per unit, the last unit first: backward finishes the units in that order."""
        return [FlatBucket(mine, self.world_size, self.rank, align_bytes=None)  # aligned: see ZeRO1Adam's
                for _, mine in bucket_plan(self.units, params)]

    def bucket_state(self, bi):
        """Bucket bi's UnitState, read from the exercise's own fields (self.full and self.gathering)."""
        if self.full[bi] is not None:
            return UnitState.GATHERED
        return UnitState.GATHERING if bi in self.gathering else UnitState.SHARDED

    @torch.no_grad()
    def _install_flat_params(self, i):
        """Keep this rank's shard of bucket i; its parameters become empty tensors."""
        bucket = self.buckets[i]
        shard = bucket.shard_of([p.data for p in bucket.params])
        for p in bucket.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # beyond the exercise (lesson 06): the parameters compute in 16 bits, and the fp32
        # master shard is the storage at rest, cast just before each all-gather; with
        # half_shard=True a 16-bit copy of it is kept as well, and that is what is gathered
        self.precision.cast_parameters_(bucket.params)
        self.shards[i].keep_master(self.precision.master_copy(shard), shard)
        master = self.shards[i].master
        if master is not None and not self.offload.offloaded:
            shard = self.precision.to_half(master) if self.precision.config.half_shard else master
        elif master is not None:  # beyond the exercise (lesson 08): the master is off the device,
            shard = self.precision.to_half(shard)  # the weights stay on it (in 16 bits, if mixed)
        return shard  # flat_params[i]: this rank's shard only

    def _param_shard(self, i):  # step() updates the shard in place ...
        master = self.shards[i].master  # beyond the exercise (lesson 06): the fp32 master, if any
        return self.flat_params[i] if master is None else master

    def _publish(self, i):  # ... and publishes nothing: the next forward gathers it
        # beyond the exercise (lesson 06, half_shard=True): round the master into the 16-bit shard
        if self._param_shard(i) is not self.flat_params[i]:
            self.shards[i].copy_master(self.flat_params[i])
        # beyond the exercise: a full copy still gathered now holds the weights from before this
        # step (a forward with grad enabled and no backward after it leaves the root unit
        # gathered): drop it, or the next forward would skip its gather and use stale weights
        self.free(i)

    @contextmanager
    def gathered(self):
        """The full parameters inside the block (to evaluate, compare or save); freed after."""
        for bi in range(len(self.buckets)):
            self.finish_gather(bi)
        try:
            yield self.module
        finally:
            for bi in range(len(self.buckets)):
                self.free(bi)

    def memory_categories(self):
        cats = super().memory_categories()
        # beyond the exercise (lesson 06): an fp32 master that is also the parameter storage at
        # rest counts as optimizer state (the paper's K = 12), as ZeRO-1 counts its masters
        masters = [s.master for s in self.shards]
        at_rest = [t for t in self.flat_params if not any(t is m for m in masters)]
        # an all-gather in flight (a prefetch): its full buffer and its input shard are parameters
        cats["parameters"] = at_rest + [f for f in self.full if f is not None] + [
            t for sent in self.gathering.values() for t in sent if isinstance(t, torch.Tensor)]
        return cats

    def gather_buffer(self, bi, shard):
        """Bucket bi's full-size flat buffer: the same tensor at every gather (autograd's saved
        views of the weights point into it), its memory allocated again if free() released it.

        A fresh buffer per gather would not do: autograd saves some weights for backward as
        views of it (a linear layer keeps its transposed weight), and those views would keep
        every unit's full weights alive from forward to backward. Released in place by free()
        (storage resized to 0, PyTorch FSDP's trick), the saved views hold no memory in between
        and see the weights again once backward's gather refills the buffer.
        """
        if self._gather_buffers[bi] is None:
            numel = self.buckets[bi].padded_numel
            self._gather_buffers[bi] = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        full = self._gather_buffers[bi]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        return full

    # Beyond the exercise: one full-size transfer at a time. A transfer in flight holds
    # full-size memory besides its output (a gathered unit; a reduce-scatter's receive buffer
    # until it completes, zerokit.collectives), and backward's peak is where these meet the
    # activations. So a new gather (the prefetch) first finishes the gather in flight, whose unit
    # is needed next anyway, and receives every reduce-scatter; send() likewise finishes gathers
    # and frees its unit before it sends. The prefetch still overlaps the unit's compute. Every
    # gather of lesson 11 (hpZ's from the secondary shards) waits the same way, here.

    def finish_transfers(self):
        """Beyond the exercise: finish every all-gather in flight and receive every reduce-scatter."""
        for other in list(self.gathering):
            self.finish_gather(other)
        while self._in_flight:
            self._receive()

    # Beyond the exercise (lesson 11): the collective of the gathers from the shards, swappable as
    # FSDP2's set_custom_all_gather; qwZ (zerokit.zeropp) puts an int8 all-gather here.
    gather_collective = staticmethod(all_gather)

    # ---- exercise 1 of lesson 05: gather and free ------------------------------------

    def start_gather(self, bi):
        """Start bucket bi's all-gather (asynchronous) unless it is full or on its way."""
        if self.full[bi] is not None or bi in self.gathering:  # not UnitState.SHARDED
            return
        self.finish_transfers()  # beyond the exercise: one transfer at a time (see above)
        # beyond the exercise (lesson 06): an fp32 master at rest is sent in 16 bits;
        # the exercise: `shard = self.flat_params[bi]`
        shard = self.precision.to_half(self.flat_params[bi])
        full = self.gather_buffer(bi, shard)
        # beyond the exercise (lesson 11's qwZ swaps the collective, see above);
        # the exercise: `work = all_gather(full, shard, group=self.group, async_op=True)`
        work = self.gather_collective(full, shard, group=self.group, async_op=True)
        self.gathering[bi] = (work, full, shard)  # the input must outlive the transfer

    @torch.no_grad()
    def finish_gather(self, bi):
        """Bucket bi's parameters full: start the gather if needed, wait, install the views."""
        self.start_gather(bi)
        if bi in self.gathering:
            work, full, _shard = self.gathering.pop(bi)
            work.wait()
            for p, view in zip(self.buckets[bi].params, self.buckets[bi].views(full)):
                p.data = view
            self.full[bi] = full

    @torch.no_grad()
    def free(self, bi):
        """Bucket bi back to its shard only: nothing in flight, parameters empty, and the buffer's
        memory released, whether the bucket was full or its gather still in flight."""
        if bi in self.gathering:  # a prefetch nobody used: wait for it, then release its buffer too
            work, full, _shard = self.gathering.pop(bi)
            work.wait()
            full.untyped_storage().resize_(0)
        if self.full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.full[bi].untyped_storage().resize_(0)  # frees it under autograd's saved views too
            self.full[bi] = None


    # ---- exercise 2 of lesson 05: the order the units run in -------------------------

    def record_order(self, u, module, args):
        if in_backward():  # beyond the exercise (lesson 08): a recomputation is not a new forward
            return
        if u == 0:  # a new forward begins: the last one predicts the order of this one
            self._last_order, self._order = self._order or self._last_order, []
        if u not in self._order:
            self._order.append(u)

    @property
    def forward_order(self):
        """The units (indices into self.units) in the order the latest forward ran them: the one
        under way once it has begun, else the last one ([] before the first forward)."""
        return self._order or self._last_order

    def next_in_forward(self, u):
        """The unit that ran right after u in the last forward (None: unknown, or none)."""
        k = self._last_order.index(u) + 1 if u in self._last_order else len(self._last_order)
        return self._last_order[k] if k < len(self._last_order) else None

    def next_in_backward(self, u):
        """The unit whose backward comes after u's: the one that ran before u in this forward
        (after the root's, the last unit's)."""
        if u == 0:
            return self._order[-1] if self._order else None
        k = self._order.index(u) - 1 if u in self._order else -1
        return self._order[k] if k >= 0 else None

    def _end_of_backward(self):
        super()._end_of_backward()  # ZeRO-2: send what is left, wait for every transfer
        for bi in range(len(self.buckets)):
            self.free(bi)  # the root unit, and any prefetch nobody used

    # ---- exercise 2 of lesson 05: the hooks ------------------------------------------

    def gather_unit(self, u, prefetch_next=None):
        """Unit u's parameters full; with prefetch, unit prefetch_next's gather started too."""
        for bi in self.buckets_of_unit[u]:
            self.start_gather(bi)
        if self.prefetch and prefetch_next is not None:
            for bi in self.buckets_of_unit[prefetch_next]:
                self.start_gather(bi)
        for bi in self.buckets_of_unit[u]:
            self.finish_gather(bi)

    def pre_forward(self, u, module, args):
        """Forward pre-hook of unit u: gather it, and prefetch the unit that comes next."""
        if in_backward():  # beyond the exercise (lesson 08): backward is recomputing u's forward
            return self._pre_recompute(u)
        self.gather_unit(u, prefetch_next=self.next_in_forward(u))

    def post_forward(self, u, module, args, output):
        """Forward hook of unit u: hook its outputs for the backward gather; free it (not the root)."""
        if in_backward():  # beyond the exercise (lesson 08): the end of a recomputed forward
            return self._post_recompute(u)
        backward_coming = torch.is_grad_enabled()
        if backward_coming:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(weak_hook(self.pre_backward), u), mode="any")
        if u != 0 or not backward_coming:  # the root stays gathered until backward ends
            for bi in self.buckets_of_unit[u]:
                self.free(bi)

    def pre_backward(self, u, grad):
        """The gradient of unit u's output is in: gather it again, prefetch the next backward's."""
        self.gather_unit(u, prefetch_next=self.next_in_backward(u))

    # Backward's prefetch stays in flight while unit u computes, on gloo too. It once was received
    # at once on gloo, because gloo's own all-gather held a full-size temporary until the slower
    # rank joined it, on top of backward's peak. zerokit.collectives' all-gather (in place)
    # holds nothing but the buffer the gather fills anyway. Receiving at once, measured again (a
    # copy of this code whose _pre_backward then finishes the next unit's gathers on gloo,
    # `python -m zerokit.bench -n 2`, 5 runs in turns with this code, on 2 CPU cores other jobs
    # shared): 1.31-1.49 of the floor against 1.05-1.36, slower in every run (87 and 89 ms a step
    # against 82 in the two quiet ones), for the same peak (39.31 MiB per rank in all ten).

    def send(self, bi):
        """Bucket bi's gradients are all in: reduce-scatter them (ZeRO-2), then free the weights."""
        self._before_send(bi)  # beyond the exercise: see _before_send
        super().send(bi)  # ZeRO-2: reduce-scatter the unit's gradients, free them ...
        self.free(bi)  # ... and its full parameters are no longer needed

    def _before_send(self, bi):
        """Beyond the exercise: no gather in flight beside a reduce-scatter, and the unit's own
        weights (its gradients are all in) freed before it starts (see above start_gather)."""
        for other in list(self.gathering):
            self.finish_gather(other)
        self.free(bi)

    # ---- beyond the exercise (lesson 08): recomputation, and no_sync -------------------
    #
    # Activation checkpointing (torch.utils.checkpoint, use_reentrant=False) runs a block's
    # forward a second time *inside backward*, when backward first needs what that forward
    # would have saved. The units inside the block were freed after their forward, so the
    # recomputation needs them gathered again; then their backward follows at once. Lesson
    # 05's hooks would get this wrong three ways: prefetch the next unit in forward order
    # (its backward is already over: a wasted all-gather, left gathered until backward ends),
    # free each unit after its recomputed forward (its backward then gathers it once more,
    # or, without early stop, runs on freed storage), and hook outputs that never receive a
    # gradient. in_backward() tells a recomputation from a forward; the two methods below
    # are what the forward hooks do then. A unit that is itself the checkpointed module is
    # gathered by its pre-backward hook, before the recomputation starts.

    def _pre_recompute(self, u):
        """Backward is about to recompute unit u's forward: make u full (gathering it if it
        was freed), and prefetch nothing."""
        self.gather_unit(u)

    def _post_recompute(self, u):
        """Unit u's recomputed forward is done: keep it full, since its backward comes next
        and send frees it once its gradients are reduce-scattered; hook nothing, since the
        recomputed outputs only stand in for saved tensors and never receive a gradient."""

    def _on_grad_ready(self, param):
        """ZeRO-2's hook, and under no_sync(): nothing is sent, but a unit whose gradients are
        all in is not needed by this backward any more: free its parameters (its full .grad
        stays, accumulating, until a backward outside no_sync() reduce-scatters it)."""
        super()._on_grad_ready(param)  # ZeRO-2's, which counts the arrival
        if not self._sync:
            bi, _ = self._where[param]
            if self._ready[bi] == len(self.buckets[bi].params):
                self.free(bi)
