"""What a checkpoint reads from an optimizer, and writes back into it: one view of every stage.

ZeRO-1/2/3 hand their state over through their contract (zerokit.zero1): `opt.state_shards()`,
one StateShard per bucket, whose tensors are the optimizer's own shards, and `opt.loaded()`
once they have been overwritten. DistributedAdam holds everything on every rank (lesson 02):
to save, each rank takes the 1/N that a ZeRO-1 rank would own (a FlatBucket over its
parameters; the copies made one at a time, as they are written); to load, every rank reads
all of it.

Besides the shards a checkpoint needs what makes a run resumable and a model whole:
`describe()` (the stage, each param group's hyperparameters, the loss scaler, tied names)
and `replicated()` (what every rank holds whole: frozen parameters and buffers).

`AdamJob` bundles all of this behind the interface zerokit.checkpoint.save and load call;
zerokit.checkpoint.optimizers has the same interface for any torch optimizer's state. What
the metadata says about the optimizer (its class, its state keys, each parameter's numbers)
is read through `saved_class`, `saved_state_keys` and `saved_numbers`, which also read the
checkpoints written before the format named anything but Adam (version 1: Adam, implied).
"""

from dataclasses import dataclass

import torch

from ..flat import FlatBucket
from ..stages import stage_of
from ..zero1 import StateShard
from .files import REPLICATED
from .rows import is_dtensor, local, local_rows

__all__ = ["TENSORS", "HYPER", "ADAMW", "parameter_names", "saved_shards", "Target", "targets",
           "set_steps", "finish_load", "trained_shapes", "check_same_model", "load_replicated", "describe",
           "apply_description", "group_hyperparameters", "aliases", "replicated", "AdamJob", "saved_class",
           "saved_kinds", "saved_state_keys", "saved_numbers", "check_optimizer_class", "loss_scaler",
           "restore_loss_scaler"]

TENSORS = ("weights", "exp_avg", "exp_avg_sq")  # per bucket, in this order, in every rank file
HYPER = ("lr", "betas", "eps", "weight_decay")
# The update rule of the lessons' optimizers: zerokit's Adam is torch's AdamW, bit for bit
# (lesson 01), so their checkpoints and torch.optim.AdamW's hold the same state.
ADAMW = "torch.optim.AdamW"
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


def parameter_names(model):
    """{parameter: its name}; a tied parameter gets its first name, as model.named_parameters() gives it."""
    return {p: n for n, p in model.named_parameters()}


def _trainable(opt):
    """DistributedAdam's trainable parameters per param group (frozen ones are the model's)."""
    return [[p for p in g["params"] if p.requires_grad] for g in opt.param_groups]


def _weights(opt, p, index):
    """DistributedAdam's fp32 weights of p: its master under mixed precision, else p itself."""
    return p.data if opt.masters is None else opt.masters[index]


def _flat_index(opt):
    return {p: i for i, p in enumerate(opt.all_params())}  # DistributedAdam.masters is aligned with them


# ---------------------------------------------------------------------------------------
# saving


class _ReplicaShard:
    """The StateShard of a DistributedAdam param group on this rank: the 1/N of it that ZeRO-1
    would own. Its tensors are copies, made when read, so a writer holds one at a time."""

    def __init__(self, opt, group, params, world_size, rank):
        # the layout ZeRO-1 builds (aligned, zerokit.flat), so that either loads the other's shards whole
        self.bucket, self.group = FlatBucket(params, world_size, rank, align_bytes=None), group
        index = _flat_index(opt)
        self._weights = [_weights(opt, p, index[p]) for p in params]
        self._state = [opt.state.get(p, {}) for p in params]
        self.steps = [int(s.get("step", 0)) for s in self._state]

    @property
    def weights(self):
        return self.bucket.shard_of(self._weights, dtype=torch.float32)

    @property
    def exp_avg(self):
        return self.bucket.shard_of([s.get("exp_avg") for s in self._state], dtype=torch.float32)

    @property
    def exp_avg_sq(self):
        return self.bucket.shard_of([s.get("exp_avg_sq") for s in self._state], dtype=torch.float32)


def saved_shards(opt, world_size, rank):
    """What this rank writes: opt.state_shards() (ZeRO), or its 1/N of DistributedAdam's state."""
    if stage_of(opt).shards_optimizer_state:
        return opt.state_shards()
    return [_ReplicaShard(opt, g, ps, world_size, rank) for g, ps in enumerate(_trainable(opt)) if ps]


# ---------------------------------------------------------------------------------------
# loading


@dataclass
class Target:
    """Elements [lo, hi) of the flattened parameter `name` that this rank must fill, and where:
    `views[kind]` is a 1-D tensor of hi - lo elements for each kind to read (TENSORS for Adam).
    `shard` is the whole StateShard the piece lies in (ZeRO), for whole-shard reads."""

    name: str
    lo: int
    hi: int
    views: dict
    shard: StateShard | None = None


def targets(model, opt):
    """Every piece of state this rank holds, as Targets. Allocates DistributedAdam's m and v
    where it has none yet (call it only once nothing can fail any more)."""
    names = parameter_names(model)
    out = []
    if stage_of(opt).shards_optimizer_state:
        for sh in opt.state_shards():
            for s in sh.bucket.segments:
                views = {k: getattr(sh, k)[s.shard_lo:s.shard_hi] for k in TENSORS}
                out.append(Target(names[sh.bucket.params[s.index]], s.param_lo, s.param_hi, views, sh))
        return out
    index = _flat_index(opt)
    for params in _trainable(opt):
        for p in params:
            weights = _weights(opt, p, index[p])
            if not weights.is_contiguous():
                raise ValueError(f"parameter {names[p]} is not contiguous: it cannot be loaded in place")
            state = opt.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                if k not in state:  # never stepped: set_steps removes it again if the checkpoint agrees
                    state[k] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            views = {"weights": weights.view(-1), "exp_avg": state["exp_avg"].view(-1),
                     "exp_avg_sq": state["exp_avg_sq"].view(-1)}
            out.append(Target(names[p], 0, p.numel(), views))
    return out


def set_steps(model, opt, steps):
    """Adam's step count of every parameter, from {name: step}."""
    names = parameter_names(model)
    if stage_of(opt).shards_optimizer_state:
        for sh in opt.state_shards():
            sh.steps[:] = [steps[names[p]] for p in sh.bucket.params]
        return
    for params in _trainable(opt):
        for p in params:
            if steps[names[p]] == 0:
                opt.state.pop(p, None)  # never stepped: no state, as torch.optim.AdamW has none
            else:
                opt.state[p]["step"] = steps[names[p]]


@torch.no_grad()
def finish_load(opt):
    """Make the model every rank computes with the loaded one (a collective for ZeRO)."""
    if stage_of(opt).shards_optimizer_state:
        for sh in opt.state_shards():
            for p in sh.bucket.params:
                p.__dict__.pop("zerokit_placeholder", None)  # a placeholder (checkpoint.stream) has its values now
        opt.loaded()
        return
    if opt.masters is not None:  # mixed precision: round the loaded fp32 masters into the 16-bit parameters
        for p, master in zip(opt.all_params(), opt.masters):
            if master is not None:
                p.data.copy_(master)


# ---------------------------------------------------------------------------------------
# what a whole job needs besides the shards


def aliases(model):
    """{second name: first name} of every tensor the model's state_dict holds twice (tied weights)."""
    first, out = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def replicated(model, saved_names):
    """[(name, tensor)]: the model's state_dict entries that are not saved in shards (frozen
    parameters, buffers, parameters the optimizer does not hold), each once."""
    tied = aliases(model)
    return [(n, t) for n, t in model.state_dict(keep_vars=True).items() if n not in saved_names and n not in tied]


def describe(model, opt):
    """The metadata a resumable job needs besides the buckets (rank 0 writes it)."""
    names = parameter_names(model)
    precision = getattr(opt, "precision", None)
    groups = [{**{k: g[k] for k in HYPER}, "params": [names[p] for p in g["params"] if p.requires_grad]}
              for g in opt.param_groups]
    return {
        "stage": stage_of(opt).name,
        "optimizer": type(opt).__name__,
        "param_groups": [{**g, "betas": list(g["betas"])} for g in groups],
        "param_dtype": str(precision.param_dtype).removeprefix("torch.") if precision.param_dtype else None,
        "loss_scaler": loss_scaler(opt),
        "aliases": aliases(model),
        "keys": list(model.state_dict().keys()),
    }


def loss_scaler(opt):
    """The fp16 loss scaler's state (lesson 06), or None where there is none."""
    scaler = getattr(getattr(opt, "precision", None), "scaler", None)
    if scaler is None:
        return None
    return {"scale": scaler.scale, "clean_steps": scaler.clean_steps, "skipped_steps": scaler.skipped_steps}


def restore_loss_scaler(meta, opt):
    scaler = getattr(getattr(opt, "precision", None), "scaler", None)
    if scaler is not None and meta.get("loss_scaler"):
        s = meta["loss_scaler"]
        scaler.scale, scaler.clean_steps, scaler.skipped_steps = float(s["scale"]), s["clean_steps"], s["skipped_steps"]


def group_hyperparameters(model, opt, saved_groups):
    """[(param group, saved hyperparameters)] matched by the parameters' names; ValueError if a
    group of opt mixes parameters of two saved groups."""
    names = parameter_names(model)
    home = {n: i for i, g in enumerate(saved_groups) for n in g["params"]}
    out = []
    for gi, g in enumerate(opt.param_groups):
        homes = {home[names[p]] for p in g["params"] if p.requires_grad and names[p] in home}
        if len(homes) > 1:
            raise ValueError(f"param group {gi} holds parameters of saved groups {sorted(homes)}: build the "
                             "optimizer with the same param groups as the one that saved")
        if homes:
            out.append((g, saved_groups[homes.pop()]))
    return out


def apply_description(meta, model, opt):
    """Hyperparameters per param group and the loss scaler, as saved (what the metadata has of them)."""
    for g, saved in group_hyperparameters(model, opt, meta.get("param_groups") or []):
        g.update({k: tuple(saved[k]) if k == "betas" else saved[k] for k in HYPER})
    restore_loss_scaler(meta, opt)


# ---------------------------------------------------------------------------------------
# does a checkpoint fit this model and optimizer


def trained_shapes(model, opt):
    """{name: shape} of what opt trains (ZeRO-3's parameters are empty at rest: their buckets know)."""
    names = parameter_names(model)
    if not stage_of(opt).shards_optimizer_state:
        return {names[p]: p.shape for g in opt.param_groups for p in g["params"] if p.requires_grad}
    return {names[p]: shape for sh in opt.state_shards() for p, shape in zip(sh.bucket.params, sh.bucket.shapes)}


def check_same_model(meta, model, want):
    """ValueError naming the first difference between a checkpoint's metadata and this model, whose
    optimizer trains the parameters `want` ({name: shape})."""
    saved = {p["name"]: p["shape"] for b in meta["buckets"] for p in b["params"]}
    if saved.keys() != want.keys():
        extra, missing = sorted(saved.keys() - want.keys()), sorted(want.keys() - saved.keys())
        raise ValueError(f"another model? trained parameters only in the checkpoint: {extra[:4]}; only here: {missing[:4]}")
    for name, shape in want.items():
        if list(shape) != saved[name]:
            raise ValueError(f"another model? {name} has shape {list(shape)} here and {saved[name]} in the checkpoint")
    mine = {n: list(t.shape) for n, t in replicated(model, want.keys())}
    theirs = {e["name"]: e["shape"] for e in meta.get("replicated", [])}
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    if differ:
        raise ValueError(f"another model? frozen parameters or buffers differ: {differ[:4]} "
                         f"(here {[mine.get(k) for k in differ[:4]]}, saved {[theirs.get(k) for k in differ[:4]]})")


def load_replicated(meta, model, reader):
    """Frozen parameters and buffers, whole on every rank (placeholders get their storage here); a
    sharded model's frozen DTensors, this rank's rows of them."""
    state = model.state_dict(keep_vars=True)
    for e in meta.get("replicated", []):
        t = state[e["name"]]
        saved = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
        reader.read(REPLICATED, e["offset"], saved)
        if getattr(t, "zerokit_placeholder", False):
            t.data = saved.to(t.dtype)
            del t.zerokit_placeholder
        elif is_dtensor(t):
            local(t).copy_(local_rows(t, saved))
        else:
            t.data.copy_(saved)


# ---------------------------------------------------------------------------------------
# what the metadata says of the optimizer (version 1 named only Adam's, by implication)


def saved_class(meta):
    """The optimizer class whose state the checkpoint holds, e.g. "torch.optim.SGD"."""
    return meta.get("optimizer_class", ADAMW)


def saved_kinds(meta):
    """The tensors of every bucket, in file order: "weights", then the optimizer's per-element ones."""
    return tuple(meta.get("tensors", TENSORS))


def saved_state_keys(group):
    """The state keys the optimizer keeps per parameter in a saved param group (per element or not)."""
    return tuple(group.get("state_keys", ADAM_STATE_KEYS))


def saved_numbers(entry):
    """A saved parameter's per-parameter numbers ({"step": 3.0, ...}), or None: it has no state yet
    (never stepped). Version 1 has only Adam's step count, where 0 means no state."""
    if "scalars" in entry:
        return entry["scalars"]
    return None if entry["step"] == 0 else {"step": entry["step"]}


def check_optimizer_class(meta, mine):
    """ValueError unless the checkpoint holds the state of the optimizer class `mine`."""
    saved = saved_class(meta)
    if saved != mine:
        per_element = ", ".join(saved_kinds(meta)[1:]) or "nothing"
        raise ValueError(f"the checkpoint holds the state of {saved} ({per_element} per element); this optimizer "
                         f"is {mine}: one optimizer's state means nothing to another. Load it with {saved}, or start "
                         f"{mine} afresh from the saved weights (zerokit.checkpoint.consolidate)")


class AdamJob:
    """The lessons' optimizers (DistributedAdam, ZeRO1/2/3Adam) as zerokit.checkpoint.save and
    load see them: the functions above, behind the interface any torch optimizer's state has
    too (zerokit.checkpoint.optimizers)."""

    optimizer_class = ADAMW

    def __init__(self, model, opt):
        self.record = stage_of(opt)  # a clear TypeError for an optimizer this cannot save
        self.stage = self.record.name
        self.model, self.opt = model, opt

    def state_shards(self):
        """The whole-shard view that lesson 07's resharding map reads into (none for DistributedAdam)."""
        return self.opt.state_shards() if self.record.shards_optimizer_state else []

    def gather(self, what):
        return None  # nothing to gather: every rank knows the step count of every parameter of its buckets

    def trained_shapes(self):
        return trained_shapes(self.model, self.opt)

    def check(self, meta):
        """ValueError unless the checkpoint holds AdamW's state, in param groups that fit this optimizer's."""
        check_optimizer_class(meta, ADAMW)
        for g in meta.get("param_groups") or []:
            if set(saved_state_keys(g)) != set(ADAM_STATE_KEYS):  # e.g. torch's AdamW(amsgrad=True)
                raise ValueError(f"the checkpoint's AdamW keeps {sorted(saved_state_keys(g))} per parameter, "
                                 f"zerokit's Adam {sorted(ADAM_STATE_KEYS)}: saved with amsgrad=True?")
        group_hyperparameters(self.model, self.opt, meta.get("param_groups") or [])  # raises if the groups differ

    def targets(self, meta):
        return targets(self.model, self.opt)

    def set_state(self, meta):
        set_steps(self.model, self.opt, {p["name"]: p["step"] for b in meta["buckets"] for p in b["params"]})

    def describe(self, summary):
        return describe(self.model, self.opt)

    def apply(self, meta):
        apply_description(meta, self.model, self.opt)

    def finish_load(self):
        finish_load(self.opt)
