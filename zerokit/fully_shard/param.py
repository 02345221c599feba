r"""One parameter under FSDP2: its dim-0 shard, the DTensor the model shows, the unsharded view.

Lesson 05's ZeRO-3 lays a unit's parameters end to end in one flat buffer and cuts the buffer
into N equal pieces, anywhere: a rank may hold the end of one weight and the start of the next,
or nothing of a small one. FSDP2 cuts each parameter on its own, along dim 0, as `torch.chunk`
does: with $R$ rows and N ranks each rank holds $c = \lceil R / N \rceil$ rows, rank r the rows
$[rc, \min((r+1)c, R))$ (the last ranks may hold fewer, or none), padded with zero rows to c so
that every rank's piece has the same size. The piece is a `DTensor` placed `Shard(0)` on the
mesh: torch.optim, `clip_grad_norm_`, `state_dict()` and DCP read it as what it is, this rank's
rows of a tensor of the full shape.

A parameter has four forms here, as in FSDP2:
- the **padded shard** (`padded`): this rank's c rows, flat, the storage;
- the **sharded parameter** (`sharded_param`): an `nn.Parameter` holding a DTensor whose local
  tensor is the real rows of the padded shard (a view: the optimizer writes the storage);
- the **gathered** buffer (`gathered`): N padded shards end to end, in the compute dtype,
  allocated while the group is unsharded and freed (its storage resized to 0) after;
- the **unsharded parameter** (`unsharded_param`): an `nn.Parameter` viewing the first R rows
  of `gathered`, made once and reused, so that what autograd saved in forward still points at
  the storage that backward's all-gather fills again.

The module shows one of them (`show`): the sharded parameter at rest, the unsharded one while
its group computes, and between forward and backward with `reshard_after_forward=k` (hpZ) a
DTensor of this rank's 1/k of the gathered buffer (`post_forward`), from which backward's
all-gather inside the node rebuilds it.
"""

import itertools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["dim0_chunk", "shard_param", "ShardedParam"]


def dim0_chunk(rows, world_size, rank):
    """(start, length, padded): the rows of a dim-0 of `rows` that rank `rank` of `world_size` holds,
    as torch.chunk cuts them, and the rows every rank's piece is padded to, ceil(rows / N)."""
    padded = math.ceil(rows / world_size)
    start = min(rank * padded, rows)
    return start, min(padded, rows - start), padded


def placements(mesh):
    """Where a shard sits on the mesh: Shard(0) on a 1-D mesh; on a 2-D one (HSDP) each row of ranks is a
    replica and shards across its columns."""
    return (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))


@torch.no_grad()
def shard_param(param, mesh):
    """(padded, sharded): this rank's rows of `param` padded with zero rows to ceil(R / N), flat (the
    storage), and an nn.Parameter holding a DTensor of param's shape, placed Shard(0) on `mesh`, whose
    local tensor is a view of the real rows of that storage."""
    # beyond the exercise: a 2-D mesh (HSDP) shards over its last dimension, each row a replica;
    # the exercise: `start, length, padded_rows = dim0_chunk(param.size(0), mesh.size(), mesh.get_local_rank())`
    start, length, padded_rows = dim0_chunk(param.size(0), mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))
    padded = torch.zeros(padded_rows, *param.shape[1:], dtype=param.dtype, device=param.device)
    padded[:length].copy_(param.detach()[start:start + length])
    # beyond the exercise: (Replicate(), Shard(0)) on a 2-D mesh;
    # the exercise: `local = DTensor.from_local(padded[:length], mesh, (Shard(0),), run_check=False,
    #     shape=param.size(), stride=param.stride())`
    local = DTensor.from_local(padded[:length], mesh, placements(mesh), run_check=False, shape=param.size(),
                               stride=param.stride())
    return padded.view(-1), nn.Parameter(local, requires_grad=param.requires_grad)


_UIDS = WeakIdKeyDictionary()  # an original parameter -> its number (id() is reused once one is collected)
_NEXT_UID = itertools.count()


def _uid(param):
    if param not in _UIDS:
        _UIDS[param] = next(_NEXT_UID)
    return _UIDS[param]


def _contiguous_stride(size):
    stride, step = [], 1
    for n in reversed(size):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def _set_on_module(module, name, param):
    if type(module).__setattr__ is nn.Module.__setattr__:  # skip nn.Module's checks: once per parameter and step
        module._parameters[name] = param
    else:
        setattr(module, name, param)


class ShardedParam:
    """One parameter's record (FSDP2's FSDPParam): where it lives in the model, its dim-0 shard,
    its DTensor, and the gathered buffer and unsharded parameter of the compute copy.

    places: every (module, name) that holds the parameter (a shared one: several).
    mesh: the data-parallel DeviceMesh: 1-D (Shard(0)) or 2-D (Replicate(), Shard(0)): HSDP.
    shard_rank, shard_size: this rank's place in the mesh's last dimension, the one sharded over.
    post_forward: None, or (mesh, rank, size) of the node group hpZ reshards to after forward.
    """

    def __init__(self, param, places, mesh, shard_rank, shard_size, post_forward, device, offload):
        if isinstance(param, DTensor):
            raise NotImplementedError(f"{self._name(places)} is a DTensor already (tensor parallelism?): "
                                      "zerokit.fully_shard shards plain parameters on a 1-D or 2-D data-parallel "
                                      "mesh; FSDP2 composes with tensor parallelism, zerokit's does not")
        if param.dim() == 0:
            raise ValueError(f"fully_shard shards along dim 0, and {self._name(places)} is a scalar: make it a "
                             "1-D tensor of one element")
        if not param.is_contiguous():
            raise NotImplementedError(f"fully_shard needs contiguous parameters; {self._name(places)} has strides "
                                      f"{param.stride()} (channels-last?)")
        self.places, self.mesh, self.offload = places, mesh, offload
        self.orig_id = _uid(param)  # two calls that find the same parameter (tied across them) are refused
        self.orig_size, self.orig_stride = param.size(), _contiguous_stride(param.size())
        self.world_size = shard_size
        _, length, padded_rows = dim0_chunk(param.size(0), shard_size, shard_rank)
        self.padded_size = torch.Size([padded_rows, *param.shape[1:]])
        self.sharded_size = torch.Size([length, *param.shape[1:]])
        home = torch.device("cpu") if offload else device  # offload: shard, gradient, optimizer state on the host
        if not (param.is_meta or param.device == home):  # meta: storage comes with module.to_empty()
            with torch.no_grad():
                param = nn.Parameter(param.to(home), requires_grad=param.requires_grad)
        self.padded, self.sharded_param = shard_param(param, mesh)
        self.post_forward = post_forward
        self.post_forward_param = None  # hpZ: this rank's 1/k of the gathered buffer, between forward and backward
        self.post_forward_flat = None  # its storage, flat: what backward's all-gather inside the node sends
        self.gathered = None
        self.unsharded_param = None
        self.accumulated_grad = None  # no-sync accumulation in the reduce dtype, when it differs from the compute one
        self.orig_dtype = param.dtype
        self.param_dtype = self.reduce_dtype = None
        self.show(self.sharded_param)

    @staticmethod
    def _name(places):
        module, name = places[0]
        return f"{type(module).__name__}.{name}"

    @property
    def name(self):
        return self._name(self.places)

    def set_dtypes(self, mp_policy):
        """FSDP2's reading of a MixedPrecisionPolicy: param_dtype None where it is the parameter's own
        dtype (or the parameter is not floating point), reduce_dtype None where it equals param_dtype."""
        param_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
        self.orig_dtype = self.sharded_param.dtype
        self.reduce_dtype = None if reduce_dtype == param_dtype else reduce_dtype
        self.param_dtype = None if param_dtype in (None, self.orig_dtype) or not self.orig_dtype.is_floating_point \
            else param_dtype

    @property
    def compute_dtype(self):
        return self.param_dtype or self.orig_dtype

    # ---- what the module shows -------------------------------------------------------------------

    def show(self, param):
        for module, name in self.places:
            _set_on_module(module, name, param)

    def to_sharded(self):
        self.show(self.sharded_param)
        self.post_forward_param = self.post_forward_flat = None
        self.free_gathered()

    def to_unsharded(self):
        if self.unsharded_param.requires_grad != self.sharded_param.requires_grad:  # frozen (or thawed) since
            self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        self.show(self.unsharded_param)
        self.post_forward_param = self.post_forward_flat = None

    def to_post_forward(self):
        """hpZ: keep this rank's 1/k of the gathered buffer (a copy, so the buffer can be freed) and show it."""
        mesh, rank, size = self.post_forward
        piece = self.gathered.numel() // size
        kept = self.gathered.narrow(0, piece * rank, piece).clone()
        start, length, _ = dim0_chunk(self.orig_size[0], size, rank)
        rows = kept.view(-1, *self.orig_size[1:])[:length]
        self.post_forward_param = nn.Parameter(
            DTensor.from_local(rows, mesh, (Replicate(), Shard(0)), run_check=False, shape=self.orig_size,
                               stride=self.orig_stride), requires_grad=self.sharded_param.requires_grad)
        self.post_forward_flat = kept
        self.show(self.post_forward_param)
        self.free_gathered()

    # ---- the gathered buffer -------------------------------------------------------------------------

    def all_gather_input(self, post_forward):
        """What this rank sends (cast to the compute dtype by the copy-in): its padded shard, or after an
        hpZ forward its 1/k of the gathered buffer."""
        return self.post_forward_flat if post_forward else self.padded

    def gathered_buffer(self, device):
        """The gathered buffer (world_size pieces of this rank's all-gather input), allocated; made once."""
        numel = self.padded.numel() * self.world_size
        if self.gathered is None:
            self.gathered = torch.empty(numel, dtype=self.compute_dtype, device=device)
            rows = self.gathered.as_strided(self.orig_size, self.orig_stride, 0)
            self.unsharded_param = nn.Parameter(rows, requires_grad=self.sharded_param.requires_grad)
        storage = self.gathered.untyped_storage()
        if storage.size() != numel * self.gathered.itemsize:
            storage.resize_(numel * self.gathered.itemsize)
        return self.gathered

    def free_gathered(self):
        if self.gathered is not None and self.gathered.untyped_storage().size():
            self.gathered.untyped_storage().resize_(0)

    @property
    def is_gathered(self):
        return self.gathered is not None and self.gathered.untyped_storage().size() > 0

    # ---- the gradient ------------------------------------------------------------------------------------

    def take_unsharded_grad(self, zeros_if_none=False):
        """The full local gradient this backward left (with any accumulated one), handed over and cleared;
        zeros_if_none: zeros for a trainable parameter that got none (so that every rank sends the same sizes)."""
        if self.accumulated_grad is not None:
            grad, self.accumulated_grad = self.accumulated_grad, None
            return grad
        if self.unsharded_param is None:
            return None
        if self.unsharded_param.grad is None:
            return torch.zeros_like(self.unsharded_param) if zeros_if_none and self.unsharded_param.requires_grad \
                else None
        grad, self.unsharded_param.grad = self.unsharded_param.grad, None
        return grad

    def accumulate_unsharded_grad(self):
        """No-sync accumulation: a gradient kept in the reduce dtype absorbs the one this backward made."""
        if self.accumulated_grad is not None and self.unsharded_param.grad is not None:
            self.accumulated_grad += self.unsharded_param.grad
            self.unsharded_param.grad = None

    def keep_grad_in_reduce_dtype(self):
        """No-sync, in 16 bits with an fp32 reduce dtype: the gradient goes on accumulating in fp32 (FSDP2)."""
        grad = None if self.unsharded_param is None else self.unsharded_param.grad
        if self.reduce_dtype is None or grad is None or grad.dtype == self.reduce_dtype:
            return
        self.unsharded_param.grad = None
        self.accumulated_grad = grad.to(self.reduce_dtype)

    def add_sharded_grad(self, grad):
        """Give the sharded parameter this reduced gradient shard (a DTensor) as its .grad, or add it to the one
        there."""
        if self.offload:
            grad = DTensor(grad.to_local().to("cpu"), grad._spec, requires_grad=False)  # the spec: see shard_grads
        if self.sharded_param.grad is None:
            self.sharded_param.grad = grad
        else:
            self.sharded_param.grad.to_local().add_(grad.to_local())
        for hook in (getattr(self.sharded_param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(self.sharded_param)

    # ---- after load_state_dict(assign=True), module.to(), module.float() ------------------------------

    def reset_sharded_param(self):
        """The module may hold a new sharded parameter (load_state_dict with assign=True, _apply): adopt it,
        and its local rows as the storage (padded again if needed)."""
        module, name = self.places[0]
        param = module._parameters[name]
        if param is self.unsharded_param or param is self.post_forward_param:
            return
        self.sharded_param = param
        local = param.to_local()
        if local.is_meta:
            return
        storage = self.padded.untyped_storage()
        if not self.padded.is_meta and local.dtype == self.padded.dtype and \
                local.untyped_storage().data_ptr() == storage.data_ptr() != 0:
            return  # still a view of this record's storage (a rank with no rows of it included)
        with torch.no_grad():
            padded = local.new_zeros(self.padded_size)
            padded[:local.size(0)].copy_(local)
        if (padded.dtype, padded.device) != (self.padded.dtype, self.padded.device):
            self.gathered = self.unsharded_param = None  # made again, in the new dtype or on the new device
        self.padded = padded.view(-1)
        param._local_tensor = padded[:local.size(0)]  # the DTensor views the new storage, as FSDP2's does
