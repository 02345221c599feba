"""zerokit.checkpoint on real gloo ranks: every promise of lesson 07, each with a test.

| promise | test |
|---|---|
| each rank writes only what it owns; one metadata file; bounded memory while saving | test_each_rank_writes_only_its_own_shards |
| exact resume: bit-identical at the same N; at another N the state exact and fp32 within 1e-6; every stage, fp32/bf16/fp16 (scaler restored) | test_resume_is_bit_identical |
| resharding N -> N' (1..4), any stage -> any stage, by names and offsets | test_reshard_any_world_size_any_stage |
| consolidation: plain fp32 state_dict, tied once, frozen + buffers; peak measured | test_consolidate |
| stream-load of a ZeRO-3 model unit by unit, from a meta-device model; peak measured | test_stream_load |
| atomic save (kill a rank mid-save); clear one-message failures that change nothing | test_killed_save_and_refused_loads |
| DCP interop: zerokit -> FSDP2 (torch's and zerokit's fully_shard) + torch AdamW and back, N = 2 | test_dcp_interop_with_fsdp2 |
| other alignments (unaligned, as before; 128 B) load bit for bit; the lesson's map refused on aligned shards | test_checkpoints_of_another_alignment_load |

The truth is never zerokit's own reading of a checkpoint: what the optimizers held when they
saved (read through their state_shards() contract, or DistributedAdam's state), runs that
were never interrupted, and torch.optim.AdamW on one process (conftest.adamw_reference).
The measured figures are printed (pytest -s shows them).
"""

import hashlib
import json
import math
import os
import shutil
import sys

import cloudpickle
import pytest
import torch

import zerokit
import zerokit.checkpoint as ckpt
from conftest import adamw_reference, align, batch, ceil_div, max_diff, new_model, padding_bound, rank_slice, run_ranks
from zerokit.checkpoint.files import CheckpointError, rank_file
from zerokit.comm import WireCounter
from zerokit.flat import FlatBucket, aligned
from zerokit.launcher import LaunchError
from zerokit.memory import PeakRSS
from zerokit.models import OddMLP, loss_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.distributed

STAGES = ("ddp", "zero1", "zero2", "zero3")
LR, WD, BATCH = 1e-2, 0.1, 12
DEEP = (27, 768, 768, 768, 7)  # Ψ = 1,202,071: a unit (one layer) is a fifth of the model
SLACK = 256 * 1024  # bytes of Python objects, JSON and file buffers a save or load may touch besides tensors


def make_opt(stage, model, precision=None):
    kw = dict(lr=LR, weight_decay=WD, precision=precision)
    if stage == "ddp":
        return zerokit.DistributedAdam(model.parameters(), **kw)
    if stage == "zero1":
        return zerokit.ZeRO1Adam(model.parameters(), **kw)
    if stage == "zero2":
        return zerokit.ZeRO2Adam(model.parameters(), bucket_mb=250 * 4 / 2**20, **kw)  # several buckets
    return zerokit.ZeRO3Adam(model, **kw)


def train(kind, model, opt, steps, start, rank, world, dtype=None):
    """Steps start .. start+steps-1 of the global batches, this rank's slice of each."""
    for step in range(start, start + steps):
        x, y = batch(kind, step, BATCH)
        x, y = rank_slice(x, rank, world), rank_slice(y, rank, world)
        if dtype is not None and x.is_floating_point():
            x = x.to(dtype)
        loss = loss_for(kind, model(x).float(), y)
        (opt.scale_loss(loss) if hasattr(opt, "scale_loss") else loss).backward()
        opt.step()
        opt.zero_grad()


def weights(model, opt):
    """{name: full parameter}, gathered under ZeRO-3."""
    if isinstance(opt, zerokit.ZeRO3Adam):
        with opt.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def held(model, opt):
    """What this rank's optimizer holds, read through the public contract: [(name, lo, hi, {kind: tensor})]
    and {name: step}. DistributedAdam holds every parameter whole."""
    names = {p: n for n, p in model.named_parameters()}
    out, steps = [], {}
    if isinstance(opt, zerokit.DistributedAdam):
        masters = dict(zip(opt.all_params(), opt.masters)) if opt.masters is not None else {}
        for p in (p for g in opt.param_groups for p in g["params"] if p.requires_grad):
            s = opt.state.get(p, {})
            w = masters.get(p, p.detach())
            out.append((names[p], 0, p.numel(), {
                "weights": w.reshape(-1).float().clone(),
                "exp_avg": s["exp_avg"].reshape(-1).clone() if s else torch.zeros(p.numel()),
                "exp_avg_sq": s["exp_avg_sq"].reshape(-1).clone() if s else torch.zeros(p.numel())}))
            steps[names[p]] = int(s.get("step", 0))
        return out, steps
    for sh in opt.state_shards():
        for s in sh.bucket.segments:
            out.append((names[sh.bucket.params[s.index]], s.param_lo, s.param_hi,
                        {k: getattr(sh, k)[s.shard_lo:s.shard_hi].clone() for k in ckpt.TENSORS}))
        steps.update({names[p]: st for p, st in zip(sh.bucket.params, sh.steps)})
    return out, steps


def assemble(pieces_per_rank, shapes):
    """{name: {kind: full flat tensor}} from every rank's held() pieces."""
    full = {n: {k: torch.full((int(torch.tensor(s).prod()),), float("nan")) for k in ckpt.TENSORS}
            for n, s in shapes.items()}
    for pieces in pieces_per_rank:
        for name, lo, hi, views in pieces:
            for k, t in views.items():
                full[name][k][lo:hi] = t
    return full


def assert_pieces_equal(pieces, truth, what):
    """Every piece a rank holds equals, bit for bit, the same elements of the truth."""
    for name, lo, hi, views in pieces:
        for k, t in views.items():
            assert torch.equal(t, truth[name][k][lo:hi]), f"{what}: {name} {k} [{lo}, {hi}) differs"


def files_digest(path):
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in sorted(os.listdir(path))}


# ---------------------------------------------------------------------------------------
# saving: each rank writes its own shards, and the memory it takes


def _warm_up(rank, world, root, stages):
    """Run each save path once on a tiny model: the first time code runs, its pages are read in
    from the libraries and count as resident memory, which is not what is measured here."""
    with PeakRSS():
        torch.ones(1)
    for stage in stages:
        torch.manual_seed(0)
        model = OddMLP((27, 8, 7))
        opt = make_opt(stage, model)
        train("mlp", model, opt, 1, 0, rank, world)
        ckpt.save(root / f"warm-up-{stage}", model, opt)
        ckpt.load(root / f"warm-up-{stage}", model, opt)
        ckpt.consolidate(root / f"warm-up-{stage}")


def _save_deep(rank, world, root):
    _warm_up(rank, world, root / "warm-up", STAGES)
    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        model = OddMLP(DEEP)
        opt = make_opt(stage, model)
        train("mlp", model, opt, 1, 0, rank, world)
        if stage == "ddp":  # the 1/N a ZeRO-1 rank would own, built here with FlatBucket
            params = [p for p in model.parameters() if p.requires_grad]
            b = FlatBucket(params, world, rank, align_bytes=None)  # zerokit's alignment, as ZeRO-1's
            mine = [b.shard_of([p.data for p in params]), b.shard_of([opt.state[p]["exp_avg"] for p in params]),
                    b.shard_of([opt.state[p]["exp_avg_sq"] for p in params])]
            largest = 4 * b.shard_numel
        else:
            mine = [getattr(sh, k) for sh in opt.state_shards() for k in ckpt.TENSORS]
            largest = 0
        path = root / stage
        with PeakRSS() as peak, WireCounter() as wire:
            ckpt.save(path, model, opt)
        written = (path / rank_file(rank)).read_bytes()
        expected = b"".join(t.contiguous().numpy().tobytes() for t in mine)
        out[stage] = {"peak": peak.bytes, "wrote": wire.sent_bytes, "file": len(written),
                      "own_bytes": written == expected, "allowed_peak": largest + SLACK}
    return out


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep")
    results = run_ranks(_save_deep, 3, root, timeout=120)
    shutil.rmtree(root / "warm-up")
    return root, results


@pytest.mark.timeout(150)
def test_each_rank_writes_only_its_own_shards(deep):
    root, results = deep
    psi = sum(p.numel() for p in OddMLP(DEEP).parameters())
    for stage in STAGES:
        path = root / stage
        meta = json.loads((path / "metadata.json").read_text())
        assert sorted(os.listdir(path)) == ["COMPLETE", "metadata.json", *[rank_file(r) for r in range(3)],
                                            "replicated.bin"]
        assert (meta["format"], meta["version"], meta["world_size"], meta["stage"]) == ("zerokit-checkpoint", 1, 3, stage)
        assert meta["param_groups"][0]["lr"] == LR and meta["param_groups"][0]["weight_decay"] == WD
        named = dict(OddMLP(DEEP).named_parameters())
        a = align()
        for b in meta["buckets"]:
            offset = 0
            for p in b["params"]:  # true offsets in each bucket: each parameter at the next aligned place
                offset = ceil_div(offset, a) * a
                assert p["offset"] == offset and p["shape"] == list(named[p["name"]].shape) and p["step"] == 1
                offset += named[p["name"]].numel()
            assert offset == b["numel"]
            assert b["shard_numel"] == ceil_div(ceil_div(b["numel"], 3), a) * a  # ceil(numel / N), aligned
        shards = sum(b["shard_numel"] for b in meta["buckets"])
        n_params = sum(len(b["params"]) for b in meta["buckets"])
        meta_bytes = (path / "metadata.json").stat().st_size
        for rank, r in enumerate(results):
            m = r[stage]
            assert m["own_bytes"], f"{stage}: rank {rank}'s file is not exactly its own shards"
            assert m["file"] == 12 * shards  # (K + P) Ψ / N in fp32, K = 8, P = 4, + padding
            assert m["file"] < 12 * (psi + padding_bound(n_params, len(meta["buckets"]), 3)) / 3
            # a rank writes its file, and little else (rank 0: the metadata; all: four tiny agreements)
            extra = m["wrote"] - m["file"] - (meta_bytes if rank == 0 else 0)
            assert 0 <= extra <= 64 * 1024, (stage, rank, m)
            assert m["peak"] <= m["allowed_peak"], (stage, rank, m)
        print(f"\n{stage}: {meta['world_size']} ranks, Ψ = {psi}: {results[0][stage]['file']} B per rank file "
              f"(12Ψ/N = {12 * psi / 3:.0f}); peak while saving per rank: "
              f"{[r[stage]['peak'] for r in results]} B")


# ---------------------------------------------------------------------------------------
# exact resume at the same world size: every stage, every precision


PRECISIONS = {"fp32": None, "bf16": zerokit.MixedPrecision("bf16"),
              "fp16": zerokit.MixedPrecision("fp16", init_scale=2.0**20, growth_interval=2)}
RESUME_AT, RESUME_STEPS = 3, 3


def _scaler_state(opt):
    scaler = getattr(opt.precision, "scaler", None)
    return None if scaler is None else (scaler.scale, scaler.clean_steps, scaler.skipped_steps)


def _resume(rank, world, root, phase):
    """phase: "uninterrupted", "saved" (after RESUME_AT steps), or "resumed" (load, then the rest)."""
    out = {}
    for stage in STAGES:
        for prec, precision in PRECISIONS.items():
            model = new_model("edge", seed=0 if phase != "resumed" else 7)  # resumed: the load must overwrite it
            opt = make_opt(stage, model, precision)
            path = root / f"{stage}-{prec}"
            loaded = None
            if phase == "resumed":
                ckpt.load(path, model, opt)
                loaded = (held(model, opt), _scaler_state(opt))
                train("edge", model, opt, RESUME_STEPS, RESUME_AT, rank, world)
            else:
                train("edge", model, opt, RESUME_AT, 0, rank, world)
                if phase == "saved":
                    ckpt.save(path, model, opt)
                    out[stage, prec] = (held(model, opt), _scaler_state(opt))
                    continue
                train("edge", model, opt, RESUME_STEPS, RESUME_AT, rank, world)
            out[stage, prec] = (weights(model, opt), held(model, opt), _scaler_state(opt), loaded)
    return out


@pytest.mark.timeout(150)
def test_resume_is_bit_identical(tmp_path):
    uninterrupted = run_ranks(_resume, 2, tmp_path, "uninterrupted")
    saved = run_ranks(_resume, 2, tmp_path, "saved")
    resumed = run_ranks(_resume, 2, tmp_path, "resumed")
    elsewhere = run_ranks(_resume, 3, tmp_path, "resumed")  # the same checkpoints, on 3 ranks
    reference, _, _ = adamw_reference("edge", RESUME_AT + RESUME_STEPS, BATCH, lr=LR, weight_decay=WD)
    shapes = {n: list(p.shape) for n, p in new_model("edge").named_parameters() if p.requires_grad}
    for key in uninterrupted[0]:
        # on 3 ranks: the state as loaded is bit for bit what the 2 ranks held, the loss scaler too
        truth = assemble([saved[r][key][0][0] for r in range(2)], shapes)
        for rank in range(3):
            (pieces, steps), scaler = elsewhere[rank][key][3]
            assert_pieces_equal(pieces, truth, f"{key} saved on 2, loaded on 3")
            assert steps == saved[0][key][0][1] and scaler == saved[0][key][1], key
        if key[1] == "fp32":  # and what follows differs by the sums' order only
            assert max_diff(elsewhere[0][key][0], uninterrupted[0][key][0]) <= 1e-6, key
        for rank in range(2):
            (w0, (p0, s0), sc0, _), (w1, (p1, s1), sc1, _) = uninterrupted[rank][key], resumed[rank][key]
            assert max_diff(w0, w1) == 0.0, key  # the model every rank computes with
            for (n, lo, hi, a), (_, _, _, b) in zip(p0, p1):  # master weights, m, v
                assert all(torch.equal(a[k], b[k]) for k in a), (key, n)
            assert s0 == s1 and sc0 == sc1, (key, s0, s1, sc0, sc1)  # step counts; scale and growth counter
        if key[1] == "fp32":  # and the numbers are AdamW's
            assert max_diff(resumed[0][key][0], reference[-1]) < 1e-5, key
    assert uninterrupted[0][("zero2", "fp16")][2][0] != 2.0**20, "the fp16 runs never changed their loss scale"


# ---------------------------------------------------------------------------------------
# resharding: every N -> N' in 1..4, every stage -> every stage


SAVE_STEPS, MORE_STEPS = 3, 2


def _reshard_save(rank, world, root):
    out = {}
    for stage in STAGES:
        model = new_model("edge")
        opt = make_opt(stage, model)
        train("edge", model, opt, SAVE_STEPS, 0, rank, world)
        ckpt.save(root / f"{world}-{stage}", model, opt)
        pieces = held(model, opt)
        train("edge", model, opt, MORE_STEPS, SAVE_STEPS, rank, world)
        out[stage] = (pieces, weights(model, opt))
    return out


def _load_and_check(path, target, state, steps, label, rank, world):
    """Load `path` into a fresh model and `target` optimizer: (what differs from the saved state and step
    counts, or None; the weights after MORE_STEPS more steps)."""
    model = new_model("edge", seed=11)
    opt = make_opt(target, model)
    ckpt.load(path, model, opt)
    pieces, loaded_steps = held(model, opt)
    problem = None
    try:
        assert_pieces_equal(pieces, state, label)
        assert loaded_steps == steps, "step counts"
    except AssertionError as exc:
        problem = str(exc)
    train("edge", model, opt, MORE_STEPS, SAVE_STEPS, rank, world)
    return problem, weights(model, opt)


def _reshard_load(rank, world, root, truth):
    problems, worst = [], 0.0
    for (n, source), (state, steps, after) in truth.items():
        # over the 16 (N, N') pairs the rotation pairs every stage with every stage 4 times; at N' = N
        # each stage also loads into itself, which must be bit-identical
        rotated = STAGES[(STAGES.index(source) + n + world) % 4]
        for target in sorted({rotated, source} if n == world else {rotated}):
            problem, got = _load_and_check(root / f"{n}-{source}", target, state, steps,
                                           f"{n} x {source} -> {world} x {target}", rank, world)
            problems += [problem] if problem else []
            diff = max_diff(got, after)
            if n == world and source == target and diff != 0.0:
                problems.append(f"{n} x {source} -> itself: not bit-identical ({diff:.3g})")
            worst = max(worst, diff)
    return problems, worst


@pytest.mark.timeout(200)
def test_reshard_any_world_size_any_stage(tmp_path):
    shapes = {n: list(p.shape) for n, p in new_model("edge").named_parameters() if p.requires_grad}
    truth = {}
    for n in (1, 2, 3, 4):
        saved = run_ranks(_reshard_save, n, tmp_path)
        for stage in STAGES:
            per_rank = [r[stage][0] for r in saved]
            steps = per_rank[0][1]
            truth[n, stage] = (assemble([p for p, _ in per_rank], shapes), steps, saved[0][stage][1])
    worst = 0.0
    for world in (1, 2, 3, 4):
        for problems, diff in run_ranks(_reshard_load, world, tmp_path, truth, timeout=120):
            assert not problems, "\n".join(problems[:5])
            worst = max(worst, diff)
    print(f"\n(N, stage) -> (N', stage') for every N, N' in 1..4 and every pair of stages: the loaded state is "
          f"bit for bit what was saved; "
          f"{MORE_STEPS} more steps differ from the uninterrupted run by at most {worst:.2g}")
    assert worst <= 1e-6


# ---------------------------------------------------------------------------------------
# alignment: a checkpoint says where everything is, so layouts of another alignment load


ALIGNMENTS = (1, 128)  # 1: the layout zerokit wrote before it aligned (offsets end to end, S = ceil(numel / N))


def _save_aligned(rank, world, root):
    out = {}
    for align_bytes in ALIGNMENTS:
        for stage in ("zero1", "zero3"):
            model = new_model("edge")
            with aligned(align_bytes):
                opt = make_opt(stage, model)
            train("edge", model, opt, SAVE_STEPS, 0, rank, world)
            ckpt.save(root / f"{align_bytes}-{stage}", model, opt)
            pieces = held(model, opt)
            train("edge", model, opt, MORE_STEPS, SAVE_STEPS, rank, world)
            out[align_bytes, stage] = (pieces, weights(model, opt))
    return out


def _load_aligned(rank, world, root, truth):
    problems, worst = [], 0.0
    for (align_bytes, source), (state, steps, after) in truth.items():
        for target in ("zero2", "zero3"):  # zerokit's default alignment, other buckets, other N
            problem, got = _load_and_check(root / f"{align_bytes}-{source}", target, state, steps,
                                           f"{align_bytes} B {source} on 2 -> {target} on {world}", rank, world)
            problems += [problem] if problem else []
            worst = max(worst, max_diff(got, after))
    # the lesson's whole-shard map assumes shards of ceil(numel / N): refused on aligned layouts (offsets
    # that differ from the checkpoint's, or the same offsets in aligned shards), used on its own layout
    for align_bytes in ALIGNMENTS:
        model = new_model("edge", seed=11)
        with aligned(16 if align_bytes == 1 else align_bytes):
            opt = make_opt("zero1", model)
        try:
            ckpt.load(root / f"{align_bytes}-zero1", model, opt, reads=ckpt.shard_reads)
            problems.append(f"reads=shard_reads loaded a {align_bytes} B checkpoint into aligned shards")
        except CheckpointError as exc:
            if "aligned(1)" not in str(exc):
                problems.append(f"the refusal does not say what to do: {exc}")
    with aligned(1):
        opt = make_opt("zero1", model)
    ckpt.load(root / "1-zero1", model, opt, reads=ckpt.shard_reads)
    pieces, _ = held(model, opt)
    try:
        assert_pieces_equal(pieces, truth[1, "zero1"][0], "reads=shard_reads in the lesson's layout")
    except AssertionError as exc:
        problems.append(str(exc))
    return problems, worst


@pytest.mark.timeout(150)
def test_checkpoints_of_another_alignment_load(tmp_path):
    """Unaligned checkpoints (what zerokit wrote before it aligned its buffers; lesson 07's layout)
    and 128-byte aligned ones, saved on 2 ranks, load into zerokit's 16-byte layout on 3 ranks,
    bit for bit, and training goes on as if uninterrupted. The lesson's map (reads=shard_reads)
    is refused where the shards are aligned, and used where they are not."""
    shapes = {n: list(p.shape) for n, p in new_model("edge").named_parameters() if p.requires_grad}
    saved = run_ranks(_save_aligned, 2, tmp_path)
    truth = {}
    for key in saved[0]:
        per_rank = [r[key][0] for r in saved]
        truth[key] = (assemble([p for p, _ in per_rank], shapes), per_rank[0][1], saved[0][key][1])
    for align_bytes in ALIGNMENTS:
        meta = json.loads((tmp_path / f"{align_bytes}-zero1" / "metadata.json").read_text())
        offsets = [p["offset"] for p in meta["buckets"][0]["params"]]
        assert meta["version"] == 1 and all(4 * o % align_bytes == 0 for o in offsets)
        assert (offsets[1] == math.prod(meta["buckets"][0]["params"][0]["shape"])) == (align_bytes == 1)
    worst = 0.0
    for problems, diff in run_ranks(_load_aligned, 3, tmp_path, truth, timeout=120):
        assert not problems, "\n".join(problems[:5])
        worst = max(worst, diff)
    assert worst <= 1e-6


# ---------------------------------------------------------------------------------------
# consolidation and stream-load


def _consolidate_peak(rank, world, path):
    with PeakRSS():
        ckpt.consolidate(path)  # once before: the code's own pages are read in the first time (not data)
    with PeakRSS() as peak:
        state = ckpt.consolidate(path)
    return peak.bytes, {k: v.clone() for k, v in state.items()}


@pytest.mark.timeout(150)
def test_consolidate(deep, tmp_path):
    # a ZeRO-3 checkpoint of the edge model on 3 ranks: tied, frozen and unused parameters, a buffer
    model = new_model("edge")

    def save(rank, world, path):
        m = new_model("edge")
        opt = make_opt("zero3", m)
        train("edge", m, opt, 4, 0, rank, world)
        ckpt.save(path, m, opt)

    run_ranks(save, 3, tmp_path / "edge")
    state = ckpt.consolidate(tmp_path / "edge")
    plain = new_model("edge", seed=3)
    plain.load_state_dict(state)  # strict: every key, right shapes
    assert all(v.dtype == torch.float32 for v in state.values())
    assert state["head.weight"] is state["embed.weight"]  # a tied weight, once
    reference, _, _ = adamw_reference("edge", 4, BATCH, lr=LR, weight_decay=WD)
    assert max_diff({n: p.detach() for n, p in plain.named_parameters()}, reference[-1]) < 1e-5
    assert torch.equal(state["frozen.weight"], model.frozen.weight) and torch.equal(state["scale"], model.scale)

    # its peak, on the deep model: the output plus at most one parameter, not twice the model
    root, _ = deep
    peak, big = run_ranks(_consolidate_peak, 1, root / "zero3")[0]
    output = sum(t.numel() * 4 for t in big.values())
    largest = max(t.numel() * 4 for t in big.values())
    print(f"\nconsolidate: output {output} B, largest parameter {largest} B, peak {peak} B")
    assert output <= peak <= output + largest
    torch.manual_seed(0)
    OddMLP(DEEP).load_state_dict(big)


def _stream_load(rank, world, source):
    for attempt in ("once before: the code's own pages are read in the first time", "measured"):
        model = opt = None
        with PeakRSS() as peak:
            with torch.device("meta"):
                model = OddMLP(DEEP)  # no memory
            ckpt.placeholders(model)
            opt = zerokit.ZeRO3Adam(model, lr=LR, weight_decay=WD)  # allocates this rank's shards
            ckpt.stream_load(source, model, opt)
    shards = sum(t.numel() * t.element_size() for sh in opt.state_shards() for t in
                 (sh.weights, sh.exp_avg, sh.exp_avg_sq))
    unit = max(sh.bucket.numel * 4 for sh in opt.state_shards())
    loaded = weights(model, opt)
    train("mlp", model, opt, 2, 0, rank, world)
    return peak.bytes, shards, unit, loaded, weights(model, opt)


@pytest.mark.timeout(150)
def test_stream_load(deep, tmp_path):
    root, _ = deep
    state = ckpt.consolidate(root / "zero3")
    torch.save(state, tmp_path / "full.pt")
    results = run_ranks(_stream_load, 2, tmp_path / "full.pt")
    torch.manual_seed(0)
    one = OddMLP(DEEP)
    one.load_state_dict(state)
    opt = torch.optim.AdamW(one.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for step in range(2):
        x, y = batch("mlp", step, BATCH)
        loss_for("mlp", one(x), y).backward()
        opt.step()
        opt.zero_grad()
    model_bytes = sum(t.numel() * 4 for t in state.values())
    for rank, (peak, shards, unit, loaded, trained) in enumerate(results):
        assert max_diff(loaded, state) == 0.0
        # the same numbers (a wide layer sums its gradient in another order on 2 ranks: 1e-4)
        assert max_diff(trained, {n: p.detach() for n, p in one.named_parameters()}) < 1e-4
        print(f"\nstream-load rank {rank}: peak {peak} B; its shards {shards} B + one unit {unit} B "
              f"(the whole model: {model_bytes} B)")
        assert peak <= shards + unit, (peak, shards, unit)


# ---------------------------------------------------------------------------------------
# safety: a killed save leaves the last checkpoint; a refused load changes nothing


def _kill_during_save(rank, world, path):
    model = new_model("edge")
    opt = make_opt("zero2", model)
    train("edge", model, opt, 2, 0, rank, world)
    ckpt.save(path, model, opt)
    train("edge", model, opt, 1, 2, rank, world)
    if rank == 1:
        def dies_halfway(file, tensors):
            with open(file, "wb") as f:
                f.write(b"\0" * 100)
            os._exit(3)

        ckpt.write_tensors = dies_halfway
    ckpt.save(path, model, opt)


def _refusals(rank, world, good, bad):
    model = new_model("edge", seed=5)
    opt = make_opt("zero2", model)
    train("edge", model, opt, 1, 0, rank, world)
    before = (weights(model, opt), held(model, opt))
    messages = {}
    for name, path in bad.items():
        try:
            ckpt.load(path, model, opt)
            messages[name] = None
        except CheckpointError as exc:
            messages[name] = str(exc)
        after = (weights(model, opt), held(model, opt))
        assert max_diff(before[0], after[0]) == 0.0, f"{name}: the model changed"
        assert all(torch.equal(a[3][k], b[3][k]) for a, b in zip(before[1][0], after[1][0]) for k in a[3]), name
        assert before[1][1] == after[1][1], name
    ckpt.load(good, model, opt)
    return messages, held(model, opt)


@pytest.mark.timeout(150)
def test_killed_save_and_refused_loads(tmp_path):
    good = tmp_path / "good"
    with pytest.raises(LaunchError, match="rank 1"):
        run_ranks(_kill_during_save, 2, good)
    assert (tmp_path / "good.partial").exists()  # the unfinished save, set aside
    digest = files_digest(good)

    def save_other(rank, world, path):
        torch.manual_seed(0)
        m = OddMLP((27, 36, 7))
        ckpt.save(path, m, make_opt("zero2", m))

    run_ranks(save_other, 2, tmp_path / "other")
    shutil.copytree(good, tmp_path / "v99")
    meta = json.loads((tmp_path / "v99" / "metadata.json").read_text())
    (tmp_path / "v99" / "metadata.json").write_text(json.dumps({**meta, "version": 99}))
    shutil.copytree(good, tmp_path / "truncated")
    with open(tmp_path / "truncated" / rank_file(1), "r+b") as f:
        f.truncate(12)
    shutil.copytree(good, tmp_path / "unmarked")
    (tmp_path / "unmarked" / "COMPLETE").unlink()
    bad = {"unfinished": tmp_path / "good.partial", "other model": tmp_path / "other",
           "version": tmp_path / "v99", "truncated": tmp_path / "truncated", "no marker": tmp_path / "unmarked",
           "nothing": tmp_path / "nowhere"}
    expected = {"unfinished": "incomplete", "other model": "another model?", "version": "format version 99",
                "truncated": "should hold", "no marker": "incomplete", "nothing": "no checkpoint"}
    results = run_ranks(_refusals, 2, good, bad)
    for name, fragment in expected.items():
        said = [r[0][name] for r in results]
        assert said[0] is not None and said[0] == said[1], (name, said)  # every rank, one message
        assert fragment in said[0] and "\n" not in said[0], (name, said[0])
    assert files_digest(good) == digest  # the killed save never touched the last checkpoint
    shapes = {n: list(p.shape) for n, p in new_model("edge").named_parameters() if p.requires_grad}

    def saved_state(rank, world, path):
        model = new_model("edge")
        opt = make_opt("zero2", model)
        train("edge", model, opt, 2, 0, rank, world)
        return held(model, opt)[0]

    truth = assemble(run_ranks(saved_state, 2, good), shapes)
    for _, (pieces, _) in results:
        assert_pieces_equal(pieces, truth, "the checkpoint saved before the killed save")


# ---------------------------------------------------------------------------------------
# interoperability: PyTorch Distributed Checkpoint, FSDP2 and torch's AdamW


FSDP2 = ("torch", "zerokit")  # torch's fully_shard and zerokit's: the same DTensor parameters, the same recipe


def _fsdp(rank, world, load_from, save_to, start, steps):
    """Each FSDP2 in turn (FSDP2): the edge model sharded by fully_shard, torch's AdamW; from the DCP checkpoint
    `load_from` (PyTorch's own recipe, unchanged) or from step 0; trained; saved to `save_to / impl` with DCP.
    {impl: the full weights}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    out = {}
    for impl in FSDP2:
        model = new_model("edge", seed=9 if load_from else 0)
        (torch_fully_shard if impl == "torch" else zerokit.fully_shard)(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
        if load_from:
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=load_from)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train("edge", model, opt, steps, start, rank, world)
        if save_to:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=save_to / impl)
        out[impl] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                     for n, p in model.named_parameters()}
    return out


def _zerokit_side(rank, world, load_from, save_to, start, steps):
    """ZeRO-3 from step 0, saved to `save_to`; or ZeRO-2 from each checkpoint of `load_from` ({name: path}):
    {name: the full weights}."""
    out = {}
    for name, path in (load_from or {None: None}).items():
        model = new_model("edge", seed=9 if path else 0)
        opt = make_opt("zero3" if save_to else "zero2", model)
        if path:
            ckpt.load(path, model, opt)
        train("edge", model, opt, steps, start, rank, world)
        if save_to:
            ckpt.save(save_to, model, opt)
        out[name] = weights(model, opt)
    return out


@pytest.mark.timeout(150)
def test_dcp_interop_with_fsdp2(tmp_path):
    """zerokit's checkpoint to DCP, loaded by torch's fully_shard and by zerokit's with PyTorch's recipe; each of
    them saved with DCP, converted, loaded into ZeRO-2. The two FSDP2s are one arithmetic (lesson 12): after the
    same checkpoint and steps their weights are equal bit for bit, and so are the ZeRO-2 runs their checkpoints
    start."""
    from zerokit.checkpoint.dcp import from_dcp, to_dcp

    reference, _, _ = adamw_reference("edge", 5, BATCH, lr=LR, weight_decay=WD)
    # zerokit (ZeRO-3) saves after 3 steps -> DCP -> each FSDP2 + torch AdamW resumes for 2
    run_ranks(_zerokit_side, 2, None, tmp_path / "zk", 0, 3)
    to_dcp(tmp_path / "zk", tmp_path / "dcp")
    fsdp = run_ranks(_fsdp, 2, tmp_path / "dcp", None, 3, 2)[0]
    # each FSDP2 saves after 3 steps -> zerokit (ZeRO-2) resumes for 2
    run_ranks(_fsdp, 2, None, tmp_path / "fsdp", 0, 3)
    for impl in FSDP2:
        from_dcp(tmp_path / "fsdp" / impl, tmp_path / f"zk2-{impl}", new_model("edge"))
    zk = run_ranks(_zerokit_side, 2, {impl: tmp_path / f"zk2-{impl}" for impl in FSDP2}, None, 3, 2)[0]
    for impl in FSDP2:
        print(f"\nDCP, {impl}'s fully_shard: zerokit -> FSDP2 {max_diff(fsdp[impl], reference[-1]):.2g}, FSDP2 -> "
              f"zerokit {max_diff(zk[impl], reference[-1]):.2g} from one-process AdamW after 5 steps")
        assert max_diff(fsdp[impl], reference[-1]) < 1e-5 and max_diff(zk[impl], reference[-1]) < 1e-5, impl
        assert max_diff(fsdp[impl], zk[impl]) <= 1e-6, impl
    assert max_diff(fsdp["zerokit"], fsdp["torch"]) == 0.0 and max_diff(zk["zerokit"], zk["torch"]) == 0.0
