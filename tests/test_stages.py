"""Every stage against one process running torch.optim.AdamW on the whole batch.

For each stage and N in (2, 3, 4), ONE launch runs every scenario and returns its numbers:
- 50 steps on "mlp" (OddMLP) and on "edge" (EdgeCaseNet: tied, frozen and unused
  parameters) with weight_decay 0.1, each rank on its own slice of the global batch; the
  parameters of every rank are compared with the reference after EVERY step, and at the
  end Adam's m, v and step counts (each rank's shard, placed by its segments) with
  torch.optim.AdamW's state;
- the stage's point: ZeRO-1 state per rank is 1/N, ZeRO-2 frees every .grad and keeps
  Ψ/N of reduced gradient, ZeRO-3 leaves every trainable parameter empty at rest and
  `opt.gathered()` brings back the full shapes;
- clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on one process;
- ZeRO-2 gradient accumulation over 3 micro-batches, with and without no_sync(), against
  the reference and each other, counting the reduce-scatters with zerokit.CommCounter.

Measured on this machine (2 CPU cores, torch 2.13): max abs diff to the reference over all
steps, ranks and parameters is ~1e-7 to 4e-7 for every stage, model and N; the tolerance
is 1e-5 (fp32 sums of N partial gradients in a different order, through 50 Adam steps).
Bitwise equality cannot hold here: each rank's gradient comes from its own slice of the
batch, and the sum of N partial gradients rounds differently from one backward over the
whole batch (and at N = 3 even the mean of 3 identical values is inexact: x + x + x rounds).
With identical data on 2 ranks every stage is bitwise the reference: tests/test_bitwise.py.
"""

import functools

import pytest
import torch

import zerokit
from conftest import (adamw_reference, align, batch, ceil_div, max_diff, new_model, padding_bound, poison_scratch,
                      rank_slice, run_ranks)
from zerokit.models import loss_for

STEPS = 50
LR, WD = 1e-2, 0.1
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4
TOL = 1e-5
BUCKET_NUMEL = 250  # ZeRO-2: 4 buckets on OddMLP, 6 on EdgeCaseNet
CLIP, CLIP_STEPS = 0.55, 10
ACC_STEPS, ACC_MICRO, ACC_PER_RANK = 4, 3, 6  # 3 micro-batches of 2 samples per rank per step
STAGES = ("ddp", "zero1", "zero2", "zero3")
WORLD_SIZES = (2, 3, 4)
KINDS = ("mlp", "edge")


def make_opt(stage, model, weight_decay=WD):
    if stage == "ddp":
        return zerokit.DistributedAdam(model.parameters(), lr=LR, weight_decay=weight_decay)
    if stage == "zero1":
        return zerokit.ZeRO1Adam(model.parameters(), lr=LR, weight_decay=weight_decay)
    if stage == "zero2":
        return zerokit.ZeRO2Adam(model.parameters(), lr=LR, weight_decay=weight_decay,
                                 bucket_mb=BUCKET_NUMEL * 4 / 2**20)
    return zerokit.ZeRO3Adam(model, lr=LR, weight_decay=weight_decay)


# --------------------------------------------------------------------------------------
# what runs on each rank


def full_params(stage, model, opt, shapes):
    """{name: tensor} of the full parameters; for ZeRO-3 inside opt.gathered()."""
    if stage != "zero3":
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.gathered():
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert {n: t.shape for n, t in got.items()} == shapes, "gathered() did not restore the full shapes"
    return got


def trainable_numels(model):
    return [p.numel() for p in model.parameters() if p.requires_grad]


def sharded_state(model, opt):
    """Each bucket's m, v, step counts and the segments that place them in the parameters."""
    name_of = {p: n for n, p in model.named_parameters()}
    out = []
    for bucket, st in zip(opt.buckets, opt.shards):
        out.append({
            "names": [name_of[p] for p in bucket.params],
            "numel": bucket.numel, "param_numel": sum(p.numel() for p in bucket.params),
            "exp_avg": st.exp_avg.clone(), "exp_avg_sq": st.exp_avg_sq.clone(), "steps": list(st.steps),
            "segments": [(s.index, s.shard_lo, s.shard_hi, s.param_lo, s.param_hi) for s in bucket.segments],
        })
    return out


def trajectory(rank, world_size, stage, kind):
    # mlp: every rank starts from different random weights; the optimizer must broadcast
    # rank 0's (the reference's, seed 0). edge: the same seed everywhere, since its frozen
    # parameter is not trainable state and the stages leave it alone.
    model = new_model(kind, seed=rank if kind == "mlp" else 0)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = make_opt(stage, model)
    rec = {"snaps": [], "grads_after_backward": [], "max_numel_at_rest": 0, "grad_shard_numels": []}
    if stage == "zero3":
        rec["max_numel_at_rest"] = max(trainable_numels(model))  # right after construction
        rec["frozen_full"] = all(p.shape == shapes[n] for n, p in model.named_parameters() if not p.requires_grad)
    for step in range(STEPS):
        x, y = batch(kind, step, GLOBAL_BATCH)
        loss = loss_for(kind, model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
        loss.backward()
        if stage in ("zero2", "zero3"):
            rec["grads_after_backward"].append([n for n, p in trainable if p.grad is not None])
            rec["grad_shard_numels"].append([None if g is None else g.numel() for g in opt.grad_shards])
        if stage == "zero3":
            rec["max_numel_at_rest"] = max(rec["max_numel_at_rest"], *trainable_numels(model))
        opt.step()
        opt.zero_grad()
        if stage == "zero3":
            rec["max_numel_at_rest"] = max(rec["max_numel_at_rest"], *trainable_numels(model))
        rec["snaps"].append(full_params(stage, model, opt, shapes))
        if stage == "zero3":  # and empty again after gathered()
            rec["max_numel_at_rest"] = max(rec["max_numel_at_rest"], *trainable_numels(model))
    if stage == "ddp":
        name_of = {p: n for n, p in model.named_parameters()}
        rec["state"] = {name_of[p]: {"exp_avg": s["exp_avg"].clone(), "exp_avg_sq": s["exp_avg_sq"].clone(),
                                     "step": int(s["step"])} for p, s in opt.state.items()}
    else:
        rec["state"] = sharded_state(model, opt)
        rec["torch_state_entries"] = len(opt.state)  # no full-size per-parameter state
        rec["bucket_numels"] = [b.numel for b in opt.buckets]
    return rec


def clipped_trajectory(rank, world_size, stage):
    model = new_model("mlp")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    opt = make_opt(stage, model)
    norms, snaps = [], []
    for step in range(CLIP_STEPS):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        loss_for("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        snaps.append(full_params(stage, model, opt, shapes))
    return {"norms": norms, "snaps": snaps}


def accumulation(rank, world_size, use_no_sync):
    """ZeRO-2, ACC_MICRO micro-batches per step; each micro-batch loss divided by ACC_MICRO."""
    model = new_model("mlp")
    opt = make_opt("zero2", model)
    snaps, reduce_scatters, kept_grads, freed = [], [], [], []
    micro = ACC_PER_RANK // ACC_MICRO
    for step in range(ACC_STEPS):
        x, y = batch("mlp", step, ACC_PER_RANK * world_size)
        x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        with zerokit.CommCounter() as comm:
            for k in range(ACC_MICRO):
                xs, ys = x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]
                last = k == ACC_MICRO - 1
                if use_no_sync and not last:
                    with opt.no_sync():
                        (loss_for("mlp", model(xs), ys) / ACC_MICRO).backward()
                    kept_grads.append(all(p.grad is not None for p in model.parameters()))
                else:
                    (loss_for("mlp", model(xs), ys) / ACC_MICRO).backward()
                    freed.append(all(p.grad is None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        reduce_scatters.append(comm.count("reduce_scatter"))
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"snaps": snaps, "reduce_scatters": reduce_scatters, "buckets": len(opt.buckets),
            "kept_grads": kept_grads, "freed": freed}


def clip_then_skip(rank, world_size, stage):
    """step 1; step 2 clipped, then skipped (zero_grad instead of step, as after an overflow);
    step 3 a plain step. The skipped gradient must play no part in step 3."""
    model = new_model("mlp")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    opt = make_opt(stage, model)
    for step in range(3):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        loss_for("mlp", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
        if step == 1:
            opt.clip_grad_norm_(CLIP)
        else:
            opt.step()
        opt.zero_grad()
    return full_params(stage, model, opt, shapes)


def stage_worker(rank, world_size, stage):
    poison_scratch()  # a gradient buffer's unwritten part (an unused parameter's) must never be read
    out = {kind: trajectory(rank, world_size, stage, kind) for kind in KINDS}
    out["clip"] = clipped_trajectory(rank, world_size, stage)
    out["clip_skip"] = clip_then_skip(rank, world_size, stage)
    if stage == "zero2":
        out["accum_no_sync"] = accumulation(rank, world_size, True)
        out["accum_every"] = accumulation(rank, world_size, False)
    return out


# --------------------------------------------------------------------------------------
# references (one process, torch.optim.AdamW) and the checks


@functools.lru_cache(maxsize=None)
def reference(kind):
    return adamw_reference(kind, STEPS, GLOBAL_BATCH, lr=LR, weight_decay=WD)


@functools.lru_cache(maxsize=None)
def clip_reference():
    return adamw_reference("mlp", CLIP_STEPS, GLOBAL_BATCH, lr=LR, weight_decay=WD, clip=CLIP)


@functools.lru_cache(maxsize=None)
def clip_skip_reference():
    """AdamW on the batches of steps 1 and 3 only (step 2 was skipped)."""
    model = new_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for step in (0, 2):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        loss_for("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def accumulation_reference(world_size):
    return adamw_reference("mlp", ACC_STEPS, ACC_PER_RANK * world_size, lr=LR, weight_decay=WD)


@functools.lru_cache(maxsize=None)
def results(stage, world_size):
    return run_ranks(stage_worker, world_size, stage, timeout=120)


MEASURED = {}  # (stage, N, scenario) -> max abs diff, printed at the end (pytest -s)


def check_trajectory(snaps_per_rank, ref_snaps, label):
    worst = 0.0
    for rank, snaps in enumerate(snaps_per_rank):
        assert len(snaps) == len(ref_snaps)
        for step, (got, want) in enumerate(zip(snaps, ref_snaps)):
            d = max_diff(got, want)
            assert d <= TOL, f"{label}: rank {rank} step {step + 1}: max abs diff {d:.3e} > {TOL}"
            worst = max(worst, d)
    MEASURED[label] = worst
    return worst


def assemble_sharded_state(states_per_rank, model_kind, world_size, label):
    """Reassemble m and v (flat, per trainable parameter) from every rank's shards, checking
    that each rank holds 1/N of them and each element is owned exactly once. Also returns each
    parameter's step counts, one per rank: {name: [step on rank 0, ...]}."""
    model = new_model(model_kind)
    numel = {n: p.numel() for n, p in model.named_parameters()}
    m = {n: torch.zeros(k) for n, k in numel.items()}
    v = {n: torch.zeros(k) for n, k in numel.items()}
    owned = {n: torch.zeros(k, dtype=torch.int64) for n, k in numel.items()}
    steps = {}
    for rank, buckets in enumerate(states_per_rank):
        for b in buckets:
            # 1/N: ceil(numel / N), rounded up to the alignment (zerokit.flat)
            size = b["exp_avg"].numel()
            assert ceil_div(b["numel"], world_size) <= size < ceil_div(b["numel"], world_size) + align(), (
                label, "state is not 1/N")
            assert size % align() == 0, (label, "a shard that does not keep the next one aligned")
            for i, name in enumerate(b["names"]):
                steps.setdefault(name, []).append(b["steps"][i])
            for index, s_lo, s_hi, p_lo, p_hi in b["segments"]:
                name = b["names"][index]
                m[name][p_lo:p_hi] = b["exp_avg"][s_lo:s_hi]
                v[name][p_lo:p_hi] = b["exp_avg_sq"][s_lo:s_hi]
                owned[name][p_lo:p_hi] += 1
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    for name in trainable:
        assert owned[name].eq(1).all(), f"{label}: {name} not owned by exactly one rank"
    return {n: m[n] for n in trainable}, {n: v[n] for n in trainable}, steps


def reference_flat_state(ref_state, name, numel):
    """torch.optim.AdamW's (step, m, v) of one parameter, m and v flat; (0, zeros, zeros) if it
    has no state (an unused parameter is never stepped)."""
    if name not in ref_state:
        return 0, torch.zeros(numel), torch.zeros(numel)
    s = ref_state[name]
    return s["step"], s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1)


def check_sharded_state(states_per_rank, ref_state, model_kind, world_size, label):
    """m, v and step counts from every rank's shards against torch.optim.AdamW's."""
    m, v, steps = assemble_sharded_state(states_per_rank, model_kind, world_size, label)
    for name in m:
        want_step, want_m, want_v = reference_flat_state(ref_state, name, m[name].numel())
        assert steps[name] == [want_step] * world_size, (label, name, steps[name], want_step)
        torch.testing.assert_close(m[name], want_m, rtol=1e-4, atol=1e-6, msg=f"{label} exp_avg {name}")
        torch.testing.assert_close(v[name], want_v, rtol=1e-4, atol=1e-8, msg=f"{label} exp_avg_sq {name}")


def check_stage(stage, world_size):
    n = world_size
    res = results(stage, n)
    assert len(res) == n
    for kind in KINDS:
        label = f"{stage} N={n} {kind}"
        ref_snaps, ref_state, _ = reference(kind)
        check_trajectory([r[kind]["snaps"] for r in res], ref_snaps, label)
        if kind == "edge":
            # the edge cases behaved as on one process: frozen and unused parameters untouched
            start = {k: t for k, t in new_model("edge").named_parameters()}
            last = res[0][kind]["snaps"][-1]
            for name in ("frozen.weight", "frozen.bias", "unused.weight"):
                assert torch.equal(last[name], start[name].detach()), f"{label}: {name} changed"
            assert "head.weight" not in last  # tied: one parameter, reported once
        if stage == "ddp":
            for r in res:
                for name, s in ref_state.items():
                    got = r[kind]["state"][name]
                    assert got["step"] == s["step"]
                    torch.testing.assert_close(got["exp_avg"], s["exp_avg"], rtol=1e-4, atol=1e-6)
                    torch.testing.assert_close(got["exp_avg_sq"], s["exp_avg_sq"], rtol=1e-4, atol=1e-8)
                assert set(r[kind]["state"]) == set(ref_state)  # unused: no state, as in AdamW
            continue
        check_sharded_state([r[kind]["state"] for r in res], ref_state, kind, n, label)
        model = new_model(kind)
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for rank, r in enumerate(res):
            rec = r[kind]
            assert rec["torch_state_entries"] == 0, f"{label}: full per-parameter state in opt.state"
            state_numel = sum(b["exp_avg"].numel() for b in rec["state"])
            # ZeRO-1 and up: m (and v) hold Ψ/N elements per rank, plus the padding: under one alignment
            # per parameter and per shard (zerokit.flat), divided among the N ranks
            slack = padding_bound(len(trainable_numels(model)), len(rec["state"]), n) / n
            assert psi / n <= state_numel < psi / n + slack, (label, rank, state_numel, psi)
            if stage == "zero2":
                assert len(rec["bucket_numels"]) >= 4, f"{label}: expected several buckets"
                for b in rec["state"]:  # the cap (the parameters' elements) holds, but for a parameter alone
                    assert b["param_numel"] <= BUCKET_NUMEL or len(b["names"]) == 1, (label, b["names"], b["numel"])
            if stage in ("zero2", "zero3"):
                assert rec["grads_after_backward"] == [[]] * STEPS, (
                    f"{label} rank {rank}: .grad kept after backward: {rec['grads_after_backward'][0]}")
                want = [b["exp_avg"].numel() for b in rec["state"]]  # the shards, as m's (checked above)
                for numels in rec["grad_shard_numels"]:
                    assert numels == want, (label, numels, want)  # one reduced shard per bucket
                    assert psi / n <= sum(numels) < psi / n + slack
            if stage == "zero3":
                assert rec["max_numel_at_rest"] == 0, f"{label}: a parameter kept its data at rest"
                assert rec["frozen_full"]
    # clipping
    ref_snaps, _, ref_norms = clip_reference()
    assert any(x > CLIP for x in ref_norms) and any(x <= CLIP for x in ref_norms)  # both branches
    label = f"{stage} N={n} clip"
    check_trajectory([r["clip"]["snaps"] for r in res], ref_snaps, label)
    for r in res:
        assert r["clip"]["norms"] == pytest.approx(ref_norms, rel=1e-5), label


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_stage_matches_single_process_adamw(stage, world_size):
    check_stage(stage, world_size)
    print(" ".join(f"{k}: {v:.2e}" for k, v in MEASURED.items() if k.startswith(f"{stage} N={world_size} ")))


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero2_gradient_accumulation(world_size):
    """no_sync(): one reduce-scatter per bucket per step instead of one per micro-batch,
    the same result, and the same result as one process on the whole batch."""
    n = world_size
    res = results("zero2", n)  # cached: the same launch as the zero2 trajectory test
    ref_snaps, _, _ = accumulation_reference(n)
    for path in ("accum_no_sync", "accum_every"):
        check_trajectory([r[path]["snaps"] for r in res], ref_snaps, f"zero2 N={n} {path}")
    for r in res:
        a, b = r["accum_no_sync"], r["accum_every"]
        nb = a["buckets"]
        assert nb >= 2
        assert a["reduce_scatters"] == [nb] * ACC_STEPS  # once per bucket per step
        assert b["reduce_scatters"] == [ACC_MICRO * nb] * ACC_STEPS  # once per bucket per micro-batch
        assert all(a["kept_grads"]) and len(a["kept_grads"]) == ACC_STEPS * (ACC_MICRO - 1)
        assert all(a["freed"]) and all(b["freed"])
        d = max(max_diff(x, y) for x, y in zip(a["snaps"], b["snaps"]))
        MEASURED[f"zero2 N={n} no_sync vs every"] = d
        assert d <= TOL
    print(" ".join(f"{k}: {v:.2e}" for k, v in MEASURED.items() if k.startswith(f"zero2 N={n} ")))


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", STAGES)
def test_clip_then_skipped_step_discards_the_gradient(stage):
    """backward, clip_grad_norm_, zero_grad() without step() (a skipped step, as a loss-scaler
    overflow makes), then backward and step(): the step must use the new gradient only,
    as torch.optim.AdamW + torch.nn.utils.clip_grad_norm_ do on one process."""
    want = clip_skip_reference()
    for world_size in WORLD_SIZES:
        res = results(stage, world_size)  # cached: the same launch as the trajectory test
        d = max(max_diff(r["clip_skip"], want) for r in res)
        MEASURED[f"{stage} N={world_size} clip_skip"] = d
        assert d <= TOL, (f"{stage} N={world_size}: after a clipped-then-skipped step the next step is "
                          f"off by {d:.3e} (max abs): what clip_grad_norm_ left behind survived zero_grad()")
