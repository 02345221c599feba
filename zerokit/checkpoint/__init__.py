r"""Sharded checkpoints (lesson 07): save, load on any world size and stage, consolidate, stream-load.

    zerokit.checkpoint.save("ckpt/step100", model, opt)      # every rank: each writes what it owns
    zerokit.checkpoint.load("ckpt/step100", model, opt)      # every rank: any N, any stage, exact
    state = zerokit.checkpoint.consolidate("ckpt/step100")   # one process: a full fp32 state_dict

**Why not torch.save(model.state_dict()) on rank 0.** Under ZeRO-3 rank 0's parameters are
empty between steps; under ZeRO-1/2 its optimizer holds m and v of one shard: 1/N of them.
A ZeRO job's state exists only as the union of every rank's shards, so every rank saves.

This file is the lesson's reference (save, load, consolidate, and the exercises' save_shards,
shard_reads, covering); its parts sit beside it: files.py (bytes written and read without
copies, atomically, a COMPLETE marker, one error on every rank), state.py (one view of every
stage's shards, for saving and loading), optimizers.py (beyond the lesson: any elementwise
torch optimizer's state, under zerokit.ZeRO1/ZeRO2, DataParallel, FullyShard or fully_shard),
rows.py (fully_shard's per-parameter dim-0 shards in this format), stream.py (build a ZeRO-3
model from a checkpoint unit by unit), dcp.py (to and from PyTorch Distributed Checkpoint, for
FSDP2, torch's or zerokit's).

**The format.** A checkpoint is a directory (zerokit.checkpoint.files writes it atomically):

    metadata.json    rank 0: format, version, world size N, and every bucket: its numel, its
                     shard size S (ceil(numel / N) in the lesson; zerokit rounds it up to its
                     alignment, zerokit.flat), and each parameter's name, shape, offset in the
                     bucket's flat buffer and Adam step count (+ hyperparameters, loss scaler)
    rank00000.bin    rank r only: for each bucket, its shard of the fp32 weights, of m and of v,
    rank00001.bin    S elements each, raw bytes (TENSORS): 12 S bytes per bucket
    replicated.bin   rank 0: frozen parameters and buffers, whole
    COMPLETE         written last

In fp32 a rank writes $(K + P)\Psi/N$ bytes, $K = 8$ (m, v) and $P = 4$ (weights), plus the
padding: at most $N - 1$ elements per bucket in the lesson's layout; zerokit's buffers also
align each parameter and each shard (zerokit.flat: less than `align` elements per parameter and
per shard). Mixed precision saves the same 12 bytes: the fp32 master is the weights, and the
16-bit weights are not saved (they are the master rounded).

Alignment changed no field: the metadata says where each parameter is (its offset) and how long
a shard is (S), and every reader goes by them, so the checkpoints written before zerokit aligned
its buffers load as they are, and the version stays. (A zerokit from before reads S = ceil(numel
/ N) only, and refuses an aligned checkpoint's metadata as inconsistent rather than misread it.)

Any other elementwise optimizer is saved the same way (version 2, zerokit.checkpoint.optimizers):
`tensors` in the metadata names what follows the weights in each bucket (SGD: momentum_buffer,
$K = 4$; Adagrad: sum), and each parameter's entry carries its other numbers (`scalars`: a
step count). Adam's checkpoints stay version 1, as the lesson writes them.

**Resharding.** The offsets make a checkpoint independent of how it was cut. Rank r' of N'
needs elements $[r'S', \min((r'+1)S', \Psi))$ of each flat buffer; old shard r holds
$[rS, (r+1)S)$: it reads the intersections (`shard_reads`, the lesson's map for S = ceil(numel
/ N); `sized_reads` for shards of any size, as zerokit's aligned ones), never the padding. Between
stages the buckets differ (ZeRO-2 cuts by size, ZeRO-3 by module), so `load` goes by name:
each piece of a parameter a rank now holds is found at its offset in the old bucket and read
from the old shards that cover it (`covering`). A flat shard is not a row split: a shard
boundary falls anywhere, mid-row, mid-parameter; only the recorded offsets say where.
"""

import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .files import (COMPLETE, METADATA, REPLICATED, CheckpointError, CheckpointMismatch, Reader, agree, commit,
                               partial_dir, rank_file, read_json, write_json, write_tensors)
from .optimizers import job_of
from .rows import whole
from .state import (TENSORS, AdamJob, check_same_model, load_replicated, parameter_names, replicated,
                               saved_kinds, saved_shards)
from .stream import placeholders, stream_load

def __getattr__(name):
    """`zerokit.checkpoint.dcp` on first use: it imports torch.distributed.checkpoint, which the
    lessons' own checkpoints never need."""
    if name == "dcp":
        import importlib

        return importlib.import_module(f"{__name__}.dcp")  # not `from . import`: that asks this function again
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["save", "load", "consolidate", "stream_load", "placeholders", "save_shards", "shard_reads", "sized_reads",
           "covering",
           "tensor_offset", "read_metadata", "read_parameter", "read_replicated", "CheckpointError",
           "CheckpointMismatch", "FORMAT", "VERSION", "ANY_VERSION", "TENSORS"]

FORMAT, VERSION = "zerokit-checkpoint", 1
# Beyond the lesson: another optimizer's tensors in the same layout. A new number, so that a
# reader that knows only Adam's refuses it instead of reading SGD's momentum as Adam's m.
ANY_VERSION = 2


def _rank_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


# ---------------------------------------------------------------------------------------
# exercise (b): the resharding map


def covering(start, end, shard_numel):
    """[(rank, lo, hi)]: the pieces of consecutive shards of shard_numel elements that cover [start, end)."""
    out = []
    while start < end:
        rank = start // shard_numel
        hi = min(end, (rank + 1) * shard_numel)
        out.append((rank, start, hi))
        start = hi
    return out


def shard_reads(numel, old_world, new_world, new_rank):
    """What rank new_rank of new_world reads of a flat buffer of numel elements saved by old_world
    ranks: [(old_rank, lo, hi)], element ranges of the whole buffer, in order, padding never read."""
    new_size = -(-numel // new_world)
    start, end = min(new_rank * new_size, numel), min((new_rank + 1) * new_size, numel)
    return covering(start, end, -(-numel // old_world))


def sized_reads(numel, old_size, new_size, new_rank):
    """shard_reads for shards of any length: old shards of old_size elements, new ones of new_size
    (zerokit's are aligned, zerokit.flat: at least ceil(numel / N), rounded up)."""
    start, end = min(new_rank * new_size, numel), min((new_rank + 1) * new_size, numel)
    return covering(start, end, old_size)


def tensor_offset(meta, bucket, kind):
    """Byte offset, in every rank file, of the shard of `kind` ("weights", "exp_avg" or
    "exp_avg_sq") of bucket number `bucket`: the buckets' shards lie end to end, TENSORS in order
    (another optimizer's: the kinds meta["tensors"] names, in that order)."""
    kinds = saved_kinds(meta)
    before = sum(b["shard_numel"] for b in meta["buckets"][:bucket])
    return 4 * (len(kinds) * before + kinds.index(kind) * meta["buckets"][bucket]["shard_numel"])


# ---------------------------------------------------------------------------------------
# exercise (a): save this rank's shards


def save_shards(directory, model, opt):
    """Write this rank's shards of opt's state to directory/rank_file(rank); on rank 0 return the
    metadata of the buckets (None on the other ranks)."""
    rank, world = _rank_world()
    shards = saved_shards(opt, world, rank)
    # a generator, not a list: a DistributedAdam shard is a copy, made as it is written
    write_tensors(Path(directory) / rank_file(rank), (getattr(sh, k) for sh in shards for k in TENSORS))
    if rank != 0:
        return None
    names = parameter_names(model)
    buckets = [{"numel": sh.bucket.numel, "shard_numel": sh.bucket.shard_numel,
                "params": [{"name": names[p], "shape": list(shape), "offset": offset, "step": step}
                           for p, shape, offset, step in zip(sh.bucket.params, sh.bucket.shapes, sh.bucket.offsets,
                                                             sh.steps)]}
               for sh in shards]
    return {"format": FORMAT, "version": VERSION, "world_size": world, "tensors": list(TENSORS), "buckets": buckets}


def save_any_shards(directory, job, summary):
    """save_shards for any torch optimizer's state (a zerokit.checkpoint.optimizers job): the same
    layout with the optimizer's own per-element tensors after the weights, and each parameter's
    other numbers (`summary`, gathered from the ranks that hold them) in the metadata."""
    rank, world = _rank_world()
    write_tensors(Path(directory) / rank_file(rank), job.shard_tensors(world, rank))
    if rank != 0:
        return None
    return {"format": FORMAT, "version": ANY_VERSION, "world_size": world, "tensors": list(job.kinds),
            "buckets": job.bucket_metadata(world, rank, summary)}


# ---------------------------------------------------------------------------------------
# save and load: the whole job


def save(path, model, opt, *, save_shards=save_shards):
    """Save the state of a training job on every rank: call it on all ranks (a collective).

    Each rank writes only its own shards; rank 0 also writes the metadata and the replicated
    tensors (frozen parameters, buffers). Nothing appears at `path` until every rank has
    written: a save that fails or is killed leaves `path` as it was. Extra memory: none for
    ZeRO's shards (their own bytes go to the file), one shard for DistributedAdam's copies.
    Beyond the lesson, `opt` may be zerokit.ZeRO1/ZeRO2 with any elementwise torch optimizer,
    or any torch optimizer on zerokit.DataParallel or zerokit.FullyShard (then `model` is the
    wrapper), or on a model sharded by zerokit.fully_shard: see zerokit.checkpoint.optimizers.
    """
    rank, _ = _rank_world()
    job = job_of(model, opt)  # who holds which state (a clear TypeError for what this cannot save)
    partial = partial_dir(path)
    what = f"cannot save {path}"

    def prepare():
        if rank == 0:
            if partial.exists():  # left by a save that did not finish
                shutil.rmtree(partial)
            partial.mkdir(parents=True)

    agree(what, prepare)
    summary = job.gather(what)  # beyond Adam: each parameter's numbers, from the ranks that hold them

    def write():
        if isinstance(job, AdamJob):
            return save_shards(partial, model, opt)
        return save_any_shards(partial, job, summary)

    meta = agree(what, write)  # rank 0's metadata of the buckets (None on the others)

    def write_replicated():
        # what no shard holds, whole (frozen parameters, buffers); a sharded model's DTensors gathered one at
        # a time (an all-gather each, on every rank), so every rank walks the same list
        entries = replicated(job.model, set(job.trained_shapes()))
        tensors = (whole(t) for _, t in entries)
        if rank != 0:
            for _ in tensors:
                pass
            return
        meta["replicated"], offset = [], 0
        for name, t in entries:
            meta["replicated"].append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                                       "shape": list(t.shape), "offset": offset})
            offset += t.numel() * t.element_size()
        try:
            write_tensors(partial / REPLICATED, tensors)
        finally:
            for _ in tensors:  # a write that failed: the other ranks still wait in the gathers that remain
                pass
        write_json(partial / METADATA, {**meta, **job.describe(summary)})

    agree(what, write_replicated)
    agree(what, lambda: commit(partial, path) if rank == 0 else None)


def read_metadata(path):
    """The metadata of a complete checkpoint of this format and version, its files checked."""
    path = Path(path)
    if not path.is_dir():
        unfinished = " (only an unfinished save, .partial, is there)" if partial_dir(path).exists() else ""
        raise CheckpointError(f"there is no checkpoint at {path}{unfinished}")
    if not (path / COMPLETE).exists():
        raise CheckpointError(f"{path} is incomplete: no {COMPLETE} marker (a save that did not finish?)")
    try:
        meta = read_json(path / METADATA)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / METADATA} cannot be read: {exc}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zerokit checkpoint (format {meta.get('format')!r})")
    if meta.get("version") not in (VERSION, ANY_VERSION):
        raise CheckpointError(f"{path} has format version {meta.get('version')!r}; this zerokit reads versions "
                              f"{VERSION} and {ANY_VERSION}")
    problem = next(_inconsistencies(meta), None)
    if problem:
        raise CheckpointError(f"{path / METADATA} does not describe a checkpoint: {problem}")
    size = 4 * len(saved_kinds(meta)) * sum(b["shard_numel"] for b in meta["buckets"])
    for r in range(meta["world_size"]):
        f = path / rank_file(r)
        if not f.exists() or f.stat().st_size != size:
            found = f"{f.stat().st_size} bytes" if f.exists() else "missing"
            raise CheckpointError(f"{f} should hold {size} bytes ({meta['world_size']} ranks' shards): {found}")
    return meta


def _inconsistencies(meta):
    """What in the metadata cannot be: shards too short for N of them to hold numel elements,
    parameters that overlap or run past their bucket (a reader trusting them would read the wrong
    bytes, or none). A shard longer than ceil(numel / N) is padding (zerokit.flat aligns S), and the
    rank files' sizes, checked against S, say whether it was written."""
    try:
        world, kinds = meta["world_size"], saved_kinds(meta)
        if kinds[:1] != ("weights",) or len(set(kinds)) != len(kinds):
            yield f"tensors {list(kinds)} should be 'weights' and then the optimizer's, each once"
        if meta["version"] == VERSION and kinds != TENSORS:
            yield f"version {VERSION} holds Adam's tensors {list(TENSORS)}, not {list(kinds)}"
        for bi, b in enumerate(meta["buckets"]):
            if not isinstance(b["shard_numel"], int) or b["shard_numel"] < -(-b["numel"] // world):
                yield (f"bucket {bi} has shard_numel {b['shard_numel']}: {world} shards of it cannot hold its "
                       f"{b['numel']} elements (at least ceil({b['numel']} / {world}))")
            end = 0
            for p in sorted(b["params"], key=lambda p: p["offset"]):
                n = math.prod(p["shape"])
                if p["offset"] < end or p["offset"] + n > b["numel"]:
                    yield (f"bucket {bi}: {p['name']} at offset {p['offset']} with {n} elements overlaps another "
                           f"parameter or runs past the bucket's {b['numel']} elements")
                end = p["offset"] + n
    except (KeyError, TypeError) as exc:
        yield f"a field is missing or malformed ({type(exc).__name__}: {exc})"


def load(path, model, opt, *, reads=None):
    """Load a checkpoint into `model` and `opt` on every rank (a collective), whatever world size
    and stage saved it. Everything is checked first, on every rank: a checkpoint that is
    incomplete, of another model, of another optimizer or of an unknown version raises the same
    CheckpointError on every rank and changes nothing. (What cannot be checked first is the disk
    itself: an I/O error in the middle of the reads leaves a half-loaded optimizer, to be loaded again.)

    reads: a whole-shard map like shard_reads (the lesson's exercise), used for every bucket;
    those must then hold the same parameters as the saved ones, in shards of ceil(numel / N) on
    both sides, the lesson's layout (zerokit.flat.aligned(1)), since that is what the map
    assumes. By default sized_reads serves the buckets that hold the same parameters (whatever
    their shards' lengths), and every other piece is found by name.
    """
    rank, world = _rank_world()
    job = job_of(model, opt)  # who holds which state: the lessons' Adam, or a torch optimizer's (optimizers.py)
    names = parameter_names(job.model)

    def check():
        meta = read_metadata(path)
        check_same_model(meta, job.model, job.trained_shapes())
        job.check(meta)  # the same optimizer class, state keys and param groups
        if reads is not None:
            shards = _state_shards(job)
            if not shards or any(_saved_bucket(meta, sh, names) is None for sh in shards):
                same_names = {tuple(names[p] for p in sh.bucket.params) for sh in shards} <= {
                    tuple(p["name"] for p in b["params"]) for b in meta["buckets"]}
                raise ValueError("whole-shard reads need every bucket to hold the same parameters as a saved one, at "
                                 "the same offsets" + (
                                     "; here the buckets are the same but the offsets differ: one side aligns each "
                                     "parameter (zerokit.flat.ALIGN_BYTES) and the other does not. Build the "
                                     "optimizers that save and load inside zerokit.flat.aligned(1), the lesson's "
                                     "layout, or load without reads=" if shards and same_names else ""))
            for sh in shards:
                saved = meta["buckets"][_saved_bucket(meta, sh, names)]
                lesson = (-(-saved["numel"] // meta["world_size"]), -(-sh.bucket.numel // world))
                if (saved["shard_numel"], sh.bucket.shard_numel) != lesson:
                    raise ValueError(
                        f"whole-shard reads (reads=) assume the lesson's shards of ceil(numel / N) elements; a bucket "
                        f"of {sh.bucket.numel} has shards of {saved['shard_numel']} in the checkpoint and "
                        f"{sh.bucket.shard_numel} here, not {lesson[0]} and {lesson[1]}: zerokit aligns its shards "
                        "(zerokit.flat.ALIGN_BYTES). Build the optimizers that save and load inside "
                        "zerokit.flat.aligned(1), or load without reads=")
        return meta

    meta = agree(f"cannot load {path}", check)
    with torch.no_grad(), Reader(path) as reader:  # from here on nothing can be refused
        for name, offset, dest in _plan(meta, job, rank, world, reads):
            reader.read(name, offset, dest)
        load_replicated(meta, job.model, reader)
    job.set_state(meta)  # Adam's step counts (any optimizer: each parameter's numbers)
    job.apply(meta)  # hyperparameters per param group, the loss scaler
    job.finish_load()


def _state_shards(job):
    """The lessons' ZeRO shards (StateShard: one tensor per kind, whole), which whole-shard reads fill."""
    return job.state_shards() if isinstance(job, AdamJob) else []


def _saved_bucket(meta, shard, names):
    """The index of the saved bucket that holds exactly shard's parameters at the same offsets, or None."""
    mine = [(names[p], o) for p, o in zip(shard.bucket.params, shard.bucket.offsets)]
    for bi, b in enumerate(meta["buckets"]):
        if [(p["name"], p["offset"]) for p in b["params"]] == mine:
            return bi
    return None


def _plan(meta, job, rank, world, reads=None):
    """[(file, byte offset, destination)]: every read that fills this rank's state. reads: the
    lesson's whole-shard map (shards of ceil(numel / N)); None: sized_reads, with each side's S."""
    names = parameter_names(job.model)
    where = {p["name"]: (bi, p["offset"]) for bi, b in enumerate(meta["buckets"]) for p in b["params"]}
    out, whole = [], set()
    for sh in _state_shards(job):  # a bucket the checkpoint has as it is: whole shards, the lesson's map
        bi = _saved_bucket(meta, sh, names)
        if bi is not None:
            whole.add(id(sh.bucket))  # by bucket: state_shards() makes new StateShard objects at each call
            size, start = meta["buckets"][bi]["shard_numel"], rank * sh.bucket.shard_numel
            pieces = (sized_reads(sh.bucket.numel, size, sh.bucket.shard_numel, rank) if reads is None else
                      reads(sh.bucket.numel, meta["world_size"], world, rank))
            for r, lo, hi in pieces:
                for kind in TENSORS:
                    dest = getattr(sh, kind)[lo - start:hi - start]
                    out.append((rank_file(r), tensor_offset(meta, bi, kind) + 4 * (lo - r * size), dest))
    for t in job.targets(meta):  # any other piece, by name: wherever its offset puts it
        if t.shard is not None and id(t.shard.bucket) in whole:
            continue
        bi, offset = where[t.name]
        size = meta["buckets"][bi]["shard_numel"]
        for r, lo, hi in covering(offset + t.lo, offset + t.hi, size):
            for kind, view in t.views.items():  # Adam: TENSORS; another optimizer: its own
                dest = view[lo - offset - t.lo:hi - offset - t.lo]
                out.append((rank_file(r), tensor_offset(meta, bi, kind) + 4 * (lo - r * size), dest))
    return out


# ---------------------------------------------------------------------------------------
# exercise (c): one full fp32 state_dict, a parameter at a time


def consolidate(path):
    """A plain fp32 state_dict of the whole model from a sharded checkpoint, in one process, each
    parameter read straight from the shards that hold it: memory is the result, nothing more.
    Tied names share one tensor; frozen parameters and buffers are included."""
    meta = read_metadata(path)
    state = {}
    with Reader(path) as reader:
        for bi, bucket in enumerate(meta["buckets"]):
            for p in bucket["params"]:
                state[p["name"]] = _read_whole(reader, meta, bi, p, "weights")
        for e in meta.get("replicated", []):
            state[e["name"]] = read_replicated(reader, e)
    for alias, name in meta.get("aliases", {}).items():
        state[alias] = state[name]  # the same tensor, not a copy: a tied weight is one weight
    order = meta.get("keys") or list(state)
    return {k: state[k] for k in order}


def read_parameter(reader, meta, name, kind="weights"):
    """The whole parameter `name` (its weights, exp_avg or exp_avg_sq) in fp32 and in its shape,
    read piece by piece from the rank files that hold it; the padding is never read."""
    for bi, bucket in enumerate(meta["buckets"]):
        for p in bucket["params"]:
            if p["name"] == name:
                return _read_whole(reader, meta, bi, p, kind)
    raise KeyError(f"no trained parameter {name} in the checkpoint")


def _read_whole(reader, meta, bi, p, kind):
    """Parameter entry p of bucket bi, whole: its pieces from the rank files that hold them."""
    size, at, numel = meta["buckets"][bi]["shard_numel"], tensor_offset(meta, bi, kind), math.prod(p["shape"])
    full = torch.empty(numel, dtype=torch.float32)
    for r, lo, hi in covering(p["offset"], p["offset"] + numel, size):
        reader.read(rank_file(r), at + 4 * (lo - r * size), full[lo - p["offset"]:hi - p["offset"]])
    return full.view(p["shape"])


def read_replicated(reader, entry):
    """A frozen parameter or buffer, whole (floating point ones in fp32)."""
    t = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
    reader.read(REPLICATED, entry["offset"], t)
    return t.float() if t.is_floating_point() else t
