r"""Any torch optimizer's state in a checkpoint, wherever a wrapper keeps it (beyond lesson 07).

Lesson 07 saves Adam: per bucket, this rank's shard of three fp32 tensors (weights, m, v),
and a step count per parameter. An elementwise optimizer is the same with other names: each
element's state is a few numbers of its own (SGD's momentum buffer, Adagrad's running sum,
RMSprop's square average), and each parameter may have a few numbers besides (a step count,
NAdam's running product). So a checkpoint of optimizer X holds, per bucket, the shards of the
weights and of each of X's per-element tensors, in the same layout; each parameter's numbers
go into the metadata, with X's class, and its hyperparameters and state keys per param group
(format version 2; the lessons' Adam optimizers still write version 1).

**Which tensors X keeps** is asked of X itself: a throwaway instance, with the group's
hyperparameters, steps a 2x2 probe once (SGD keeps a momentum buffer only when momentum is not
0). A value shaped like the probe is per element, a number or a 0-d tensor is per parameter;
anything else (a factored second moment, LBFGS's history) cannot be cut into flat shards and
is refused. The probe also shows the type each number has (the step count: a float32 tensor,
on the CPU unless the optimizer is fused or capturable), so a loaded number is made the way X
makes it.

**Where the state is**, four ways, each described as Pieces: elements [lo, hi) of a named
parameter, a view of their weights, and the (optimizer, parameter) whose state holds them.
- `zerokit.ZeRO1/ZeRO2(params, X)`: per bucket a local X steps this rank's shard through
  segment Parameters (zerokit.elementwise); their state is 1/N of X's.
- `zerokit.FullyShard(model)`, or a model sharded by `zerokit.fully_shard` calls (or torch's
  fully_shard), + X: every parameter a DTensor of this rank's dim-0 rows, stepped by the user's
  X, whose state is DTensors of the same rows. A parameter is a bucket of its own, its rows one
  contiguous range of it flattened (zerokit.checkpoint.rows).
- `zerokit.DataParallel(model)` + X (or a plain model in one process): every parameter whole on
  every rank. Each rank writes the 1/N that ZeRO-1 would own; on load every rank reads it all.
- `zerokit.ZeRO1Muon` (lesson 09): the weights replicated, each matrix's momentum on its owner
  only. Saved as torch.optim.Muon's state in the replicated layout, so the owners of the
  saving world size leave no trace in the files and the next world size's owners read theirs.
Because every layout is flat buckets read by offsets, a checkpoint of any of them loads into any
other, at any world size, by names and offsets (zerokit.checkpoint.load); the state of one
optimizer class never loads into another.
"""

import functools
import inspect
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from ..adam import Adam
from ..data_parallel import DataParallel
from ..ddp import DistributedAdam
from ..elementwise import ZeRO1, ZeRO2
from ..flat import FlatBucket
from ..fully_shard import FSDPModule, FullyShard
from ..muon import ZeRO1Muon
from ..stages import stage_of
from ..zero1 import ZeRO1Adam
from .files import agree
from .rows import RowBucket, check_row_sharded, is_dtensor, local
from .state import (ADAMW, AdamJob, Target, aliases, check_optimizer_class, loss_scaler, parameter_names,
                    restore_loss_scaler, saved_kinds, saved_numbers, saved_state_keys)

__all__ = ["job_of", "fsdp_modules", "TorchJob", "Piece", "class_name", "state_template", "IMPLEMENTATION"]

# Param group keys that say how to compute, not what: never saved, never restored.
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
CHUNK = 1 << 16  # elements of zeros written at once where a shard has no state


def fsdp_modules(model):
    """The modules of `model` that zerokit.fully_shard or torch's fully_shard sharded (FSDPModules)."""
    return [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]


def class_name(cls):
    """How a checkpoint names an optimizer class: "torch.optim.SGD", or its module's path.
    zerokit's Adam is torch's AdamW bit for bit (lesson 01): the same name, the same state."""
    if cls is Adam:
        return ADAMW
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def state_template(optimizer_class, group, device):
    """{key: None (per element) or an example of the number (per parameter)}: the state
    optimizer_class keeps for each parameter under `group`'s hyperparameters, found by stepping a
    throwaway instance once on a 2x2 probe (2-D, so an optimizer that factors matrices shows it)."""
    name = class_name(optimizer_class)
    probe = torch.nn.Parameter(torch.zeros(2, 2, device=device))
    accepted = inspect.signature(optimizer_class.__init__).parameters
    kwargs = {k: v for k, v in group.items() if k in accepted and k not in ("params", "self")}
    try:
        optimizer = optimizer_class([probe], **kwargs)
        probe.grad = torch.full_like(probe, 0.5)
        optimizer.step()
    except Exception as exc:  # noqa: BLE001 (whatever it is, the reason goes into the message)
        raise TypeError(f"zerokit.checkpoint cannot tell what state {name} keeps: one step on a probe tensor "
                        f"failed ({type(exc).__name__}: {exc})") from None
    template = {}
    for key, value in optimizer.state[probe].items():
        if isinstance(value, torch.Tensor) and value.shape == probe.shape:
            template[key] = None
        elif isinstance(value, (bool, int, float)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            template[key] = value
        else:
            shape = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"{name} keeps {key!r} as {shape} for a 2x2 parameter: neither one number per element "
                            "nor one per parameter, so flat shards cannot hold it (a whole-tensor optimizer)")
    if "weights" in template:
        raise TypeError(f"{name} keeps a state named 'weights', the name a checkpoint gives the parameters")
    return template


def _number(value):
    return value.item() if isinstance(value, torch.Tensor) else value


def _made_like(example, value):
    """`value` made the way the optimizer makes that number (a 0-d tensor of its dtype and device, or a number)."""
    if isinstance(example, torch.Tensor):
        return torch.tensor(value, dtype=example.dtype, device=example.device)
    return type(example)(value)


def _hyperparameters(group):
    """A param group's hyperparameters as JSON holds them (tuples as lists, 0-d tensors as numbers)."""
    out = {}
    for k, v in group.items():
        if k == "params" or k in IMPLEMENTATION:
            continue
        v = _number(v) if isinstance(v, torch.Tensor) and v.dim() == 0 else v
        if isinstance(v, tuple):
            v = list(v)
        if v is None or isinstance(v, (bool, int, float, str)) or (
                isinstance(v, list) and all(isinstance(x, (bool, int, float)) for x in v)):
            out[k] = v
    return out


@dataclass
class Piece:
    """Elements [lo, hi) of the flattened parameter `name` as this rank holds them: `weights`, a
    1-D view of their fp32 values (writing it writes the model), and their state, in
    `optimizer.state[param]` at positions `span` of `param` flattened. optimizer is None where no
    optimizer steps the parameter; group is the index of its param group."""

    name: str
    lo: int
    hi: int
    weights: torch.Tensor
    optimizer: torch.optim.Optimizer | None
    param: torch.Tensor
    group: int | None
    span: slice

    def state(self):
        """The optimizer's state for this piece's parameter ({} where it has none yet)."""
        return {} if self.optimizer is None else self.optimizer.state.get(self.param, {})

    def view(self, tensor):
        """This piece's elements of a tensor shaped like `param` (a view: filling it fills the state); of a
        DTensor (the state of a DTensor parameter), of its local tensor."""
        return local(tensor).view(-1)[self.span]


class TorchJob:
    """A torch optimizer's state on this rank, as save and load see it. Subclasses say where it
    is: `buckets(world, rank)` (what this rank writes: FlatBuckets and, per segment, its Piece),
    `pieces()` (what this rank fills on load), `groups` (the param groups whose hyperparameters
    are the job's), `group_names()`, `trained_shapes()`, `finish_load()`."""

    stage = None

    def __init__(self, model, opt, optimizer_class):
        self.model = model.module if isinstance(model, (DataParallel, FullyShard)) else model  # the user's model
        self.opt, self.optimizer_class = opt, optimizer_class
        self.names = parameter_names(self.model)
        self.templates = None  # per param group: state_template (probed inside agree: it may refuse)
        self.pairs = {}  # on load: this job's group index -> the saved param group it matches

    # ---- what the optimizer keeps ----------------------------------------------------

    def probe(self):
        if self.templates is None:
            self.templates = [state_template(self.optimizer_class, g, self._device(g)) for g in self.groups]
        return self.templates

    def _device(self, group):
        return next((p.device for p in group["params"]), torch.device("cpu"))

    @property
    def kinds(self):
        """The tensors of each bucket in the file: the weights, then every per-element key of any group."""
        keys = [k for template in self.probe() for k, v in template.items() if v is None]
        return ("weights", *dict.fromkeys(keys))

    # ---- saving ----------------------------------------------------------------------

    def gather(self, what):
        """Every parameter's numbers and every param group's names, on rank 0 (a collective): a rank
        holds the state of its own pieces only, and rank 0 writes the metadata."""
        mine = agree(what, self._local_summary)
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        numbers, groups = {}, [dict() for _ in self.groups]
        for summary in everyone:  # a parameter cut across ranks has the same numbers on each
            for name, n in summary["numbers"].items():
                if numbers.get(name) is None:
                    numbers[name] = n
            for names, theirs in zip(groups, summary["groups"]):
                names.update(dict.fromkeys(theirs))
        return {"numbers": numbers, "groups": [list(g) for g in groups]}

    def _local_summary(self):
        self.probe()
        numbers = {}
        for piece in self.pieces():
            state = piece.state()
            if not state:
                numbers.setdefault(piece.name, None)  # never stepped (or not optimized): no state
                continue
            template = self.templates[piece.group]
            if state.keys() != template.keys():
                raise ValueError(f"{piece.name}'s state has {sorted(state)}, but {class_name(self.optimizer_class)} "
                                 f"with its group's hyperparameters keeps {sorted(template)}: were they changed "
                                 "after it stepped?")
            numbers[piece.name] = {k: _number(state[k]) for k, v in template.items() if v is not None}
        return {"numbers": numbers, "groups": self.group_names()}

    def shard_tensors(self, world, rank):
        """What this rank writes, tensor after tensor: per bucket, per kind, its shard end to end
        (the pieces' own memory, no copies; zeros where there is no state, and for the padding)."""
        for bucket, pieces in self.buckets(world, rank):
            for kind in self.kinds:
                yield from _end_to_end(bucket, pieces, kind)

    def bucket_metadata(self, world, rank, summary):
        numbers = summary["numbers"]
        return [{"numel": bucket.numel, "shard_numel": bucket.shard_numel,
                 "params": [{"name": self.names[p], "shape": list(shape), "offset": offset,
                             "step": int((numbers[self.names[p]] or {}).get("step", 0)),
                             "scalars": numbers[self.names[p]]}
                            for p, shape, offset in zip(bucket.params, bucket.shapes, bucket.offsets)]}
                for bucket, _ in self.buckets(world, rank)]

    def describe(self, summary):
        return {
            "stage": self.stage,
            "optimizer": type(self.opt).__name__,
            "optimizer_class": class_name(self.optimizer_class),
            "param_groups": [{**_hyperparameters(g), "params": names, "state_keys": list(template)}
                             for g, names, template in zip(self.groups, summary["groups"], self.templates)],
            "param_dtype": None,
            "loss_scaler": loss_scaler(self.opt),
            "aliases": aliases(self.model),
            "keys": list(self.model.state_dict().keys()),
        }

    # ---- loading ---------------------------------------------------------------------

    def check(self, meta):
        """ValueError unless the checkpoint holds this optimizer class's state, with the same state
        keys in each param group; then pair this job's param groups with the saved ones."""
        check_optimizer_class(meta, class_name(self.optimizer_class))
        self.probe()
        self.pairs = self._pair_groups(meta.get("param_groups") or [])
        for gi, saved in self.pairs.items():
            theirs, mine = set(saved_state_keys(saved)), set(self.templates[gi])
            if theirs != mine:
                raise ValueError(f"param group {gi}: the checkpoint's {class_name(self.optimizer_class)} keeps "
                                 f"{sorted(theirs)} per parameter, this one {sorted(mine)}: built with other "
                                 "hyperparameters (momentum, amsgrad, centered, ...)?")
            missing = [k for k, v in self.templates[gi].items() if v is None and k not in saved_kinds(meta)]
            if missing:
                raise ValueError(f"the checkpoint has no tensors {missing} (it has {list(saved_kinds(meta))})")
        for piece in self.pieces():
            if piece.weights.dtype != torch.float32 or not piece.param.is_contiguous():
                raise ValueError(f"{piece.name} is {piece.weights.dtype}"
                                 f"{'' if piece.param.is_contiguous() else ', not contiguous'}: a checkpoint loads "
                                 "fp32, contiguous parameters in place")

    def _pair_groups(self, saved_groups):
        """{group index: saved group}, matched by the names of the parameters in them; a group with
        no trained parameter goes by its index."""
        home = {n: i for i, g in enumerate(saved_groups) for n in g["params"]}
        pairs = {}
        for gi, names in enumerate(self.group_names()):
            homes = {home[n] for n in names if n in home}
            if len(homes) > 1:
                raise ValueError(f"param group {gi} holds parameters of saved groups {sorted(homes)}: build the "
                                 "optimizer with the same param groups as the one that saved")
            if homes:
                pairs[gi] = saved_groups[homes.pop()]
            elif not names and len(saved_groups) == len(self.groups):
                pairs[gi] = saved_groups[gi]
        return pairs

    def targets(self, meta):
        """Every piece this rank fills, as Targets: its weights, and the per-element state of its
        group (allocated here where there is none yet: set_state drops it again if the checkpoint
        has none). Call it only once nothing can fail any more."""
        out = []
        for piece in self.pieces():
            views = {"weights": piece.weights}
            if piece.optimizer is not None and piece.group in self.pairs:
                state = piece.optimizer.state[piece.param]
                for key, example in self.templates[piece.group].items():
                    if example is None:
                        if key not in state:
                            state[key] = torch.zeros_like(piece.param, memory_format=torch.contiguous_format)
                        views[key] = piece.view(state[key])
            out.append(Target(piece.name, piece.lo, piece.hi, views))
        return out

    def set_state(self, meta):
        """Each parameter's numbers, made as the optimizer makes them; no state where none was saved."""
        numbers = {p["name"]: saved_numbers(p) for b in meta["buckets"] for p in b["params"]}
        for piece in self.pieces():
            if piece.optimizer is None or piece.group not in self.pairs:
                continue
            saved = numbers[piece.name]
            if saved is None:  # never stepped: as a fresh optimizer, no state at all
                piece.optimizer.state.pop(piece.param, None)
                continue
            state = piece.optimizer.state[piece.param]
            for key, example in self.templates[piece.group].items():
                if example is not None:
                    state[key] = _made_like(example, saved[key])

    def apply(self, meta):
        """The saved hyperparameters (the learning rate a scheduler had reached, ...), group by group."""
        for gi, saved in self.pairs.items():
            group = self.groups[gi]
            for k, v in saved.items():
                if k in group and k not in ("params", "state_keys") and k not in IMPLEMENTATION:
                    group[k] = tuple(v) if isinstance(v, list) else v
        restore_loss_scaler(meta, self.opt)

    def finish_load(self):
        pass


def _end_to_end(bucket, pieces, kind):
    """This rank's shard of `kind` in a bucket as tensors end to end: each segment's piece, and
    zeros where a piece has no such state and for the padding."""
    at = 0
    for s, piece in zip(bucket.segments, pieces):
        if kind == "weights":
            t = piece.weights
        else:
            t = piece.state().get(kind)
            t = None if t is None else piece.view(t)
        if t is None:
            continue
        yield from _zeros(s.shard_lo - at)
        yield t.detach().float()  # fp32 already: the same tensor
        at = s.shard_hi
    yield from _zeros(bucket.shard_numel - at)


def _zeros(n):
    for a in range(0, n, CHUNK):
        yield torch.zeros(min(CHUNK, n - a))


# ---------------------------------------------------------------------------------------
# where the state is


class _Segments(TorchJob):
    """Shards stepped through segment Parameters: a SegmentShard per bucket (ZeRO1/2)."""

    def _shards(self):
        raise NotImplementedError

    def buckets(self, world=None, rank=None):
        """The wrapper's own buckets and this rank's segments of them (its world and rank are the job's)."""
        out = []
        for sh in self._shards():
            pieces = []
            for s, param in zip(sh.bucket.segments, sh.params):
                optimizer, group = self._holder(sh, param)
                pieces.append(Piece(self.names[sh.bucket.params[s.index]], s.param_lo, s.param_hi, param.detach(),
                                    optimizer, param, group, slice(None)))
            out.append((sh.bucket, pieces))
        return out

    def pieces(self):
        return [piece for _, pieces in self.buckets() for piece in pieces]

    def trained_shapes(self):
        return {self.names[p]: shape for sh in self._shards() for p, shape in zip(sh.bucket.params, sh.bucket.shapes)}


class ZeROJob(_Segments):
    """zerokit.ZeRO1/ZeRO2(params, X): a local X per bucket; the wrapper's param groups are the user's."""

    def __init__(self, model, opt):
        super().__init__(model, opt, opt.optimizer_class)
        self.stage = stage_of(opt).name  # ZeRO1 is a ZeRO1Adam underneath, ZeRO2 a ZeRO2Adam
        self.groups = opt.param_groups
        self.shards = None

    def _shards(self):
        if self.shards is None:
            self.shards = self.opt.state_shards()
        return self.shards

    def _holder(self, shard, param):
        return shard.optimizer, shard.group

    def group_names(self):
        return [[self.names[p] for p in g["params"] if p.requires_grad] for g in self.groups]

    def describe(self, summary):
        precision = self.opt.precision
        dtype = str(precision.param_dtype).removeprefix("torch.") if precision.param_dtype else None
        return {**super().describe(summary), "param_dtype": dtype}

    def finish_load(self):
        self.opt.loaded()  # a collective: round the masters, all-gather the weights


class DTensorJob(TorchJob):
    """zerokit.FullyShard(model), or a model zerokit.fully_shard (or torch's fully_shard) sharded, + any torch
    optimizer X built on its parameters: each a DTensor of this rank's dim-0 rows (the fp32 shard the
    optimizer steps), its state DTensors of the same rows. Each trained parameter is a bucket of its own
    (RowBucket): its rows are one contiguous range of it flattened, rank r's shard of ceil(R / N) rows. What
    is not trained (frozen parameters) is saved whole, gathered (zerokit.checkpoint.save)."""

    stage = "fully_shard"

    def __init__(self, model, opt):
        self.wrapper = model if isinstance(model, FullyShard) else None
        self.reshard(model.module if self.wrapper else model)  # before the names: the model shows its DTensors
        super().__init__(model, opt, type(opt))
        self.groups = opt.param_groups
        self.group_of = {p: gi for gi, g in enumerate(self.groups) for p in g["params"]}
        stray = [p for p in self.group_of if p not in self.names]
        if stray:
            raise TypeError(f"{type(opt).__name__} steps {len(stray)} tensors that are not the sharded model's "
                            "parameters: build it on model.parameters()")
        for p in self._trained():
            if not is_dtensor(p):
                raise TypeError(f"{self.names[p]} is a plain tensor in a model sharded by fully_shard (ignored_params?):"
                                " zerokit.checkpoint saves a sharded model whose trained parameters are all DTensors")
            try:
                check_row_sharded(self.names[p], p)
            except ValueError as exc:
                raise TypeError(str(exc)) from None

    def _trained(self):
        """The trained parameters, param group after param group (the same order on every rank)."""
        return [p for g in self.groups for p in g["params"] if p.requires_grad]

    def buckets(self, world=None, rank=None):
        """One RowBucket per trained parameter, with its one piece here (none where this rank holds no row)."""
        out = []
        for p in self._trained():
            bucket = RowBucket(p)
            rows = local(p).detach().view(-1)  # this rank's rows, the optimizer's: loading writes them
            out.append((bucket, [Piece(self.names[p], s.param_lo, s.param_hi, rows, self.opt, p, self.group_of[p],
                                       slice(None)) for s in bucket.segments]))
        return out

    def pieces(self):
        return [piece for _, pieces in self.buckets() for piece in pieces]

    def group_names(self):
        return [[self.names[p] for p in g["params"] if p.requires_grad] for g in self.groups]

    def trained_shapes(self):
        return {self.names[p]: p.shape for p in self._trained()}

    def describe(self, summary):
        dtype = None if self.wrapper is None else self.wrapper.compute_dtype
        return {**super().describe(summary), "param_dtype": None if dtype is None else str(dtype).removeprefix("torch.")}

    @staticmethod
    def reshard(model):
        """Free every group still gathered (the root keeps its parameters after a forward under no_grad): the
        modules show the sharded DTensors again, the parameters the optimizer steps (FSDP2's state_dict() does
        the same), and the next forward gathers what a load wrote into them."""
        for m in fsdp_modules(model):
            m.reshard()

    def finish_load(self):
        self.reshard(self.model)


class ReplicatedJob(TorchJob):
    """zerokit.DataParallel(model) + X, or a plain model in one process: every parameter whole on
    every rank. Each rank writes the 1/N ZeRO-1 would own of each param group's flat buffer
    (lesson 02's DistributedAdam does the same); on load every rank reads all of it."""

    stage = "data_parallel"

    def __init__(self, model, opt):
        super().__init__(model, opt, type(opt))
        self.groups = opt.param_groups
        stray = [p for g in self.groups for p in g["params"] if p not in self.names]
        if stray:
            raise TypeError(f"{type(opt).__name__} steps {len(stray)} tensors that are not the model's parameters")
        wrong = sorted({str(p.dtype) for g in self.groups for p in g["params"] if p.dtype != torch.float32})
        if wrong:
            raise TypeError(f"zerokit.checkpoint saves a replicated model's fp32 parameters; this one has {wrong}")

    def _trainable(self):
        return [[p for p in g["params"] if p.requires_grad] for g in self.groups]

    def buckets(self, world, rank):
        out = []
        for gi, params in enumerate(self._trainable()):
            if not params:
                continue
            bucket = FlatBucket(params, world, rank, align_bytes=None)  # ZeRO1's layout (aligned)
            pieces = []
            for s in bucket.segments:
                p = bucket.params[s.index]
                pieces.append(Piece(self.names[p], s.param_lo, s.param_hi, p.detach().reshape(-1)[s.param_lo:s.param_hi],
                                    self.opt, p, gi, slice(s.param_lo, s.param_hi)))
            out.append((bucket, pieces))
        return out

    def pieces(self):
        return [piece for _, pieces in self.buckets(1, 0) for piece in pieces]  # every parameter, whole

    def group_names(self):
        return [[self.names[p] for p in params] for params in self._trainable()]

    def trained_shapes(self):
        return {self.names[p]: p.shape for params in self._trainable() for p in params}


class MuonJob(ReplicatedJob):
    """zerokit.ZeRO1Muon: every matrix whole on every rank, its momentum on its owner only.

    The file is torch.optim.Muon's state in the replicated layout (rank r writes the 1/N of each
    flat buffer ZeRO-1 would own), not ZeRO1Muon's by owner: owners follow from the world size
    (assign_owners), so a layout by owner could not be read at another N without redoing the
    assignment, and this one loads into DataParallel + torch.optim.Muon as well. Saving costs a
    broadcast of every matrix's momentum from its owner (Ψ elements per rank, one matrix at a time;
    each rank keeps only the elements it writes: Ψ/N). On load each rank reads the weights of
    every matrix and the momentum of the matrices it owns now."""

    stage = "zero1_muon"

    def __init__(self, model, opt):
        group_size = dist.get_world_size(opt.group) if dist.is_initialized() else 1
        world = dist.get_world_size() if dist.is_initialized() else 1
        if group_size != world:
            raise TypeError(f"zerokit.checkpoint saves a ZeRO1Muon whose group is every rank ({world}), not a "
                            f"subgroup of {group_size}")
        super().__init__(model, opt)
        self.optimizer_class = torch.optim.Muon  # the same state and arithmetic (muon_update_)

    def pieces(self):
        """Every matrix whole; only those this rank owns have an optimizer (state to fill on load)."""
        owned = set(self.opt.owned())
        return [p if p.param in owned else replace(p, optimizer=None) for p in super().pieces()]

    def shard_tensors(self, world, rank):
        buckets = self.buckets(world, rank)
        held = self._momentum_of(buckets)  # a collective, before any bytes are written
        for bucket, pieces in buckets:
            pieces = [replace(p, optimizer=held, span=slice(None)) for p in pieces]
            for kind in self.kinds:
                yield from _end_to_end(bucket, pieces, kind)

    @torch.no_grad()
    def _momentum_of(self, buckets):
        """A stand-in optimizer whose state holds, for each piece this rank writes, the momentum of
        exactly those elements: each matrix's owner broadcasts its buffer (zeros if it has none yet:
        the metadata says so, and loading then leaves no state), every rank keeps its piece."""
        mine = {p.param: p for _, pieces in buckets for p in pieces}
        state = {}
        for param, owner in zip(self.opt.params, self.opt.owners):
            if not param.requires_grad:
                continue
            buffer = self.opt.state.get(param, {}).get("momentum_buffer")
            if owner != self.opt.rank or buffer is None:
                buffer = torch.zeros_like(param)
            if self.opt.world_size > 1:
                source = owner if self.opt.group is None else dist.get_global_rank(self.opt.group, owner)
                dist.broadcast(buffer, src=source, group=self.opt.group)
            piece = mine.get(param)
            if piece is not None:
                state[param] = {"momentum_buffer": buffer.reshape(-1)[piece.span].clone()}
        return SimpleNamespace(state=state)


def job_of(model, opt):
    """What save and load work with: the lessons' Adam (state.AdamJob) or a torch optimizer's
    state (a TorchJob, by who holds it). A TypeError for what neither can save."""
    return _job_by_optimizer(opt, model)


@functools.singledispatch
def _job_by_optimizer(opt, model):
    """A torch optimizer of no class registered below: the model's wrapper says who holds what."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"zerokit.checkpoint saves a model with a torch optimizer (zerokit's included), not with "
                        f"{type(opt).__name__}")
    if isinstance(model, FullyShard) or fsdp_modules(model):
        return DTensorJob(model, opt)  # zerokit.fully_shard's (or torch's) parameters: DTensors of dim-0 rows
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(model, DataParallel) or world == 1:
        return ReplicatedJob(model, opt)
    raise TypeError(f"zerokit.checkpoint cannot tell which of {world} ranks holds what of a plain model with "
                    f"{type(opt).__name__}: wrap the model in zerokit.DataParallel or zerokit.FullyShard (or shard it "
                    "with zerokit.fully_shard), or shard the optimizer with zerokit.ZeRO1/ZeRO2")


# The optimizers that say themselves who holds what. singledispatch picks an optimizer's nearest
# class in its MRO: ZeRO1/ZeRO2 (a torch optimizer per bucket) before the ZeRO1Adam/ZeRO2Adam they
# derive from, and ZeRO2Adam/ZeRO3Adam through ZeRO1Adam, the lessons' Adam saved as lesson 07 saves it.
for _cls, _job in ((ZeRO1, ZeROJob), (ZeRO2, ZeROJob), (ZeRO1Muon, MuonJob),
                   (DistributedAdam, AdamJob), (ZeRO1Adam, AdamJob)):
    _job_by_optimizer.register(_cls, lambda opt, model, job=_job: job(model, opt))
