"""zerokit checkpoints to and from PyTorch Distributed Checkpoint (DCP), for FSDP2 with torch's AdamW.

FSDP2 here is torch's `fully_shard` or zerokit's (lesson 12): both make each parameter a DTensor of
dim-0 rows, so PyTorch's recipe below (`get_state_dict`, `dcp.load`, `set_state_dict`) runs on
either unchanged, and a DCP checkpoint one of them saved loads into the other.

    zerokit.checkpoint.dcp.to_dcp("ckpt/step100", "dcp/step100")           # one process, no ranks
    # ... then on the FSDP2 ranks, PyTorch's own recipe loads it:
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id="dcp/step100")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    # the other way: FSDP2 saved dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=...)
    zerokit.checkpoint.dcp.from_dcp("dcp/step200", "ckpt/step200", model)  # one process; any instance of the model
    zerokit.checkpoint.load("ckpt/step200", model, opt)                     # any N, any stage

**Why a converter, not DCP itself.** DCP stores each tensor under its own name, cut into
chunks that are boxes of that one tensor (an offset and a size per dimension), and reshards
by intersecting boxes. A ZeRO shard is another kind of object: one flat buffer that holds
pieces of several parameters end to end, plus padding, cut at an element offset that falls
anywhere. DCP cannot name it (it spans tensors, and the padding belongs to none), and a piece
of a 2-D parameter that starts mid-row is not one box but up to three. Nor does torch's
optimizer state know zerokit's loss scaler. So the converter goes by names and true offsets:
each parameter whole, one at a time, in the layout `get_state_dict` gives an FSDP2 model
with torch.optim.AdamW (`model.<name>`, `optim.state.<name>.{exp_avg, exp_avg_sq, step}`,
`optim.param_groups.<i>.<key>`), and DCP reshards those whole tensors to any FSDP2 layout.
Memory: one parameter at a time, both ways (DCP asks for each tensor as it writes it).
Lost on the way to DCP: the loss scaler (torch's GradScaler keeps its own state).
"""

import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from . import FORMAT, VERSION, read_metadata, read_parameter, read_replicated
from .files import METADATA, REPLICATED, Reader, commit, partial_dir, rank_file, write_json, write_tensors
from .state import ADAMW, TENSORS, aliases, saved_class, saved_kinds

__all__ = ["to_dcp", "from_dcp"]

_ADAM_STATE = ("exp_avg", "exp_avg_sq")


class _ReadWhenAsked(DefaultSavePlanner):
    """DCP's default planner, except that a meta tensor in the state_dict stands for a tensor
    of the zerokit checkpoint, read only when DCP writes it: one parameter in memory at a time."""

    def __init__(self, read):
        super().__init__()
        self._read = read  # fqn -> the tensor

    def resolve_data(self, write_item):
        obj = self.lookup_object(write_item.index)
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            return self._read(write_item.index.fqn)
        return super().resolve_data(write_item)


def to_dcp(src, dst):
    """Write the zerokit checkpoint `src` as a DCP checkpoint at `dst` that an FSDP2 model with
    torch.optim.AdamW loads with dcp.load (any number of ranks). One process, no process group."""
    meta = read_metadata(src)
    if saved_class(meta) != ADAMW or saved_kinds(meta) != TENSORS:
        raise ValueError(f"{src} holds the state of {saved_class(meta)} ({list(saved_kinds(meta))}); to_dcp writes "
                         "torch.optim.AdamW's layout (exp_avg, exp_avg_sq, step)")
    steps = {p["name"]: p["step"] for b in meta["buckets"] for p in b["params"]}
    shapes = {p["name"]: p["shape"] for b in meta["buckets"] for p in b["params"]}
    replicated = {e["name"]: e for e in meta.get("replicated", [])}
    canonical = {**{n: n for n in shapes}, **{n: n for n in replicated}, **meta.get("aliases", {})}
    model = {}
    for name in meta.get("keys") or canonical:
        first = canonical[name]
        if first in shapes:
            model[name] = torch.empty(shapes[first], device="meta")  # fp32, as FSDP2's sharded parameters are
        else:
            dtype = getattr(torch, replicated[first]["dtype"])
            model[name] = torch.empty(replicated[first]["shape"], device="meta",
                                      dtype=torch.float32 if dtype.is_floating_point else dtype)
    state = {n: {**{k: torch.empty(shapes[n], device="meta") for k in _ADAM_STATE},
                 "step": torch.tensor(float(steps[n]))} for n in shapes}
    adamw = torch.optim.AdamW([torch.zeros(1)]).defaults  # every key torch's AdamW keeps in a param group
    groups = [{**adamw, **{k: g[k] for k in ("lr", "eps", "weight_decay")}, "betas": tuple(g["betas"]),
               "params": list(g["params"])} for g in meta["param_groups"]]

    with Reader(src) as reader:
        def read(fqn):
            kind, name = _split(fqn)
            name = canonical.get(name, name)
            if kind == "weights" and name in replicated:
                return read_replicated(reader, replicated[name])
            return read_parameter(reader, meta, name, kind)

        _quiet(dcp.save, {"model": model, "optim": {"state": state, "param_groups": groups}},
               storage_writer=FileSystemWriter(dst), planner=_ReadWhenAsked(read), no_dist=True)


def _split(fqn):
    """'model.a.b' -> ('weights', 'a.b'); 'optim.state.a.b.exp_avg' -> ('exp_avg', 'a.b')."""
    if fqn.startswith("model."):
        return "weights", fqn[len("model."):]
    name, kind = fqn[len("optim.state."):].rsplit(".", 1)
    return kind, name


def from_dcp(src, dst, model):
    """Write the DCP checkpoint `src` (an FSDP2 model's and torch AdamW's state, saved as
    {"model": ..., "optim": ...}) as a zerokit checkpoint at `dst`, for zerokit.checkpoint.load on
    any number of ranks and any stage. `model`: an instance of the same model (its names, tied
    weights and buffers; a meta-device instance costs nothing; a sharded one serves too: its DTensors
    have the full shapes). One process, one tensor at a time."""
    keys = _quiet(lambda: FileSystemReader(src).read_metadata()).state_dict_metadata
    groups = _param_groups(src, keys)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    buckets = []
    for g in groups:
        offset, params = 0, []
        for name in g["params"]:
            step = _load_one(src, f"optim.state.{name}.step", torch.zeros(())) if f"optim.state.{name}.step" in keys else 0
            params.append({"name": name, "shape": list(trained[name].shape), "offset": offset, "step": int(step)})
            offset += trained[name].numel()
        buckets.append({"numel": offset, "shard_numel": offset, "params": params})  # world size 1: one shard
    saved = {n for g in groups for n in g["params"]}
    tied = aliases(model)
    rest = [(n, t) for n, t in model.state_dict(keep_vars=True).items() if n not in saved and n not in tied]

    def tensors():  # in the order of the format: per bucket, TENSORS, each parameter in turn
        for b in buckets:
            for kind in TENSORS:
                for p in b["params"]:
                    key = f"model.{p['name']}" if kind == "weights" else f"optim.state.{p['name']}.{kind}"
                    empty = torch.zeros(p["shape"])
                    yield _load_one(src, key, empty) if key in keys else empty  # no state: never stepped

    partial = partial_dir(dst)
    partial.mkdir(parents=True, exist_ok=True)
    write_tensors(Path(partial) / rank_file(0), tensors())
    entries, offset = [], 0
    for name, t in rest:
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset})
        offset += t.numel() * t.element_size()
    write_tensors(Path(partial) / REPLICATED,
                  (_load_one(src, f"model.{n}", torch.empty(t.shape, dtype=t.dtype)) for n, t in rest))
    write_json(Path(partial) / METADATA, {
        "format": FORMAT, "version": VERSION, "world_size": 1, "tensors": list(TENSORS), "buckets": buckets,
        "replicated": entries, "stage": "dcp", "optimizer": "torch.optim.AdamW", "param_dtype": None,
        "loss_scaler": None, "aliases": tied, "keys": list(model.state_dict().keys()),
        "param_groups": [{k: list(g[k]) if k == "betas" else g[k] for k in ("lr", "betas", "eps", "weight_decay",
                                                                             "params")} for g in groups]})
    commit(partial, dst)


def _param_groups(src, keys):
    """The param groups DCP holds as optim.param_groups.<i>.<key> entries, each a dict."""
    found = {}
    for k in keys:
        m = re.fullmatch(r"optim\.param_groups\.(\d+)\.(\w+)", k)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = None
    groups = [found[i] for i in sorted(found)]
    state = {"optim": {"param_groups": groups}}
    _quiet(dcp.load, state, storage_reader=FileSystemReader(src), planner=DefaultLoadPlanner(allow_partial_load=True),
           no_dist=True)
    return state["optim"]["param_groups"]


def _load_one(src, key, into):
    """The tensor `key` of the DCP checkpoint, read into `into` (and returned)."""
    if key.startswith("model."):
        nested = {"model": {key[len("model."):]: into}}
    else:  # optim.state.<name>.<kind>
        name, kind = key[len("optim.state."):].rsplit(".", 1)
        nested = {"optim": {"state": {name: {kind: into}}}}
    _quiet(dcp.load, nested, storage_reader=FileSystemReader(src), planner=DefaultLoadPlanner(allow_partial_load=True),
           no_dist=True)
    return into


def _quiet(fn, *args, **kwargs):
    """DCP warns (on stderr) that it runs without a process group, which is what we ask of it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)
