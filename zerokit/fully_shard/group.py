r"""One `fully_shard` call's parameters, communicated together (FSDP2's FSDPParamGroup).

A group is in one of three sharded states, changed in one place (`_set_state`):

| state | the module shows | memory per rank |
|---|---|---|
| `SHARDED` | the sharded DTensors | the padded shards, $\sum_i c_i \cdot \text{row}_i$ |
| `UNSHARDED` | the unsharded parameters | the shards and every parameter full |
| `SHARDED_POST_FORWARD` | this rank's 1/k of the gathered buffer (hpZ) | the shards and 1/k of the full |

and, across a training step, in one of four phases (`Phase`): idle, forward, pre-backward
(its parameters gathered again for backward) and post-backward (its gradients reduced).

The step, for one group:
- forward: `pre_forward` gathers (`unshard`, `wait_for_unshard`: the copy-in, the all-gather,
  the copy-out), puts an autograd function on the inputs whose backward runs `post_backward`;
  `post_forward` reshards (to SHARDED, to SHARDED_POST_FORWARD under hpZ, or not at all with
  `reshard_after_forward=False`) and records the group's place in the forward order;
- backward: the first gradient at one of its outputs runs `pre_backward` (gather again, and
  start the gather of the group before it in forward order: backward's prefetch); once the
  gradients at its inputs are computed, `post_backward` takes the full local gradients,
  reshards, and reduce-scatters them (chunk-cat, `ReduceScatter`, and on a 2-D mesh an
  all-reduce across the replicas), leaving each sharded parameter a DTensor .grad;
- controls change what those steps do: `reduce_grads` (False: no-sync, the full gradients
  stay and accumulate), `all_reduce_grads` (HSDP: reduce-scatter but keep the replicas apart),
  `reshard_after_backward`, `unshard_in_backward`.
"""

import contextlib
from enum import Enum, auto
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..hooks import in_backward  # a forward called from backward is recomputation
from .collectives import (AllGather, Gathering, ReduceScatter, all_gather_copy_in, all_gather_copy_out,
                          divide_factors, reduce_scatter_copy_in, shard_grads)

__all__ = ["ShardedState", "Phase", "ParamGroup"]


class ShardedState(Enum):
    SHARDED = auto()
    SHARDED_POST_FORWARD = auto()
    UNSHARDED = auto()


class Phase(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class _PostBackward(torch.autograd.Function):
    """Identity on a group's forward inputs; its backward, which autograd runs once the gradients at those
    inputs are computed (so the group's own parameters' gradients are done), reduces the group's."""

    @staticmethod
    def forward(ctx, group, *inputs):
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.group.post_backward()
        return (None, *grads)


# Reduce-scatters in flight at once. One, as FSDP2 keeps one input buffer: the next group's backward computes while
# it runs, and the next reduce-scatter lands it before its copy-in, so no two N * S inputs are alive together.
MAX_REDUCING = 1


class Reducing(NamedTuple):
    """A reduce-scatter in flight: whose gradients, its input (alive until it lands) and output, the work to
    wait on, the op (HSDP's all-reduce uses it too) and the division left for after."""
    group: object
    params: list
    input: torch.Tensor
    output: torch.Tensor
    work: object
    op: object
    after: float


class ParamGroup:
    """The parameters of one fully_shard call (`params`: ShardedParam records), gathered, resharded and
    reduced together. `shared` is the per-model context (the forward order backward prefetches by)."""

    def __init__(self, params, modules, mesh, post_forward_mesh, device, mp_policy, offload):
        self.params, self.modules, self.mesh, self.device = params, modules, mesh, device
        self.post_forward_mesh = post_forward_mesh  # None: keep unsharded after forward; mesh: reshard; other: hpZ
        self.mp_policy, self.offload = mp_policy, offload
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.state, self.phase = ShardedState.SHARDED, Phase.IDLE
        self.all_gather, self.reduce_scatter = AllGather(), ReduceScatter()
        self.shared = None
        self.gathering = None  # a Gathering in flight
        self.partial_reduce = None  # HSDP without all-reduce: the reduce-scattered sum waiting for it
        self.post_forward_indices = []
        self.name = None  # the module's name in the model, for messages
        # the controls (FSDPModule's setters)
        self.reduce_grads = self.all_reduce_grads = True
        self.reshard_after_backward = self.unshard_in_backward = True
        self.unshard_async_op = False
        self.reduce_scatter_unused_params = False
        self.all_reduce_hook = None
        self.orig_dtype = self.reduce_dtype = None
        self._initialised = False
        self._hook_state_dicts()

    def lazy_init(self):
        """Before the first forward: every fully_shard call is made, the dtypes are settled."""
        if self._initialised:
            return
        self._reset_params()  # the module may hold new parameters by now (assign=True loads, to_empty)
        meta = [p.name for p in self.params if p.padded.is_meta]
        if meta:
            raise RuntimeError(f"{', '.join(meta)} are still on the meta device: give them storage before the first "
                               "forward (module.to_empty(device=...), then initialise them, e.g. reset_parameters())")
        self._initialised = True
        for p in self.params:
            p.set_dtypes(self.mp_policy)
        trainable = [p for p in self.params if p.sharded_param.requires_grad]
        for what in ("orig_dtype", "reduce_dtype"):
            found = {getattr(p, what) for p in trainable}
            if len(found) > 1:
                raise ValueError(f"fully_shard reduces a group's gradients in one collective, so its trainable "
                                 f"parameters need one {what.replace('_', ' ')}; {self.name or 'this group'} has "
                                 f"{sorted(map(str, found))}: shard them in separate fully_shard calls")
            setattr(self, what, found.pop() if found else None)

    def _hook_state_dicts(self):
        """state_dict() and load_state_dict() see the sharded DTensors; a load may bring new ones (assign=True)."""
        for module in {id(m): m for p in self.params for m, _ in p.places}.values():
            module.register_state_dict_pre_hook(lambda *_: self._to_sharded())
            module.register_load_state_dict_pre_hook(lambda *_: self._to_sharded())
            module.register_load_state_dict_post_hook(lambda *_: self._reset_params())

    def _reset_params(self):
        for p in self.params:
            p.reset_sharded_param()

    def memory_categories(self):
        """The tensors this group holds now, by category: the padded shards, the gathered buffers that are
        allocated and hpZ's kept pieces (parameters); the shards' gradients, full local gradients not reduced
        yet and reductions in flight (gradients)."""
        params = [p.padded for p in self.params] + [p.gathered for p in self.params if p.is_gathered]
        params += [p.post_forward_flat for p in self.params if p.post_forward_flat is not None]
        grads = [p.sharded_param.grad.to_local() for p in self.params if p.sharded_param.grad is not None]
        grads += [g for p in self.params for g in (p.accumulated_grad, getattr(p.unsharded_param, "grad", None))
                  if g is not None]
        grads += [t for r in (self.shared.reducing if self.shared else ()) if r.group is self
                  for t in (r.input, r.output)]
        return {"parameters": params, "gradients": grads}

    # ---- the sharded state, changed here only ---------------------------------------------------------

    def _set_state(self, state):
        if state is self.state:
            return
        for p in self.params:
            {ShardedState.SHARDED: p.to_sharded, ShardedState.UNSHARDED: p.to_unsharded,
             ShardedState.SHARDED_POST_FORWARD: p.to_post_forward}[state]()
        self.state = state

    def _to_sharded(self):
        self._set_state(ShardedState.SHARDED)

    @property
    def is_unsharded(self):
        return self.state is ShardedState.UNSHARDED

    @property
    def reshards_after_forward(self):
        return self.post_forward_mesh is not None

    @property
    def uses_post_forward_mesh(self):
        return self.reshards_after_forward and self.post_forward_mesh is not self.mesh

    @contextlib.contextmanager
    def in_phase(self, phase):
        old, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = old

    # ---- gather and free ------------------------------------------------------------------------------

    def unshard(self, async_op=False):
        """Start the all-gather of every parameter (a no-op if gathered or already in flight)."""
        if self.gathering is not None or self.is_unsharded:
            return
        if not self.unshard_in_backward and self.phase is Phase.PRE_BACKWARD:
            return
        post_forward = self.state is ShardedState.SHARDED_POST_FORWARD
        group = self.post_forward_mesh.get_group(1) if post_forward else self.shard_group
        inputs = [p.all_gather_input(post_forward) for p in self.params]
        if self.offload:
            inputs = [t.to(self.device, non_blocking=True) for t in inputs]
        dtypes = {p.compute_dtype for p in self.params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
        if dtype is torch.uint8:  # parameters of several dtypes (a frozen bf16 one beside fp32): gathered as bytes
            inputs = [t.to(p.compute_dtype).view(torch.uint8) for p, t in zip(self.params, inputs)]
        output, row = all_gather_copy_in(inputs, group.size(), group.rank(), dtype, self.device)
        work = self.all_gather(output, row, group, async_op=async_op)
        self.gathering = Gathering(output, work if async_op else None, [t.numel() for t in inputs])

    def wait_for_unshard(self):
        """Finish the all-gather in flight: copy out into every parameter's gathered buffer, show them."""
        if self.gathering is None:
            return
        output, work, sizes = self.gathering
        if work is not None:
            work.wait()
        outs = [p.gathered_buffer(self.device) for p in self.params]
        if output.dtype is torch.uint8:
            outs = [o.view(torch.uint8) for o in outs]
        all_gather_copy_out(output, sizes, outs)
        self.gathering = None
        self._set_state(ShardedState.UNSHARDED)

    def reshard(self):
        """Free the gathered parameters; in forward, as reshard_after_forward says (hpZ: keep 1/k)."""
        if self.phase is Phase.FORWARD:
            if not self.reshards_after_forward:
                return
            if self.uses_post_forward_mesh:
                self._set_state(ShardedState.SHARDED_POST_FORWARD)
                return
        self._set_state(ShardedState.SHARDED)

    # ---- forward -----------------------------------------------------------------------------------------

    def pre_forward(self, args, kwargs, tensors_in, replace_tensors):
        entering = self.phase is not Phase.FORWARD
        self.phase = Phase.FORWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        if entering and torch.is_grad_enabled():
            found = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
            if found:
                args, kwargs = replace_tensors((args, kwargs), iter(_PostBackward.apply(self, *found)))
        return args, kwargs

    def post_forward(self):
        if not in_backward():
            self.reshard()
            self.post_forward_indices.append(len(self.shared.post_forward_order))
            self.shared.post_forward_order.append(self)
        self.phase = Phase.IDLE

    # ---- backward -----------------------------------------------------------------------------------------

    def pre_backward(self, default_prefetch):
        if self.phase is Phase.PRE_BACKWARD:
            return
        self.phase = Phase.PRE_BACKWARD
        self.unshard(self.unshard_async_op)
        self.wait_for_unshard()
        if default_prefetch and self.post_forward_indices:
            index = self.post_forward_indices.pop()
            if index > 0:
                self.prefetch(self.shared.post_forward_order[index - 1], Phase.PRE_BACKWARD)

    @staticmethod
    def prefetch(target, phase):
        """Start `target`'s all-gather now, as if in `phase` (so that it honours that phase's rules). On a GPU
        without waiting: the current group's compute overlaps it (FSDP2 runs it on a stream of its own); on
        the CPU at once, as FSDP2 does there (gloo's asynchronous all-gather holds a temporary of its own)."""
        with target.in_phase(phase):
            target.unshard(async_op=target.unshard_async_op or target.device.type != "cpu")

    def post_backward(self):
        # a list of modules, one of which was called on its own after the model's forward (a loss head over
        # chunks): its pre-backward never ran, nor will the backward's end, so its gradients land here
        standalone = len(self.modules) > 1 and self.phase is Phase.FORWARD
        self.phase = Phase.POST_BACKWARD
        for p in self.params:
            p.accumulate_unsharded_grad()
        if not self.reduce_grads:  # no-sync: the full local gradients stay, to be added to
            if self.reshard_after_backward:
                self.reshard()
            for p in self.params:
                p.keep_grad_in_reduce_dtype()
            return
        params, grads = [], []
        for p in self.params:
            grad = p.take_unsharded_grad(self.reduce_scatter_unused_params)
            if grad is not None:
                params.append(p)
                grads.append(grad)
        if self.reshard_after_backward:
            self.reshard()
        if params:
            self._reduce(params, grads)  # empties `grads`: the full gradients go once copied in
            if standalone:
                self.finish_reduce()

    def _reduce(self, params, grads):
        """Start the reduce-scatter of the full local gradients (chunk-cat, then the collective, asynchronous:
        backward goes on computing the groups before this one while it runs); `finish_reduce` lands it."""
        if len({g.dtype for g in grads}) != 1:
            raise RuntimeError(f"fully_shard reduces one dtype per group; {self.name} made gradients of "
                               f"{sorted({str(g.dtype) for g in grads})}")
        dtype = self.reduce_dtype or grads[0].dtype
        world = self.shard_group.size()
        replicas = self.replicate_group.size() if self.replicate_group is not None else 1
        before, after, op = divide_factors(dtype, world * replicas)
        while len(self.shared.reducing) >= MAX_REDUCING:  # land the one in flight first: its input goes
            self.shared.reducing[0].group.finish_reduce()
        flat = reduce_scatter_copy_in(grads, world, dtype)
        grads.clear()  # the full gradients are free once copied in (the caller's list holds them too)
        if before not in (None, 1):
            flat.div_(before)
        output = torch.empty(flat.numel() // world, dtype=dtype, device=self.device)
        work = None
        if world > 1:
            # asynchronous on a GPU (the next group's backward runs while NCCL reduces); on the CPU gloo's
            # reduce-scatter holds a temporary as large as its input until it lands, so an overlapped one
            # raised the peak 4-11% above FSDP2's (bench --fsdp2) for no gain of time on two cores
            work = self.reduce_scatter(output, flat, self.shard_group, op, async_op=self.device.type != "cpu")
        else:
            output.copy_(flat)
        self.shared.reducing.append(Reducing(self, params, flat, output, work, op, after))

    def finish_reduce(self):
        """Land this group's oldest reduce-scatter in flight: wait for it, all-reduce across replicas (HSDP),
        divide, cast to the parameters' dtype, and give each sharded parameter its rows as its .grad."""
        shared = self.shared
        mine = next(r for r in shared.reducing if r.group is self)
        shared.reducing.remove(mine)
        _, params, _, output, work, op, after = mine
        if work is not None:
            work.wait()
        if self.replicate_group is not None:
            if not self.all_reduce_grads:  # HSDP accumulation: reduce-scattered, the replicas kept apart for now
                self.partial_reduce = output if self.partial_reduce is None else self.partial_reduce.add_(output)
                return
            if self.partial_reduce is not None:
                output += self.partial_reduce
                self.partial_reduce = None
            dist.all_reduce(output, op=op, group=self.replicate_group)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(output)
        if after not in (None, 1):
            output.div_(after)
        if self.orig_dtype is not None and output.dtype != self.orig_dtype:
            output = output.to(self.orig_dtype)
        for p, grad in zip(params, shard_grads(output, [p.sharded_param for p in params])):
            p.add_sharded_grad(grad)

    def finalize_backward(self):
        """The last backward of a step is over: drop any gather prefetched but never used, forget the order
        (the reductions in flight are landed by the backward's end, ModuleState._after_backward)."""
        if self.gathering is not None:
            if self.gathering.work is not None:
                self.gathering.work.wait()
            self.gathering = None
        self.post_forward_indices.clear()

    def reset_iter_state(self):
        if self.shared is not None:
            for r in [r for r in self.shared.reducing if r.group is self]:
                self.shared.reducing.remove(r)  # a failed step's gradients are dropped, as FSDP2 drops them
        self.finalize_backward()
        self.partial_reduce = None
        self.phase = Phase.IDLE
        self._to_sharded()
