r"""ZeRO-1 and ZeRO-2 with the optimizer you bring: elementwise optimizers shard for free.

    opt = zerokit.ZeRO1(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)  # ~ ZeroRedundancyOptimizer
    opt = zerokit.ZeRO2(model.parameters(), torch.optim.AdamW, lr=1e-3, bucket_mb=25)

Why any of them: Adam's update of element $i$ reads only element $i$ of the weights, the
gradient, m and v. So do SGD with momentum (a buffer per element), RMSprop and Adagrad (a
running sum of $g_i^2$), Adamax, NAdam, RAdam, Rprop, ASGD. For such an *elementwise*
optimizer the flat buffer can be cut anywhere, through the middle of a matrix, and each
rank can update its slice alone: the result is the same, element for element, as the
unsharded optimizer's.

How: the stages of lessons 03 and 04 are unchanged (flat buckets, reduce-scatter, all-gather);
only the state of a bucket's shard is different. For each parameter with a piece in this
rank's shard, a `Parameter` that is a *view* of that piece (a segment, zerokit.flat) is handed
to a local instance of the optimizer class: stepping it writes into the flat buffer, its
state (momentum, m, v, ...) is sized like the segment, 1/N of the whole, and a parameter
without a gradient on any rank gets `.grad = None`, which torch's optimizers skip (their step
counts stay per parameter). The wrapper's param_groups are the user's; their hyperparameters
are copied into the local optimizer before each step, so LR schedulers work.

Not elementwise, and refused: `torch.optim.LBFGS` (a line search over the whole parameter
vector), `torch.optim.Muon` (orthogonalises each whole matrix: lesson 09), Adafactor (factors
the second moment by rows and columns), and any class with `elementwise = False`.
"""

from dataclasses import dataclass

import torch

from .flat import FlatBucket
from .zero1 import ZeRO1Adam
from .zero2 import ZeRO2Adam

__all__ = ["ZeRO1", "ZeRO2", "LocalOptimizerState", "SegmentShard", "check_elementwise"]

# Whole-tensor optimizers, by class name (so a torch without one still imports this module).
NOT_ELEMENTWISE = {
    "LBFGS": "its line search evaluates the loss along one direction over every parameter at once",
    "Muon": "it orthogonalises each weight matrix's whole update (Newton-Schulz): a slice is not the matrix; "
            "zerokit.ZeRO1Muon shards it by giving each rank whole matrices (lesson 09)",
    "Adafactor": "it factors the second moment into row and column sums of each whole matrix",
    "SparseAdam": "it updates only the rows a sparse gradient names, which a flat shard does not keep",
}


def check_elementwise(optimizer_class):
    """Raise TypeError unless optimizer_class updates each element from that element's state alone."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"expected a torch.optim.Optimizer class (torch.optim.SGD, not an instance), "
                        f"got {optimizer_class!r}")
    name = optimizer_class.__name__
    why = NOT_ELEMENTWISE.get(name)
    if why is None and getattr(optimizer_class, "elementwise", True) is False:
        why = "it declares itself not elementwise (elementwise = False)"
    if why is not None:
        raise TypeError(f"{name} cannot run on flat shards: {why}. ZeRO-1/2 cut the flat buffer anywhere, "
                        "so they need an elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...); "
                        "a whole-tensor optimizer needs each tensor owned whole by one rank (lesson 09)")


class LocalOptimizerState:
    """One bucket's shard under a local instance of the user's optimizer class.

    The same role as zerokit.zero1.ShardedAdamState: `update(param_shard, grad_shard, present,
    group)` steps this rank's shard. The segment parameters are made at the first update, as
    views of `param_shard` (the flat weights, or their fp32 master under mixed precision).
    """

    def __init__(self, bucket, optimizer_class, defaults):
        self.bucket, self.optimizer_class, self.defaults = bucket, optimizer_class, defaults
        self.master = None  # lesson 06: the fp32 master of this shard's weights (fp32 runs: none)
        self.segments, self.local = None, None

    def keep_master(self, master, weights):
        self.master = master

    def copy_master(self, shard):
        shard.copy_(self.master)

    def _build(self, param_shard):
        self.segments = [torch.nn.Parameter(param_shard[s.shard_lo:s.shard_hi]) for s in self.bucket.segments]
        self._base = param_shard.data_ptr()
        # a rank whose shard is all padding holds no segment: its optimizer has nothing to step
        self.local = self.optimizer_class(self.segments, **self.defaults) if self.segments else None

    @torch.no_grad()
    def update(self, param_shard, grad_shard, present, group):
        if self.segments is None:
            self._build(param_shard)
        if self.local is None:
            return
        if param_shard.data_ptr() != self._base:  # the views would update a stale buffer
            raise RuntimeError("the flat weights of a bucket moved since the first step")
        for p, s in zip(self.segments, self.bucket.segments):
            p.grad = grad_shard[s.shard_lo:s.shard_hi] if present[s.index] else None
        local_group = self.local.param_groups[0]  # the bucket's group's hyperparameters (LR schedulers set them)
        local_group.update({k: v for k, v in group.items() if k in local_group and k != "params"})
        self.local.step()
        for p in self.segments:
            p.grad = None

    def tensors(self):
        """What this state holds, for the memory census: the master (if any) and the local optimizer's tensors."""
        held = [self.master]
        if self.local is not None:
            held += [v for st in self.local.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0]
        return held


class _BringYourOwn:
    """What ZeRO1 and ZeRO2 add to ZeRO1Adam and ZeRO2Adam: the optimizer class comes from the user."""

    def __init__(self, params, optimizer_class, *, group=None, precision=None, **defaults):
        check_elementwise(optimizer_class)
        self.optimizer_class = optimizer_class
        # the class's own defaults, completed with the user's keyword arguments (and checked by
        # the class itself): the wrapper's param_groups carry every hyperparameter a scheduler may set
        probe = torch.zeros(1, requires_grad=True)
        self.local_defaults = defaults  # what each local instance is built with
        torch.optim.Optimizer.__init__(self, params, dict(optimizer_class([probe], **defaults).defaults))
        self._shard(group, precision, None)

    def _new_state(self, bucket):
        return LocalOptimizerState(bucket, self.optimizer_class, self.local_defaults)

    def add_param_group(self, param_group):
        torch.optim.Optimizer.add_param_group(self, param_group)
        if hasattr(self, "buckets"):  # after construction: shard the new group now (a collective)
            self._shard_groups(len(self.param_groups) - 1)

    def local_optimizers(self):
        """This rank's local optimizer instances, one per bucket with a segment here."""
        return [s.local for s in self.shards if s.local is not None]

    def state_dict(self):
        """This rank's part of the state: load it on the same rank of the same world size (to change
        the world size, zerokit.checkpoint)."""
        return {"world_size": self.world_size, "rank": self.rank,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "local": [None if s.local is None else s.local.state_dict() for s in self.shards]}

    def load_state_dict(self, state_dict):
        if (state_dict["world_size"], state_dict["rank"]) != (self.world_size, self.rank):
            raise ValueError(f"this state_dict is rank {state_dict['rank']} of {state_dict['world_size']}; this "
                             f"optimizer is rank {self.rank} of {self.world_size}: load each rank's own")
        if len(state_dict["local"]) != len(self.shards):
            raise ValueError(f"this state_dict has {len(state_dict['local'])} buckets, this optimizer "
                             f"{len(self.shards)}: built on other parameters or another bucket size?")
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
        for i, (s, saved) in enumerate(zip(self.shards, state_dict["local"])):
            if saved is None:
                continue
            if s.segments is None:
                s._build(self._param_shard(i))
            s.local.load_state_dict(saved)

    def state_shards(self):
        """This rank's part of the state, one SegmentShard per bucket (lesson 07's contract, for any
        optimizer): what zerokit.checkpoint saves and loads into. A bucket whose local optimizer no
        step has built yet gets it now, with no state: a checkpoint may load into it."""
        out = []
        for i, (bucket, s) in enumerate(zip(self.buckets, self.shards)):
            weights = self._param_shard(i)
            if s.segments is None:
                s._build(weights)
            out.append(SegmentShard(bucket, self.bucket_group[i], weights, list(s.segments), s.local))
        return out


@dataclass
class SegmentShard:
    """One bucket's state on this rank where a torch optimizer steps this rank's shard through
    segment Parameters (ZeRO1/ZeRO2): what a checkpoint reads and fills.

    bucket: the FlatBucket (its parameters, their offsets, this rank's segments).
    group: the index of the bucket's param group (None: the user's optimizer knows its own groups).
    weights: this rank's fp32 shard of the flat weights (the fp32 master under mixed precision).
    params: one Parameter per bucket.segments, a view of its piece of `weights`.
    optimizer: the optimizer whose state, keyed by those Parameters, holds the rest (None: the user's).
    """

    bucket: FlatBucket
    group: int | None
    weights: torch.Tensor
    params: list
    optimizer: torch.optim.Optimizer | None


class ZeRO1(_BringYourOwn, ZeRO1Adam):
    """ZeRO stage 1 with any elementwise torch optimizer: ZeroRedundancyOptimizer's shape.

    ZeRO1(params, optimizer_class, group=None, precision=None, bucket_mb=None, **defaults): the
    optimizer state of this rank's shard only (1/N); full gradients until step(), which steps
    the shard with `optimizer_class(**defaults)` and all-gathers the weights. The mean gradient
    is reduce-scattered in step() (bucket_mb=None), or per bucket of bucket_mb MiB as soon as
    backward completes it, overlapping the rest of backward (zerokit.ZeRO1Adam's bucket_mb).
    """

    def __init__(self, params, optimizer_class, *, group=None, precision=None, bucket_mb=None, **defaults):
        self.bucket_mb = bucket_mb
        super().__init__(params, optimizer_class, group=group, precision=precision, **defaults)


class ZeRO2(_BringYourOwn, ZeRO2Adam):
    """ZeRO stage 2 with any elementwise torch optimizer: gradients reduce-scattered in buckets
    during backward (bucket_mb), then the shard stepped as in ZeRO1."""

    def __init__(self, params, optimizer_class, *, bucket_mb=25.0, group=None, precision=None, **defaults):
        self.bucket_mb = bucket_mb
        super().__init__(params, optimizer_class, group=group, precision=precision, **defaults)
