"""Mixed precision (lesson 06): 16-bit weights and gradients, fp32 master weights and Adam
state, dynamic loss scaling with a global overflow skip, for every stage on 2 ranks.

Three launches, each returning numbers that the tests below check:
- training: the small transformer memorises one batch for STEPS steps with every stage in
  bf16 and in fp16 (loss scaling), and with clipping; losses, gradient norms and the norm
  of Adam's m are compared with one process running torch.optim.AdamW in fp32. A variant
  that multiplies the gradient by the loss scale instead of dividing must fail the check;
- overflow: an inf planted in one gradient element on rank 1 only, in the element that
  rank 0's shard holds (so with ZeRO only rank 0 sees it after the reduce-scatter), must
  skip exactly that step on every rank and halve the loss scale on every rank. Variants
  that update on the overflow step, or decide on overflow locally, must fail;
- memory: zerokit.memory.census per rank on TinyTransformer (2.7 M parameters) against
  zerokit.memory.theory_bytes(..., "mixed"): 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N.

Measured on this machine (2 CPU cores, torch 2.13, N = 2):
- loss at each of 24 steps (it falls from 4.77 to 0.45): the largest relative difference
  to fp32 is 1.1% in bf16 and in fp16, the same for every stage (the tolerance is 5%);
  the norm of Adam's m after the last step is within 0.05% (tolerance 5%). The "multiply
  by the scale" bug gives an m 2**32 times too large while its *loss* stays within 1.1%:
  Adam divides m by sqrt(v), so it cannot see a constant factor on the gradient; only the
  optimizer state and the gradient norm reveal the bug;
- growth_interval=3 makes the scale climb from 2**16 until fp16 overflows (at 2**19) and
  back off, 4 times in 24 steps; each skipped step just delays training by one step;
- memory at rest (after backward, before step), bytes per parameter per rank, bf16
  weights and bf16 gradient reduction: exactly the theory for DDP (2 + 2 + 12), ZeRO-1
  (2 + 2 + 6), ZeRO-2 (2 + 1 + 6), ZeRO-3 with half_shard=True (1 + 1 + 6); ZeRO-3 with
  the fp32 master as the parameter storage (the default) 0 + 1 + 6 = 7: 2Ψ/N below the
  paper. The tolerance is 5% per category (padding to a multiple of N is < 1e-5 here).
  What the census leaves out (the "other" category, not compared): the batch, and
  buffers that live only inside one call: the fp32 unscaled gradient copies during
  step() (4Ψ/N with ZeRO, 4Ψ with DDP), the flat gradient being reduce-scattered (ZeRO-2/3,
  one bucket), a gathered unit and the 16-bit cast of its master shard (ZeRO-3).
"""

import math

import pytest
import torch

import zerokit
from conftest import padding_bound, run_ranks
from zerokit.memory import census, theory_bytes
from zerokit.mixed_precision import LossScaler, MixedPrecision, MixedPrecisionState
from zerokit.models import TinyTransformer, loss_for, make_batch, num_parameters
from zerokit.reference import build_model, global_batch, rank_slice

WORLD = 2
STAGES = ("ddp", "zero1", "zero2", "zero3")
STEPS, LR, BATCH, CLIP = 24, 1e-2, 12, 1.0
LOSS_RTOL = 0.05  # per step, relative to the fp32 loss
STATE_RTOL = 0.05  # norm of Adam's m at the end, gradient norms of the first steps, vs fp32
NORM_STEPS = 5  # later gradient norms swing by 10-20% in bf16 as the loss gets small
INJECT_AT = 2  # the step whose gradient gets an inf (on rank 1 only)
MEMORY_RTOL = 0.05
TIMEOUT = 120

# --------------------------------------------------------------------------------------
# deliberately wrong variants: each must fail the check written for it


class MultipliesByScale(MixedPrecisionState):
    """Bug: multiplies the scaled gradient by the loss scale instead of dividing by it."""

    def fp32_gradients(self, grads):
        out = super().fp32_gradients(grads)  # correctly unscaled: g ...
        return [g.mul_(self.loss_scale**2) for g in out]  # ... now (g*S)*S, what `* S` hands Adam


class UpdatesOnOverflow(MixedPrecisionState):
    """Bug: halves the scale on an overflow but updates the parameters anyway."""

    def should_step(self):
        super().should_step()
        return True


class LocalOverflowDecision(MixedPrecisionState):
    """Bug: each rank checks only its own gradient (shard): no all-reduce of the flag."""

    def fp32_gradients(self, grads):
        out = [g.float().div_(self.loss_scale) for g in grads]
        self.found_inf = any(not torch.isfinite(g).all() for g in out)
        return out


BUGS = {"multiply": MultipliesByScale, "update_on_overflow": UpdatesOnOverflow,
        "local_decision": LocalOverflowDecision}

# --------------------------------------------------------------------------------------
# what runs on each rank


def make_opt(stage, model, precision, bug=None):
    if stage == "ddp":
        opt = zerokit.DistributedAdam(model.parameters(), lr=LR, precision=precision)
    elif stage == "zero1":
        opt = zerokit.ZeRO1Adam(model.parameters(), lr=LR, precision=precision)
    elif stage == "zero2":  # small buckets: several reduce-scatters during backward
        opt = zerokit.ZeRO2Adam(model.parameters(), lr=LR, precision=precision, bucket_mb=0.01)
    else:
        opt = zerokit.ZeRO3Adam(model, lr=LR, precision=precision)
    if bug is not None:
        opt.precision.__class__ = BUGS[bug]  # the same state, with one method done wrong
    return opt


def my_slice(t, rank):
    return rank_slice(t, rank, WORLD)


def exp_avg_norm(stage, opt):
    """L2 norm of Adam's m over the whole model (ZeRO: summed over the ranks' shards)."""
    if stage == "ddp":
        return math.sqrt(sum(s["exp_avg"].double().pow(2).sum().item() for s in opt.state.values()))
    sq = torch.tensor([sum(s.exp_avg.double().pow(2).sum().item() for s in opt.shards)])
    torch.distributed.all_reduce(sq)
    return sq.sqrt().item()


def train(rank, stage, precision, bug=None):
    """Memorise one batch: per step the global mean loss and the clipped gradient norm."""
    model = build_model("transformer")
    opt = make_opt(stage, model, precision, bug)
    x, y = global_batch("transformer", 0, BATCH)
    scaler = opt.precision.scaler  # None in fp32
    losses, norms, skips = [], [], []
    for _ in range(STEPS):
        loss = loss_for("transformer", model(my_slice(x, rank)).float(), my_slice(y, rank))
        opt.scale_loss(loss).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / WORLD)
        skips.append(scaler.skipped_steps if scaler else 0)
    return {"losses": losses, "norms": norms, "m_norm": exp_avg_norm(stage, opt), "skips": skips,
            "scale": scaler.scale if scaler else 1.0, "skipped": skips[-1]}


def comm_of_one_step(rank, stage, precision):
    """{op: (calls, bytes in the paper's convention)} of one training step."""
    model = build_model("transformer")
    opt = make_opt(stage, model, precision)
    x, y = global_batch("transformer", 0, BATCH)
    with zerokit.CommCounter() as comm:
        loss = loss_for("transformer", model(my_slice(x, rank)).float(), my_slice(y, rank))
        opt.scale_loss(loss).backward()
        opt.step()
    return {op: (row["calls"], row["volume_bytes"]) for op, row in comm.table().items()}


# the other options, checked like the defaults
VARIANTS = {
    ("ddp", "bf16, reduce in fp32"): MixedPrecision("bf16", reduce_dtype=torch.float32),
    ("zero2", "bf16, reduce in fp32"): MixedPrecision("bf16", reduce_dtype=torch.float32),
    ("zero3", "fp16, half_shard"): MixedPrecision("fp16", half_shard=True),
}


def training_worker(rank, world_size):
    out = {}
    for stage in STAGES:
        for dtype in ("bf16", "fp16"):
            out[stage, dtype] = train(rank, stage, MixedPrecision(dtype))
        for name, mp in (("fp32", None), ("bf16", MixedPrecision("bf16")), ("fp16", MixedPrecision("fp16"))):
            out[stage, "comm", name] = comm_of_one_step(rank, stage, mp)
    for (stage, name), precision in VARIANTS.items():
        out[stage, name] = train(rank, stage, precision)
    out["zero1", "fp16", "multiply"] = train(rank, "zero1", MixedPrecision("fp16"), bug="multiply")
    # the loss scale climbing to overflow and backing off: growth every 3 clean steps
    out["zero1", "fp16", "sawtooth"] = train(rank, "zero1", MixedPrecision("fp16", growth_interval=3))
    return out


def snapshot(stage, model, opt):
    """(full 16-bit parameters, this rank's fp32 master weights) as fp32 copies."""
    if stage == "zero3":
        with opt.gathered():
            params = [p.detach().float().clone() for p in model.parameters()]
    else:
        params = [p.detach().float().clone() for p in model.parameters()]
    masters = opt.masters if stage == "ddp" else [s.master for s in opt.shards]
    return params, [m.clone() for m in masters if m is not None]


def same(a, b):
    return all(torch.equal(s, t) for s, t in zip(a, b))


def overflow_run(rank, stage, bug=None):
    model = build_model("transformer")
    opt = make_opt(stage, model, MixedPrecision("fp16"), bug)
    # the first element of the first bucket: it lies in rank 0's shard
    target = next(p for p in model.parameters()) if stage == "ddp" else opt.buckets[0].params[0]

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    records, before = [], snapshot(stage, model, opt)
    for step in range(INJECT_AT + 2):
        x, y = global_batch("transformer", step, BATCH)
        handle = target.register_hook(poison) if (step == INJECT_AT and rank == 1) else None
        loss = loss_for("transformer", model(my_slice(x, rank)).float(), my_slice(y, rank))
        opt.scale_loss(loss).backward()
        if handle is not None:
            handle.remove()
        opt.step()
        opt.zero_grad()
        after = snapshot(stage, model, opt)
        records.append({"params_same": same(before[0], after[0]), "masters_same": same(before[1], after[1]),
                        "finite": all(torch.isfinite(t).all() for t in after[0] + after[1]),
                        "scale": opt.precision.loss_scale, "skipped": opt.precision.scaler.skipped_steps})
        before = after
    return {"records": records, "params": before[0]}


def overflow_worker(rank, world_size):
    out = {stage: overflow_run(rank, stage) for stage in STAGES}
    out["update_on_overflow"] = overflow_run(rank, "zero1", bug="update_on_overflow")
    # with ZeRO-1/2 a local decision would also hang (the stepping rank waits in the
    # all-gather); ZeRO-3 has no collective in step(), so the ranks just drift apart
    out["local_decision"] = overflow_run(rank, "zero3", bug="local_decision")
    return out


MEMORY_CONFIGS = (("ddp", False), ("zero1", False), ("zero2", False), ("zero3", False), ("zero3", True))


def memory_worker(rank, world_size):
    import gc
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # census walks gc objects
    out = {}
    for stage, half_shard in MEMORY_CONFIGS:
        torch.manual_seed(0)
        model = TinyTransformer()
        psi = num_parameters(model)  # counted now: ZeRO-3 leaves the parameters empty
        precision = MixedPrecision("bf16", half_shard=half_shard)  # reduce in bf16: 2-byte gradients
        opt = make_opt(stage, model, precision)
        for step in range(2):  # step once so that Adam's state exists, then measure after backward
            ids, targets = make_batch("transformer", 2, seed=step)
            ids, targets = my_slice(ids, rank)[:, :16], my_slice(targets, rank)[:, :16]
            loss = loss_for("transformer", model(ids).float(), targets)
            opt.scale_loss(loss).backward()
            del loss
            if step == 0:
                opt.step()
                opt.zero_grad()
        gc.collect()
        out[stage, half_shard] = {"psi": psi, **census(model, opt)}
    return out


# --------------------------------------------------------------------------------------
# fixtures: one launch each, shared by the tests


@pytest.fixture(scope="module")
def fp32_reference():
    """One process, torch.optim.AdamW in fp32 on the whole batch, the same clipping."""
    model = build_model("transformer")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    x, y = global_batch("transformer", 0, BATCH)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = loss_for("transformer", model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    m_norm = math.sqrt(sum(s["exp_avg"].double().pow(2).sum().item() for s in opt.state.values()))
    return {"losses": losses, "norms": norms, "m_norm": m_norm}


@pytest.fixture(scope="module")
def training():
    return run_ranks(training_worker, WORLD, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def overflow():
    return run_ranks(overflow_worker, WORLD, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def memory():
    return run_ranks(memory_worker, WORLD, timeout=TIMEOUT)


# --------------------------------------------------------------------------------------
# the checks, written once and applied to the right and the wrong variants


def rel(a, b):
    return abs(a - b) / abs(b)


def check_loss_close(run, ref):
    worst = max(rel(a, b) for a, b in zip(run["losses"], ref["losses"]))
    assert worst <= LOSS_RTOL, f"loss differs from fp32 by {worst:.1%} (tolerance {LOSS_RTOL:.0%})"


def check_state_close(run, ref):
    m = rel(run["m_norm"], ref["m_norm"])
    assert m <= STATE_RTOL, f"|m| is {run['m_norm']:.3g}, fp32 {ref['m_norm']:.3g}: the gradient Adam saw is wrong"
    g = max(rel(a, b) for a, b in zip(run["norms"][:NORM_STEPS], ref["norms"][:NORM_STEPS]))
    assert g <= STATE_RTOL, f"gradient norm differs from fp32 by {g:.1%}"


def check_overflow_skipped(per_rank):
    """The INJECT_AT step changed nothing on any rank and halved the scale on every rank."""
    for rank, run in enumerate(per_rank):
        rec = run["records"]
        hit = rec[INJECT_AT]
        assert hit["params_same"] and hit["masters_same"], f"rank {rank} updated on the overflow step"
        assert hit["finite"], f"rank {rank}: inf/nan reached the weights"
        assert hit["scale"] == rec[INJECT_AT - 1]["scale"] / 2, f"rank {rank}: the scale did not halve"
        assert [r["skipped"] for r in rec] == [0] * INJECT_AT + [1] * (len(rec) - INJECT_AT), \
            f"rank {rank}: skipped steps {[r['skipped'] for r in rec]}, expected exactly the step {INJECT_AT}"
        others = [r for i, r in enumerate(rec) if i != INJECT_AT]
        assert not any(r["params_same"] or r["masters_same"] for r in others), "the other steps must update"
    scales = [[r["scale"] for r in run["records"]] for run in per_rank]
    assert all(s == scales[0] for s in scales), f"the loss scale differs between ranks: {scales}"
    assert all(same(run["params"], per_rank[0]["params"]) for run in per_rank), "the replicas drifted apart"


# --------------------------------------------------------------------------------------
# tests


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", STAGES)
def test_training_matches_fp32(training, fp32_reference, stage, dtype):
    for rank_out in training:
        run = rank_out[stage, dtype]
        check_loss_close(run, fp32_reference)
        check_state_close(run, fp32_reference)
    run = training[0][stage, dtype]
    assert run["skipped"] == 0 and run["scale"] == (2.0**16 if dtype == "fp16" else 1.0)
    assert run["losses"][-1] < 0.1 * run["losses"][0]  # it did learn
    worst = max(rel(a, b) for a, b in zip(run["losses"], fp32_reference["losses"]))
    print(f"{stage} {dtype}: final loss {run['losses'][-1]:.4f} (fp32 {fp32_reference['losses'][-1]:.4f}), "
          f"max relative loss difference {worst:.2%}, |m| {run['m_norm']:.4g} (fp32 {fp32_reference['m_norm']:.4g})")


@pytest.mark.distributed
@pytest.mark.parametrize("stage, name", list(VARIANTS))
def test_options_match_fp32(training, fp32_reference, stage, name):
    for rank_out in training:
        check_loss_close(rank_out[stage, name], fp32_reference)
        check_state_close(rank_out[stage, name], fp32_reference)


@pytest.mark.distributed
def test_dynamic_scale_grows_and_backs_off(training, fp32_reference):
    """growth_interval=3: S doubles until a gradient overflows fp16 (at 2**19 here), then
    halves, skipping that step, again and again. A skipped step is lost, nothing else:
    after k skips the loss is fp32's loss of k steps earlier."""
    runs = [r["zero1", "fp16", "sawtooth"] for r in training]
    assert runs[0]["skips"] == runs[1]["skips"] and runs[0]["scale"] == runs[1]["scale"]
    run = runs[0]
    assert run["skipped"] >= 2, "the scale never reached an overflow"
    for t, loss in enumerate(run["losses"]):
        lag = run["skips"][t - 1] if t else 0
        assert rel(loss, fp32_reference["losses"][t - lag]) <= LOSS_RTOL, (t, lag)
    print(f"sawtooth: {run['skipped']} skipped steps, final scale {run['scale']:g}, "
          f"final loss {run['losses'][-1]:.4f} (fp32 {fp32_reference['losses'][-1 - run['skipped']]:.4f} "
          f"{run['skipped']} steps earlier)")


@pytest.mark.distributed
def test_multiplying_by_the_scale_is_caught(training, fp32_reference):
    run = training[0]["zero1", "fp16", "multiply"]
    check_loss_close(run, fp32_reference)  # the loss cannot see it (Adam is scale-invariant) ...
    with pytest.raises(AssertionError, match="gradient Adam saw is wrong"):
        check_state_close(run, fp32_reference)  # ... the optimizer state can


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision_communication(training, stage):
    """16-bit parameters and gradients halve the bytes of the gathers and reductions;
    fp16 adds one all-reduce of one number (the overflow flag), bf16 nothing."""
    fp32, bf16, fp16 = (training[0][stage, "comm", name] for name in ("fp32", "bf16", "fp16"))
    for op in ("reduce_scatter", "all_gather"):  # ZeRO: 16-bit gradients and weights
        if op not in fp32:
            assert op not in bf16 and op not in fp16
            continue
        for half in (bf16, fp16):
            # bucket_mb is a size in bytes: a 16-bit bucket holds twice the elements, so ZeRO-2
            # needs at most as many collectives (one of each per bucket); the other stages'
            # collectives follow param groups or units and do not change, nor does their padding
            if stage == "zero2":
                assert half[op][0] <= fp32[op][0], (op, fp32[op], half[op])
                # other buckets, other padding (zerokit.flat: under one alignment per parameter
                # and per shard): the elements sent differ by less than the fp32 run's bound
                tensors = sum(1 for p in build_model("transformer").parameters() if p.requires_grad)
                fp32_pad = padding_bound(tensors, fp32[op][0], WORLD)
                assert abs(half[op][1] // 2 - fp32[op][1] // 4) < fp32_pad, (op, fp32[op], half[op])
            else:
                assert half[op][0] == fp32[op][0], (op, fp32[op], half[op])
                assert half[op][1] == fp32[op][1] // 2, (op, fp32[op], half[op])
    calls, nbytes = fp32["all_reduce"]  # DDP: the gradients; ZeRO: which parameters got one (uint8)
    nbytes_16 = nbytes // 2 if stage == "ddp" else nbytes
    assert bf16["all_reduce"] == (calls, nbytes_16)
    assert fp16["all_reduce"] == (calls + 1, nbytes_16 + 2 * 4)  # one fp32 flag; all-reduce counts 2x


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_inf_on_one_rank_skips_the_step_on_all(overflow, stage):
    check_overflow_skipped([rank_out[stage] for rank_out in overflow])


@pytest.mark.distributed
@pytest.mark.parametrize("bug", ["update_on_overflow", "local_decision"])
def test_overflow_bugs_are_caught(overflow, bug):
    # local_decision: rank 0 (whose shard holds the inf) skips, rank 1 steps, so the weights
    # both ranks gather have changed, and the two ranks' loss scales differ
    with pytest.raises(AssertionError, match="updated on the overflow step"):
        check_overflow_skipped([rank_out[bug] for rank_out in overflow])


@pytest.mark.distributed
@pytest.mark.parametrize("stage, half_shard", MEMORY_CONFIGS)
def test_memory_per_rank_matches_the_paper(memory, stage, half_shard):
    for rank_out in memory:
        got = rank_out[stage, half_shard]
        psi = got["psi"]
        want = theory_bytes(psi, stage, WORLD, precision="mixed")
        if stage == "zero3" and not half_shard:
            want["parameters"] = 0  # the fp32 master shard is the parameter storage at rest
        for cat in ("parameters", "gradients", "optimizer_states"):
            assert abs(got[cat] - want[cat]) <= MEMORY_RTOL * max(want[cat], 1), \
                f"{stage}: {cat} {got[cat] / psi:.3f} B/param, theory {want[cat] / psi:.3f}"
    got = memory[0][stage, half_shard]
    print(f"{stage}{' half_shard' if half_shard else ''}: " + ", ".join(
        f"{cat} {got[cat] / psi:.3f}" for cat in ("parameters", "gradients", "optimizer_states"))
        + f" bytes/param (Ψ = {psi})")


@pytest.mark.distributed
def test_fp32_master_as_parameter_storage_saves_2psi_over_n(memory):
    """ZeRO-3: no separate 16-bit shard at rest (FSDP2's layout) is 14Ψ/N instead of 16Ψ/N."""
    model_state = {k: v["parameters"] + v["gradients"] + v["optimizer_states"] for k, v in memory[0].items()}
    psi = memory[0]["zero3", False]["psi"]
    saved = model_state["zero3", True] - model_state["zero3", False]
    assert saved == pytest.approx(2 * psi / WORLD, rel=1e-3)


def test_tiny_gradient_underflows_in_fp16_without_loss_scaling():
    """d loss / d w = 1e-4 * 1e-4 = 1e-8, below fp16's smallest subnormal (6e-8)."""

    def gradient(precision):
        state = MixedPrecisionState(precision)  # one process: no all-reduce of the flag
        w = torch.ones(4, dtype=precision.param_dtype, requires_grad=True)
        a = torch.full((4,), 1e-4, dtype=precision.param_dtype)
        loss = (w * a).sum().float() * 1e-4  # the loss in fp32, as in training
        state.scale_loss(loss).backward()
        return state.fp32_gradients([w.grad])[0]

    unscaled = gradient(MixedPrecision("fp16", loss_scaling=False))
    bf16 = gradient(MixedPrecision("bf16"))
    scaled = gradient(MixedPrecision("fp16"))  # S = 2**16: the gradient is 6.6e-4 during backward
    print(f"d loss/d w (true 1e-8): fp16 {unscaled[0].item():.3g}, bf16 {bf16[0].item():.3g}, "
          f"fp16 x 2**16 then unscaled {scaled[0].item():.3g}")
    assert torch.all(unscaled == 0)
    assert torch.allclose(bf16, torch.full((4,), 1e-8), rtol=2e-2)
    assert torch.allclose(scaled, torch.full((4,), 1e-8), rtol=2e-3)


def test_loss_scaler_rules():
    s = LossScaler(init_scale=8.0, growth_interval=2)
    s.update(found_inf=True)
    assert (s.scale, s.skipped_steps) == (4.0, 1)
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0  # two clean steps in a row
    s.update(False)
    s.update(True)  # an overflow resets the clean-step count
    s.update(False)
    assert s.scale == 4.0


def test_config_defaults_and_validation():
    assert MixedPrecision("fp16").loss_scaling and not MixedPrecision("bf16").loss_scaling
    assert MixedPrecision("bf16").reduce_dtype == torch.bfloat16
    assert MixedPrecision("fp16", reduce_dtype="fp32").reduce_dtype == torch.float32
    with pytest.raises(ValueError):
        MixedPrecision("fp32")
    with pytest.raises(ValueError):
        MixedPrecision("fp16", backoff_factor=2)
    with pytest.raises(TypeError):
        MixedPrecisionState("bf16")
