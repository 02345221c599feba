r"""Checks for lesson 07 (sharded checkpoints): save this rank's shards, the resharding map, consolidation.

    check_numerics(save_shards, world_size, model)       exercise (a): the checkpoint your save_shards wrote,
                                                         loaded by zerokit's loader on the same or another
                                                         number of ranks, holds bit for bit what every rank
                                                         held, and training goes on as torch.optim.AdamW
    check_memory(save_shards, world_size, model)         exercise (a): each rank writes only its own shards,
                                                         12 B per element of them, and nothing else; its
                                                         peak memory does not rise by a copy of them
    check_reshard_map(shard_reads, world_size, ...)      exercise (b): many uneven cases (PyTorch's own planner
                                                         cases, padding, ranks left empty), then zerokit's
                                                         loader driven by your map on real ranks
    check_consolidate(consolidate, world_size, model)    exercise (c): a plain fp32 state_dict that
                                                         nn.Module.load_state_dict accepts, the saved values,
                                                         no padding, a tied weight once (one tensor)
    check_consolidate_memory(consolidate, ...)           exercise (c): peak ≤ the output + the largest parameter,
                                                         on shards larger than a parameter (ZeRO-1, one rank)
    check_answers(answers)                               check your understanding: four numbers

One bug costs one check. Each exercise is graded with zerokit's versions of the others: your
save_shards is read back by zerokit.checkpoint.load, your map drives that loader over a
checkpoint zerokit saved, your consolidation reads a checkpoint zerokit saved. The truth is
what the optimizers held when they saved (read through their state_shards() contract), and
torch.optim.AdamW on one process for the steps after a load. The optimizers are built in the
lesson's layout, shards of ceil(numel / N) and offsets end to end (zerokit.flat.aligned(1)):
the exercises are that arithmetic, where zerokit's own buffers also align each parameter.
"""

import json
import math
import os
from pathlib import Path
import tempfile

import torch
import torch.distributed as dist

from .. import checkpoint as ckpt
from ..checkpoint.files import CheckpointError, rank_file
from ..comm import WireCounter
from ..flat import aligned
from ..memory import PeakRSS
from ..mixed_precision import MixedPrecision, as_dtype
from ..models import build_model, model_loss
from ..zero1 import ZeRO1Adam
from ..zero2 import ZeRO2Adam
from ..zero3 import ZeRO3Adam
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks
from .kit import SHARDED_HYPER, adamw_reference, global_batch, rank_batch, refusing

__all__ = ["check_numerics", "check_memory", "check_reshard_map", "check_consolidate", "check_consolidate_memory",
           "check_answers", "RESHARD_CASES"]

_NO_GRADIENT = "n/a: the lesson's code copies the state an optimizer holds at rest; no gradient reaches it"
_NO_FORWARD = "n/a: the lesson's code never runs a module's forward: it reads and writes the state at rest"
# which of kit.SITUATIONS the hidden tests meet (tests/test_situations.py holds this to them)
SITUATIONS = {
    # replicated.bin holds a frozen parameter and a buffer; in an fp32 job's checkpoint a frozen parameter is
    # saved in fp32, the output's dtype, so a consolidate that returns it as saved cannot be told from a right
    # one: a mixed-precision job's checkpoint holds it in 16 bits (the visible test's bf16, the hidden fp16)
    "frozen": 'check_consolidate: precision="fp16"',
    "tied": "check_consolidate: edge",  # one tensor under both names
    "unused": "check_consolidate: edge",
    "root-params": "check_numerics: awkward",  # ZeRO-3: the tied embedding is the root unit's bucket
    "n3": "check_numerics: world_size=3",
    "sits-out": "check_numerics: branch",  # the branch skips a step before the save: step counts differ
    "zero3": "check_numerics: zero3",
    # consolidate's rule is per parameter (output + the largest one): only shards larger than a parameter show
    # a temporary of a whole shard. ZeRO-1 (one bucket) on one rank: a shard is the model, twice deep-mlp's
    # largest parameter (visible); ZeRO-3 on one rank (hidden): a rank file is the model. (check_memory:
    # deep-mlp, the peak while saving)
    "peak-memory": "check_consolidate_memory: world_size=1",
    "zero-grad-shard": _NO_GRADIENT,
    "out-of-order": _NO_GRADIENT,
    "tuple-output": _NO_FORWARD,
    "eval-no-grad": _NO_FORWARD,
    "subgroup": "n/a: a checkpoint is the whole job's: rank files are named by the global rank, and "
                "zerokit.checkpoint's save and load run on the default group",
    "fp16-scale": "n/a: the exercises write and read fp32 state (weights or master, m, v); the loss scaler is "
                  "saved by zerokit.checkpoint.save, outside them",
}

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STREAM = 707  # this lesson's data
HYPER = SHARDED_HYPER  # eps 1e-6: kit says why; betas torch's and zerokit's default, (0.9, 0.999)
SAVE_STEPS, MORE_STEPS = 3, 2
# the zoo's "branch" model skips its branch on this step, before the save: branch.weight and
# branch.bias then hold one Adam step fewer than the other parameters (the step counts differ)
BRANCH_SITS_OUT = 1
WRITE_SLACK = 64 * 1024  # bytes a rank may write besides its file: the metadata, three tiny agreements
MiB = 2**20
PEAK_SLACK = 256 * 1024  # the rise of the peak memory of a save without a copy: Python objects, the metadata

_OWN = "the exercise is to write it yourself: your {} used zerokit's own"
NO_ZEROKIT_SAVE = [(ckpt, "save_shards", _OWN.format("save_shards") + " (zerokit.checkpoint.save_shards)")]
NO_ZEROKIT_READS = [(ckpt, "shard_reads", _OWN.format("shard_reads") + " (zerokit.checkpoint.shard_reads)"),
                    (ckpt, "covering", _OWN.format("shard_reads") + " (zerokit.checkpoint.covering)")]
NO_ZEROKIT_CONSOLIDATE = [(ckpt, "consolidate", _OWN.format("consolidate") + " (zerokit.checkpoint.consolidate)"),
                          (ckpt, "read_parameter", _OWN.format("consolidate") + " (zerokit.checkpoint.read_parameter)")]


# ---------------------------------------------------------------------------------------
# training, and what an optimizer holds


def _make(stage, model, precision=None):
    """The stage's Adam, its buckets in the lesson's layout: the lesson teaches shards of S = ceil(numel / N)
    and offsets end to end (zerokit.flat.aligned(1)); zerokit's own aligned layout (each parameter and shard
    on 16 bytes) loads and saves through the same metadata, as the tests of zerokit.checkpoint hold. With
    precision ("bf16", "fp16") a mixed-precision job: every parameter of the model 16-bit, frozen ones too
    (they are saved so, in replicated.bin), fp32 masters in the shards."""
    mixed = {} if precision is None else {"precision": MixedPrecision(precision)}
    with aligned(1):
        if stage == "zero1":
            return ZeRO1Adam(model.parameters(), **HYPER, **mixed)
        if stage == "zero2":  # small buckets: several of them, each with its own padding
            return ZeRO2Adam(model.parameters(), bucket_mb=400 * 4 / 2**20, **HYPER, **mixed)
        if stage == "zero3":
            return ZeRO3Adam(model, **HYPER, **mixed)
    raise ValueError(f"stage must be zero1, zero2 or zero3, not {stage!r}")


def _backward(model, step, name, rank=None, world_size=None, scale_loss=None):
    """The gradient of the global batch of `step` (one process), or of this rank's slice of it;
    scale_loss: the optimizer's (a mixed-precision fp16 job scales the loss)."""
    if rank is None:
        x, y = global_batch(name, step, GLOBAL_BATCH, STREAM)
    else:
        x, y = rank_batch(name, step, GLOBAL_BATCH, rank, world_size, STREAM)
    if x.is_floating_point():  # the model's own dtype: 16-bit in a mixed-precision job
        x = x.to(next(model.parameters()).dtype)
    out = model(x, use_branch=False) if name == "branch" and step == BRANCH_SITS_OUT else model(x)
    loss = model_loss(name, out.float(), y)
    (loss if scale_loss is None else scale_loss(loss)).backward()


def _train(name, model, opt, start, steps, rank, world_size):
    for step in range(start, start + steps):
        _backward(model, step, name, rank, world_size, scale_loss=opt.scale_loss)
        opt.step()
        opt.zero_grad()


def _held(model, opt):
    """([(name, lo, hi, {kind: tensor})], {name: step}): this rank's pieces of the state."""
    names = {p: n for n, p in model.named_parameters()}
    pieces, steps = [], {}
    for sh in opt.state_shards():
        for s in sh.bucket.segments:
            pieces.append((names[sh.bucket.params[s.index]], s.param_lo, s.param_hi,
                           {k: getattr(sh, k)[s.shard_lo:s.shard_hi].detach().clone() for k in ckpt.TENSORS}))
        steps.update({names[p]: st for p, st in zip(sh.bucket.params, sh.steps)})
    return pieces, steps


def _full_weights(model, opt):
    if isinstance(opt, ZeRO3Adam):
        with opt.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assemble(per_rank, model_name):
    """{name: {kind: whole flat tensor}} from every rank's pieces."""
    shapes = {n: p.numel() for n, p in build_model(model_name).named_parameters() if p.requires_grad}
    full = {n: {k: torch.full((numel,), float("nan")) for k in ckpt.TENSORS} for n, numel in shapes.items()}
    for pieces, _ in per_rank:
        for name, lo, hi, views in pieces:
            for k, t in views.items():
                full[name][k][lo:hi] = t
    return full


_KIND = {"weights": "the weights", "exp_avg": "m (exp_avg)", "exp_avg_sq": "v (exp_avg_sq)"}


def _compare_loaded(model, opt, truth, steps, what, hint):
    """`hint`: why loaded values land in the wrong place (a str), or a function of (truth, name, kind, lo,
    hi, loaded) that says why where the numbers show it, else ''."""
    pieces, loaded_steps = _held(model, opt)
    for name, lo, hi, views in pieces:
        for k, t in views.items():
            expected = truth[name][k][lo:hi]
            if not torch.equal(t, expected):
                i = int((t != expected).nonzero()[0])
                why = hint(truth, name, k, lo, hi, t) if callable(hint) else hint
                raise AssertionError(
                    f"{what}: {_KIND[k]} of {name}, elements [{lo}, {hi}), differ from what was saved (first at "
                    f"element {lo + i}: saved {float(expected[i]):.6g}, loaded {float(t[i]):.6g})"
                    + (f". {why}" if why else ""))
    wrong = {n: (steps[n], s) for n, s in loaded_steps.items() if steps[n] != s}
    if wrong:
        raise AssertionError(f"{what}: Adam's step counts came back wrong (saved, loaded): {dict(list(wrong.items())[:3])}")


def _continue_like_adamw(name, model, opt, rank, world_size, reference, what):
    _train(name, model, opt, SAVE_STEPS, MORE_STEPS, rank, world_size)
    record = reference[SAVE_STEPS + MORE_STEPS - 1]
    weights = _full_weights(model, opt)
    for n, expected in record["params"].items():
        assert_close(weights[n], expected, f"{what}: parameter {n} after {MORE_STEPS} more steps, against AdamW")


def _save_case(rank, world_size, name, stage, path, save_shards, precision=None):
    """Train SAVE_STEPS steps, save (zerokit's save, with save_shards if given); this rank's pieces."""
    save = ckpt.save  # taken before refusing: the check's own tool
    with refusing(*(NO_ZEROKIT_SAVE if save_shards is not None else ()), everywhere=True):
        model = build_model(name)
        opt = _make(stage, model, precision)
        _train(name, model, opt, 0, SAVE_STEPS, rank, world_size)
        held = _held(model, opt)
        try:
            if save_shards is None:
                save(path, model, opt)
            else:
                save(path, model, opt, save_shards=save_shards)
        except CheckpointError as exc:
            stub = " (is save_shards still the stub?)" if str(exc).endswith("NotImplementedError (with no message)") else ""
            raise AssertionError(f"saving with your save_shards failed: {exc}{stub}") from None
    return held


def _shared_dir():
    """A fresh directory for one check's checkpoints (the ranks see the same file system)."""
    return Path(tempfile.mkdtemp(prefix="zerokit-lesson07-"))


_SAVED = {}  # (model, stage, world size, precision) -> (path, every rank's pieces): checkpoints zerokit saved


def _saved_by_zerokit(model, stage, world_size, timeout, precision=None):
    """A checkpoint zerokit.checkpoint.save wrote after SAVE_STEPS steps, and what the ranks held;
    saved once per configuration (a lesson's visible and hidden checks share it)."""
    key = (model, stage, world_size, precision)
    if key not in _SAVED or not (_SAVED[key][0] / "COMPLETE").exists():
        path = _shared_dir() / "ckpt"
        held = run_on_ranks(_save_case, world_size, args=(model, stage, path, None, precision), timeout=timeout,
                            what="saving")
        _SAVED[key] = (path, held)
    return _SAVED[key]


# ---------------------------------------------------------------------------------------
# exercise (a): save_shards


def _load_case(rank, world_size, name, stage, path, truth, steps, reference, reads):
    load = ckpt.load
    with refusing(*(NO_ZEROKIT_READS if reads is not None else ()), everywhere=True):
        model = build_model(name, seed=1)  # other weights: the load must overwrite them
        opt = _make(stage, model)
        what = f"after loading on {world_size} ranks"
        try:
            load(path, model, opt, reads=reads)
        except CheckpointError as exc:
            raise AssertionError(f"zerokit.checkpoint.load refused the checkpoint: {exc}") from None
        hint = (_misplaced if reads is None else
                "Your map sent elements to the wrong place: shards are ceil(numel/N) long, rank r' of N' holds "
                "[r'S', min((r'+1)S', numel)) and old rank q holds [qS, (q+1)S)")
        _compare_loaded(model, opt, truth, steps, what, hint)
        _continue_like_adamw(name, model, opt, rank, world_size, reference, what)


def _misplaced(truth, name, kind, lo, hi, loaded):
    """Why your save_shards' file gave `loaded` for elements [lo, hi) of `kind` of `name`, where the
    numbers show it: the saved values of another kind there, or saved values of this kind from
    elsewhere (the layout); '' otherwise (the file holds numbers that were never saved)."""
    got = loaded.reshape(-1)
    if not got.numel():
        return ""
    for other, saved in truth[name].items():
        if other != kind and torch.equal(got, saved[lo:hi].reshape(-1)):
            return (f"They are the saved {_KIND[other]}: write each of a shard's tensors under its own name, in the "
                    "order TENSORS lists them")
    pool = torch.cat([t[kind].reshape(-1) for t in truth.values() if kind in t])
    if bool(torch.isin(got, pool).all()):
        return ("They are saved values from another place: is each parameter's \"offset\" its position in its own "
                "bucket's flat buffer (bucket.offsets), each bucket's shard_numel its own, and the file's order "
                "bucket by bucket, TENSORS in order?")
    return ""


def _saved_params(path):
    """[(bucket index, the metadata's entry of a parameter)] of the checkpoint at path, as written;
    [] where the metadata is not readable as the contract's (the loader then says what is wrong)."""
    try:
        meta = json.loads((Path(path) / "metadata.json").read_text())
        return [(bi, p) for bi, b in enumerate(meta["buckets"]) for p in b["params"] if isinstance(p, dict)]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _check_shapes(entries, name, stage):
    """Each parameter's recorded shape is the model's (under ZeRO-3 p.shape is empty at rest)."""
    shapes = {n: list(p.shape) for n, p in build_model(name).named_parameters()}
    for _, p in entries:
        n, shape = p.get("name"), p.get("shape")
        if n in shapes and shape != shapes[n]:
            empty = isinstance(shape, list) and all(isinstance(d, int) for d in shape) and math.prod(shape) == 0
            why = (": you recorded p.shape, and under ZeRO-3 a parameter is empty at rest (its .data is an empty "
                   "tensor, the full weights exist only while its unit computes); the bucket keeps every "
                   "parameter's true shape (bucket.shapes)" if empty and stage == "zero3" else
                   ": each parameter's shape as a list of ints, from the bucket (bucket.shapes)")
            raise CheckFailed(f"your metadata gives {n} the shape {shape!r}; the model's {n} is {shapes[n]} "
                              f"({stage}){why}")


def _check_steps(entries, steps):
    """Each parameter's recorded Adam step count is its own (they differ where a layer sat out a step)."""
    saved = {p.get("name"): p.get("step") for _, p in entries if p.get("name") in steps}
    wrong = sorted(n for n, s in saved.items() if s != steps[n])
    if not wrong:
        return
    n = wrong[0]
    per_bucket = {}
    for bi, p in entries:
        per_bucket.setdefault(bi, set()).add(repr(p.get("step")))
    fewer = sorted(m for m, s in steps.items() if s < max(steps.values()))  # they sat out a step
    how = None
    if fewer and len(per_bucket) > 1 and len(set(map(repr, saved.values()))) == 1:
        how = "one step count for every parameter"
    elif fewer and all(len(v) == 1 for v in per_bucket.values()):
        how = "one step count per bucket" if len(per_bucket) > 1 else "one step count for the whole bucket"
    said = (f"your metadata gives {n} the Adam step count {saved[n]!r}, and it took {steps[n]} steps "
            f"({len(wrong)} of {len(saved)} parameters wrong)")
    if how:
        raise CheckFailed(f"{said}: you saved {how}, and each parameter has its own (the shard's steps, one per "
                          f"parameter of the bucket): {', '.join(fewer[:3])} sat out a step (no "
                          "gradient), and the resumed run's bias correction would use the wrong count")
    raise CheckFailed(f"{said}: each parameter's count is its entry of its shard's steps, in the bucket's order")


def _roundtrip(name, stage, world_size, load_world_size, timeout, save_shards=None, reads=None):
    reference = adamw_reference(name, SAVE_STEPS + MORE_STEPS, HYPER, _backward, (name,), timeout=timeout)
    if save_shards is None:
        path, held = _saved_by_zerokit(name, stage, world_size, timeout)
    else:
        path = _shared_dir() / "ckpt"
        held = run_on_ranks(_save_case, world_size, args=(name, stage, path, save_shards), timeout=timeout,
                            what="saving")
        entries = _saved_params(path)
        _check_shapes(entries, name, stage)
        _check_steps(entries, held[0][1])
    truth, steps = _assemble(held, name), held[0][1]
    run_on_ranks(_load_case, load_world_size, args=(name, stage, path, truth, steps, reference, reads),
                 timeout=timeout, what="loading")


def check_numerics(save_shards, world_size=2, model="mlp", stage="zero2", load_world_size=None, timeout=60.0):
    """Your save_shards on world_size ranks, read back by zerokit.checkpoint.load on load_world_size
    ranks: the state is bit for bit what every rank held, and training goes on as AdamW."""
    __tracebackhide__ = True
    if not callable(save_shards):
        raise CheckFailed(f"expected the function save_shards, got {type(save_shards).__name__}")
    load_world_size = load_world_size or world_size
    _roundtrip(model, stage, world_size, load_world_size, timeout, save_shards=save_shards)
    passed(f"the checkpoint your save_shards wrote on {world_size} ranks ({model}, {stage}) loads on "
           f"{load_world_size} ranks bit for bit, and {MORE_STEPS} more steps match torch.optim.AdamW")


def _memory_case(rank, world_size, name, stage, directory, save_shards):
    with refusing(*NO_ZEROKIT_SAVE, everywhere=True):
        model = build_model(name)
        opt = _make(stage, model)
        _train(name, model, opt, 0, 1, rank, world_size)
        numels = [sh.bucket.shard_numel for sh in opt.state_shards()]
        own = 4 * len(ckpt.TENSORS) * sum(numels)
        warm, measured = Path(directory) / "warm", Path(directory) / "ckpt"
        if rank == 0:
            warm.mkdir(), measured.mkdir()
        dist.barrier()
        save_shards(warm, model, opt)  # once before: the first call reads the code's own pages in, not data
        dist.barrier()
        with WireCounter() as wire, PeakRSS() as peak:
            meta = save_shards(measured, model, opt)
        dist.barrier()
    path = measured / rank_file(rank)
    size = path.stat().st_size if path.exists() else None
    meta_bytes = len(json.dumps(meta)) if meta is not None else 0
    return {"own": own, "largest": 4 * max(numels), "size": size, "wrote": wire.sent_bytes, "meta": meta_bytes,
            "peak": peak.bytes, "files": sorted(os.listdir(measured)) if rank == 0 else None}


def _peak_allowed(largest):
    """The rise of a rank's peak memory that save_shards may cause: writing the shards' own bytes costs
    none (a few pages of Python objects, the metadata); a copy of one shard tensor is `largest`."""
    return max(PEAK_SLACK, largest // 2)


def check_memory(save_shards, world_size=2, model="deep-mlp", stage="zero2", timeout=60.0):
    """Each rank writes its own file, 12 B per element of its shards (fp32 weights, m, v), and
    nothing else: no other file, no full copy, no gathering of the others' state; and its peak
    memory while saving does not rise by a copy of its shards (the kernel's high-water mark)."""
    __tracebackhide__ = True
    if not callable(save_shards):
        raise CheckFailed(f"expected the function save_shards, got {type(save_shards).__name__}")
    directory = _shared_dir()
    results = run_on_ranks(_memory_case, world_size, args=(model, stage, directory, save_shards), timeout=timeout,
                           what="save_shards")
    expected_files = [rank_file(r) for r in range(world_size)]
    if results[0]["files"] != expected_files:
        raise CheckFailed(f"after your save_shards on {world_size} ranks the directory holds {results[0]['files']}; "
                          f"expected exactly {expected_files}: each rank writes its own file (rank 0 returns the "
                          "metadata, and zerokit.checkpoint.save writes it)")
    for rank, r in enumerate(results):
        if r["size"] != r["own"]:
            ratio = f" ({r['size'] / r['own']:.1f}x)" if r["size"] else ""
            raise CheckFailed(
                f"[rank {rank}] {rank_file(rank)} holds {r['size']} B{ratio}; this rank owns 12 B x its shard elements "
                f"= {r['own']} B (fp32 weights, m and v of its shards). Each rank writes only what it owns: "
                "the others' shards are in their files")
        if r["wrote"] is not None and r["wrote"] > r["own"] + r["meta"] + WRITE_SLACK:
            raise CheckFailed(
                f"[rank {rank}] your save_shards wrote {r['wrote']} B in all (files and network) for {r['own']} B of "
                "this rank's own shards: each rank writes only what it owns, and gathers nothing")
    for rank, r in enumerate(results):
        if r["peak"] is not None and r["peak"] > _peak_allowed(r["largest"]):
            raise CheckFailed(
                f"[rank {rank}] while your save_shards ran, this rank's peak memory rose by {r['peak'] / MiB:.2f} MiB "
                f"(its shards: {r['own'] / MiB:.2f} MiB, the largest shard tensor {r['largest'] / MiB:.2f} MiB; "
                f"allowed {_peak_allowed(r['largest']) / MiB:.2f} MiB): the shards were copied before being written "
                "(a clone, torch.cat, .numpy().tobytes(), ...); write the shards' own tensors, views of the "
                "optimizer's state, as they are: no copy")
    worst = max((r["peak"] for r in results if r["peak"] is not None), default=None)
    peak = ("no peak measured (this system has no high-water mark of resident memory)" if worst is None else
            f"peak memory up by at most {worst / MiB:.2f} MiB (a copy of the largest shard tensor: "
            f"{results[0]['largest'] / MiB:.2f} MiB)")
    passed(f"each of {world_size} ranks wrote only its own shards, no copy: {results[0]['own']} B = 12 B x "
           f"{results[0]['own'] // 12} elements ({model}, {stage}); {peak}")


# ---------------------------------------------------------------------------------------
# exercise (b): the resharding map


def _expected_reads(numel, old_world, new_world, new_rank):
    """The reads, written here independently of zerokit.checkpoint."""
    s_old, s_new = -(-numel // old_world), -(-numel // new_world)
    start, end = min(new_rank * s_new, numel), min((new_rank + 1) * s_new, numel)
    out = []
    for q in range(old_world):
        lo, hi = max(start, q * s_old), min(end, (q + 1) * s_old)
        if lo < hi:
            out.append((q, lo, hi))
    return out


# (numel, old world size, new world size): PyTorch's planner cases first (128 elements saved on 8 ranks
# and loaded on 4: two whole reads per rank; 4 -> 8: half a chunk; 120 on 4 -> 3: rank 1 reads [40, 60)
# and [60, 80)), then padding, ranks left empty, one rank on either side
RESHARD_CASES = [(128, 8, 4), (128, 4, 8), (120, 4, 3), (11, 3, 2), (11, 2, 3), (13, 4, 3), (13, 3, 4), (1, 4, 3),
                 (2, 1, 4), (7, 4, 1), (1001, 3, 4), (10, 4, 4), (9, 2, 4), (5, 4, 2), (1267, 2, 3), (3, 2, 4)]


def _map_case(rank, world_size, fn, cases):
    with refusing(*NO_ZEROKIT_READS, everywhere=True):
        for numel, old, new in cases:
            for r in range(new):
                call = f"shard_reads({numel}, {old}, {new}, {r})"
                got = fn(numel, old, new, r)
                try:
                    got = [tuple(x) for x in got]
                except TypeError:
                    raise AssertionError(f"{call} returned {got!r}: expected a list of (old_rank, lo, hi)") from None
                if any(len(x) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in x) for x in got):
                    raise AssertionError(f"{call} returned {got!r}: each read is (old_rank, lo, hi), Python ints")
                want = _expected_reads(numel, old, new, r)
                if got != want:
                    raise AssertionError(
                        f"{call} gave {got}; expected {want}. Shards are ceil(numel/N) long (the last ends in "
                        f"padding); rank r of N' needs [r*S', min((r+1)*S', numel)), old rank q holds "
                        f"[q*S, (q+1)*S): read the intersections, in order, and never the padding")


def check_reshard_map(shard_reads, world_size=2, load_world_size=None, model="mlp", stage="zero2", cases=None,
                      timeout=60.0):
    """shard_reads(numel, old_world, new_world, new_rank) on many uneven cases (PyTorch's planner's among
    them); then zerokit.checkpoint.load, driven by your map, loads a checkpoint saved on world_size
    ranks onto load_world_size ranks bit for bit."""
    __tracebackhide__ = True
    if not callable(shard_reads):
        raise CheckFailed(f"expected the function shard_reads, got {type(shard_reads).__name__}")
    cases = list(cases or RESHARD_CASES)
    run_on_ranks(_map_case, 1, args=(shard_reads, cases), timeout=timeout, what="shard_reads")
    load_world_size = load_world_size or world_size
    _roundtrip(model, stage, world_size, load_world_size, timeout, reads=shard_reads)
    passed(f"shard_reads is right on {len(cases)} uneven cases (PyTorch's planner cases among them), and drives "
           f"zerokit's loader from {world_size} to {load_world_size} ranks bit for bit ({model}, {stage})")


# ---------------------------------------------------------------------------------------
# exercise (c): consolidate


def _consolidate_case(rank, world_size, fn, path, name, truth, precision=None):
    with refusing(*NO_ZEROKIT_CONSOLIDATE, everywhere=True):
        state = fn(path)
    saved_dtypes = {e["name"]: e["dtype"] for e in ckpt.read_metadata(path).get("replicated", [])}
    if not isinstance(state, dict):
        raise AssertionError(f"consolidate returned a {type(state).__name__}, not a dict (a state_dict)")
    plain = build_model(name, seed=2)
    original = build_model(name).state_dict()
    keys = list(original)
    missing, extra = [k for k in keys if k not in state], [k for k in state if k not in keys]
    if missing or extra:
        raise AssertionError(f"the state_dict's keys differ from {type(plain).__name__}'s: missing {missing[:4]}, "
                             f"unexpected {extra[:4]} (tied names, frozen parameters and buffers belong in it too)")
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            raise AssertionError(f"state[{k!r}] is a {type(v).__name__}, not a tensor")
        expected = original[k]
        if tuple(v.shape) != tuple(expected.shape):
            raise AssertionError(f"state[{k!r}] has shape {tuple(v.shape)}, the model's {k} {tuple(expected.shape)}"
                                 + (": the padding at the end of a bucket belongs to no parameter"
                                    if v.numel() > expected.numel() else ""))
        if expected.is_floating_point() and v.dtype != torch.float32:
            as_saved = (f", the dtype the checkpoint holds it in (replicated.bin: a mixed-precision job's frozen "
                        f"parameters are {saved_dtypes[k]}, as the model computes)"
                        if saved_dtypes.get(k) == str(v.dtype).removeprefix("torch.") else "")
            raise AssertionError(f"state[{k!r}] is {v.dtype}{as_saved}: a consolidated checkpoint is a plain fp32 "
                                 "state_dict, every floating-point tensor in fp32, whatever the job computed in")
    plain.load_state_dict(state)  # strict
    tied = {}
    for k, t in build_model(name).state_dict(keep_vars=True).items():
        tied.setdefault(id(t), []).append(k)
    aliases = {other: names[0] for names in tied.values() for other in names[1:]}
    for other, first in aliases.items():
        if state[other].data_ptr() != state[first].data_ptr():
            raise AssertionError(f"state[{other!r}] is a copy of state[{first!r}]: they are one tied weight, and "
                                 "a state_dict holds it once (the same tensor under both names)")
    for name_, full in truth.items():
        got = state[name_].reshape(-1)
        if not torch.equal(got, full["weights"]):
            i = int((got != full["weights"]).nonzero()[0])
            raise AssertionError(f"state[{name_!r}] differs from the saved weights at element {i}: saved "
                                 f"{float(full['weights'][i]):.6g}, yours {float(got[i]):.6g} (where does each "
                                 "parameter start in its bucket, and where does its bucket start in a rank file?)")
    params = dict(build_model(name).named_parameters())
    dtype = as_dtype(precision) if precision else torch.float32
    for k, t in original.items():
        # the values as saved: a mixed-precision job's frozen parameters were 16-bit (the rounded weights)
        want = t.to(dtype).float() if k in params and t.is_floating_point() else t.float()
        if k not in truth and k not in aliases and not torch.equal(state[k], want):
            raise AssertionError(f"state[{k!r}] (a frozen parameter or a buffer) differs from the values saved in "
                                 "replicated.bin")


def check_consolidate(consolidate, world_size=2, model="edge", stage="zero3", precision=None, timeout=60.0):
    """consolidate(path) of a checkpoint zerokit saved on world_size ranks: a plain fp32 state_dict that
    the model's load_state_dict accepts (strict), with the saved weights, tied weights once, frozen
    parameters and buffers, and no padding. precision "bf16" or "fp16": the checkpoint of a mixed-precision
    job, whose frozen parameters replicated.bin holds in 16 bits (the trained ones: their fp32 masters)."""
    __tracebackhide__ = True
    if not callable(consolidate):
        raise CheckFailed(f"expected the function consolidate, got {type(consolidate).__name__}")
    path, held = _saved_by_zerokit(model, stage, world_size, timeout, precision)
    truth = _assemble(held, model)
    run_on_ranks(_consolidate_case, 1, args=(consolidate, path, model, truth, precision), timeout=timeout,
                 what="consolidate")
    job = f"{stage}, {precision} mixed precision" if precision else f"{stage}, fp32"
    passed(f"consolidate of {model} saved on {world_size} ranks ({job}): every tensor fp32, strict "
           "load_state_dict, the saved weights bit for bit, tied weights one tensor, frozen parameters and buffers "
           "the saved values")


def _peak_case(rank, world_size, fn, path):
    with refusing(*NO_ZEROKIT_CONSOLIDATE, everywhere=True):
        with PeakRSS():
            fn(path)  # once before: the first run reads the code's own pages in, which is not data
        with PeakRSS() as peak:
            fn(path)
    return peak.bytes


def check_consolidate_memory(consolidate, world_size=1, model="deep-mlp", stage="zero1", timeout=60.0):
    """The peak memory of consolidate(path) is at most the output plus the largest parameter: built
    one parameter at a time, never a second copy of the model. The rule is per parameter, so the
    checkpoint must have shards larger than a parameter for a shard-sized temporary to show: ZeRO-1
    (one bucket) on one rank, the default, holds the whole model in one shard."""
    __tracebackhide__ = True
    if not callable(consolidate):
        raise CheckFailed(f"expected the function consolidate, got {type(consolidate).__name__}")
    path, _ = _saved_by_zerokit(model, stage, world_size, timeout)
    peak = run_on_ranks(_peak_case, 1, args=(consolidate, path), timeout=timeout, what="consolidate")[0]
    output, largest = _consolidated_bytes(model)
    limit = output + largest
    rule = (f"the limit {limit / 2**20:.2f} MiB = the output ({model}'s state_dict, {output / 2**20:.2f} MiB) + "
            f"the largest parameter ({largest / 2**20:.2f} MiB)")
    where = f"saved by {stage} on {world_size} rank{'s' if world_size > 1 else ''}"
    if peak is None:
        passed(f"consolidate ran ({where}); no peak measured (this system has no high-water mark of resident "
               f"memory); {rule}")
        return
    if peak > limit:
        shards = [4 * b["shard_numel"] for b in ckpt.read_metadata(path)["buckets"]]
        raise CheckFailed(
            f"consolidate's peak memory was {peak / 2**20:.2f} MiB ({where}), over {rule}: {(peak - output) / 2**20:.2f} "
            f"MiB above the output, where a rank's weights here are {sum(shards) / 2**20:.2f} MiB in "
            f"{len(shards)} bucket shard{'s' if len(shards) > 1 else ''} (the largest {max(shards) / 2**20:.2f} MiB). "
            "Something that size was held besides the state_dict: read each parameter straight into its own tensor, "
            "never a whole shard, bucket or rank file first")
    passed(f"consolidate's peak memory was {peak / 2**20:.2f} MiB ({where}), within {rule}")


def _consolidated_bytes(model):
    """(bytes of the fp32 state_dict consolidate returns, tied weights once; bytes of the largest parameter)."""
    net = build_model(model)
    storages = {}
    for t in net.state_dict().values():
        nbytes = 4 * t.numel() if t.is_floating_point() else t.untyped_storage().nbytes()
        storages[t.untyped_storage().data_ptr()] = nbytes
    return sum(storages.values()), max(4 * p.numel() for p in net.parameters())


# ---------------------------------------------------------------------------------------
# check your understanding


def _answers():
    psi_mlp = sum(p.numel() for p in build_model("mlp").parameters())
    s8 = -(-psi_mlp // 8)
    return {
        "q1_bytes_per_rank": 12 * s8,
        "q2_bytes_per_rank_paper": 12 * 7.5e9 / 64,
        "q3_reads": len(_expected_reads(1000, 8, 3, 2)),
        "q4_padding_bytes": 12 * (8 * s8 - psi_mlp),
    }


def check_answers(answers):
    """Your four numbers against the course's."""
    __tracebackhide__ = True
    if not isinstance(answers, dict):
        raise CheckFailed(f"expected the dict `answers`, got {type(answers).__name__}")
    if all(answers.get(key) is None for key in _answers()):
        raise CheckFailed("no answers yet: every entry of `answers` is still None (is the exercise still the stub "
                          "that raises NotImplementedError?)")
    wrong = []
    for key, value in _answers().items():
        got = answers.get(key)
        if got is None or isinstance(got, bool) or not isinstance(got, (int, float)) or \
                not math.isclose(got, value, rel_tol=1e-6):
            wrong.append(key)
    if wrong:
        raise CheckFailed(f"{len(wrong)} of {len(_answers())} answers are not right yet: {', '.join(wrong)}")
    passed(f"all {len(_answers())} answers are right")
