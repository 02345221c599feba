"""zerokit.memory: the ZeRO paper's numbers from theory_bytes, and census() measuring the
model-state bytes of real optimizers against that theory (fp32: 4Ψ + 4Ψ + 8Ψ).
"""

import gc
import math
import warnings

import pytest
import torch
from torch import nn

import zerokit
from conftest import padding_bound, run_ranks
from zerokit.memory import theory_bytes

GB = 1e9
PSI = 7.5e9


# --------------------------------------------------------------------------------------
# theory


@pytest.mark.parametrize("stage, gb", [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.9)])
def test_zero_paper_numbers(stage, gb):
    """ZeRO paper, Ψ = 7.5B, N_d = 64, mixed precision (2 + 2 + 12 bytes per parameter)."""
    t = theory_bytes(PSI, stage, 64, "mixed")
    assert round(t["total"] / GB, 1) == gb
    exact = {"ddp": 16 * PSI, "zero1": 4 * PSI + 12 * PSI / 64,
             "zero2": 2 * PSI + 14 * PSI / 64, "zero3": 16 * PSI / 64}[stage]
    assert t["total"] == pytest.approx(exact, rel=1e-12)
    assert t["total"] == pytest.approx(t["parameters"] + t["gradients"] + t["optimizer_states"], rel=1e-12)


def test_mixed_precision_breakdown():
    t = theory_bytes(PSI, "ddp", 64, "mixed")
    assert (t["parameters"], t["gradients"], t["optimizer_states"]) == (2 * PSI, 2 * PSI, 12 * PSI)
    seven_b = theory_bytes(7e9, "ddp", 1, "mixed")["total"]
    assert seven_b / GB == pytest.approx(112.0)  # "a 7B model is ~112 GB of model state"


@pytest.mark.parametrize("stage, saving", [("zero1", 0.5625), ("zero2", 0.65625), ("zero3", 0.75)])
def test_savings_at_n4(stage, saving):
    """At N = 4: 56%, 66%, 75% less than data parallel."""
    dp = theory_bytes(PSI, "ddp", 4, "mixed")["total"]
    t = theory_bytes(PSI, stage, 4, "mixed")["total"]
    assert 1 - t / dp == pytest.approx(saving, rel=1e-12)
    assert round(100 * (1 - t / dp)) == {"zero1": 56, "zero2": 66, "zero3": 75}[stage]


def test_limits_4x_8x_nx():
    dp = theory_bytes(PSI, "ddp", 10**9, "mixed")["total"]
    assert dp / theory_bytes(PSI, "zero1", 10**9, "mixed")["total"] == pytest.approx(4, rel=1e-6)
    assert dp / theory_bytes(PSI, "zero2", 10**9, "mixed")["total"] == pytest.approx(8, rel=1e-6)
    for n in (2, 7, 64):
        assert dp / theory_bytes(PSI, "zero3", n, "mixed")["total"] == pytest.approx(n)


def test_fp32_theory_and_validation():
    t = theory_bytes(1000, "zero2", 4, "fp32")
    assert (t["parameters"], t["gradients"], t["optimizer_states"]) == (4000, 1000, 2000)
    assert theory_bytes(1000, "ddp", 4)["total"] == 16000  # fp32 is the default
    with pytest.raises(ValueError):
        theory_bytes(1000, "zero4", 4)
    with pytest.raises(ValueError):
        theory_bytes(1000, "ddp", 4, "fp8")


# --------------------------------------------------------------------------------------
# measurement

SIZES = (301, 257, 199, 7)  # Ψ = 130 356, not divisible by 2, 3 or 4 ... per layer
CATS = ("parameters", "gradients", "optimizer_states")


def big_mlp():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def one_step(model, opt, rank=0, world_size=1):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * world_size, SIZES[0], generator=g)[rank * 4:(rank + 1) * 4]
    model(x).pow(2).mean().backward()
    opt.step()  # measured after step(), before zero_grad(): gradients and state both alive


def within(measured, expected, rel=0.05):
    return abs(measured - expected) <= rel * expected


@pytest.mark.timeout(60)
def test_census_torch_adamw_single_process():
    gc.collect()
    model = big_mlp()
    psi = sum(p.numel() for p in model.parameters())
    assert psi == 301 * 257 + 257 + 257 * 199 + 199 + 199 * 7 + 7
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    one_step(model, opt)
    c = zerokit.census(model, opt)
    theory = theory_bytes(psi, "ddp", 1, "fp32")
    # the only extra model state: torch keeps `step` as a 4-byte tensor per parameter (6 here)
    for cat in CATS:
        assert within(c[cat], theory[cat]), (cat, c[cat], theory[cat])
    assert c["parameters"] == 4 * psi and c["gradients"] == 4 * psi
    assert 8 * psi <= c["optimizer_states"] <= 8 * psi + 4 * 6
    # the categories are disjoint and everything live is counted once
    assert c["total"] == sum(c[k] for k in ("parameters", "gradients", "optimizer_states", "other"))
    # before the first step there is no optimizer state and, after zero_grad, no gradient
    opt.zero_grad(set_to_none=True)
    assert zerokit.census(model, opt)["gradients"] == 0


def stage_census_worker(rank, world_size):
    out = {}
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        gc.collect()
        model = big_mlp()
        psi = sum(p.numel() for p in model.parameters())
        if stage == "ddp":
            opt = zerokit.DistributedAdam(model.parameters(), lr=1e-3)
        elif stage == "zero1":
            opt = zerokit.ZeRO1Adam(model.parameters(), lr=1e-3)
        elif stage == "zero2":
            opt = zerokit.ZeRO2Adam(model.parameters(), lr=1e-3, bucket_mb=0.2)
        else:
            opt = zerokit.ZeRO3Adam(model, lr=1e-3)
        one_step(model, opt, rank, world_size)
        c = zerokit.census(model, opt)
        out[stage] = {"psi": psi, "census": {k: c[k] for k in CATS},
                      "buckets": len(getattr(opt, "buckets", []))}
        del model, opt
    out["fsdp2"] = fsdp_census(rank, world_size)
    return out


def fsdp_census(rank, world_size):
    """census() of big_mlp under each FSDP2 (every Linear a unit, then the root) with torch's AdamW, after
    backward and step(): {impl: census}, and this rank's (elements per row, padded rows, rows held) of every
    parameter, as torch.chunk cuts dim 0 (FSDP2's layout), for the expected bytes."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    for impl in ("FullyShard", "fully_shard", "torch"):
        gc.collect()
        model = big_mlp()
        rows = []
        for p in model.parameters():
            chunks = torch.arange(p.shape[0]).chunk(world_size)
            rows.append((math.prod(p.shape[1:]), len(chunks[0]), len(chunks[rank]) if rank < len(chunks) else 0))
        if impl == "FullyShard":
            model = zerokit.FullyShard(model)
        else:
            shard = zerokit.fully_shard if impl == "fully_shard" else torch_fully_shard
            for layer in model:
                if isinstance(layer, nn.Linear):
                    shard(layer)
            shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        one_step(model, opt, rank, world_size)
        c = zerokit.census(model, opt)
        out[impl] = {"census": {k: c[k] for k in CATS}, "rows": rows}
        del model, opt
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4])
def test_census_per_rank_matches_stage_theory(world_size):
    """Per rank, after backward and step(): each category within 5% of theory_bytes(stage, N), for the
    lessons' stages and for the three FSDP2s (exactly their DTensors' local bytes: see below).

    What the stages legitimately hold beyond Ψ-proportional theory, all far below 5% here:
    - padding: each flat buffer aligns every parameter and every shard (zerokit.flat), under one
      alignment (8 elements) per parameter and per shard: conftest.padding_bound;
    - nothing else. In particular none of ZeRO-1's full-size temporaries (the flat gradient
      it reduce-scatters, the reduced shards cached for clipping) outlive step(), ZeRO-2
      keeps only its reduced gradient shards (the flat buckets in flight are released at
      the end of backward), and ZeRO-3 keeps no gathered buffer at rest.
    """
    n = world_size
    results = run_ranks(stage_census_worker, n)
    for rank, got in enumerate(results):
        for stage in ("ddp", "zero1", "zero2", "zero3"):
            g = got[stage]
            theory = theory_bytes(g["psi"], stage, n, "fp32")
            for cat in CATS:
                measured = g["census"][cat]
                assert within(measured, theory[cat]), (
                    f"rank {rank} {stage} {cat}: measured {measured} B, theory {theory[cat]:.0f} B")
                # padding is the only thing allowed above theory (8 bytes per padding element: m and v)
                assert measured <= theory[cat] + 8 * padding_bound(len(SIZES) * 2 - 2, max(g["buckets"], 1), n), (
                    rank, stage, cat)
        # the point of each stage, in one line each
        psi = got["ddp"]["psi"]
        assert got["zero1"]["census"]["optimizer_states"] < 8 * psi / n * 1.01
        assert got["zero2"]["census"]["gradients"] < 4 * psi / n * 1.01
        assert got["zero3"]["census"]["parameters"] < 4 * psi / n * 1.01
        assert got["zero2"]["buckets"] > 1
        # FSDP2's layout (zerokit.FullyShard, zerokit.fully_shard, torch's fully_shard): every parameter,
        # gradient and AdamW state a DTensor, which has no storage of its own, counted by its local rows.
        # Exactly: a parameter shard padded to ceil(R / N) rows on every rank, its gradient shard too (reduced
        # into the padded layout); m and v the rows the rank holds (zeros_like of the DTensor), and a 4-byte
        # step count per parameter. And within 5% of theory_bytes("zero3").
        for impl, g in got["fsdp2"].items():
            c, rows = g["census"], g["rows"]
            padded = sum(4 * width * ceil_rows for width, ceil_rows, _ in rows)
            held = sum(8 * width * mine for width, _, mine in rows) + 4 * len(rows)
            assert (c["parameters"], c["gradients"], c["optimizer_states"]) == (padded, padded, held), (rank, impl, c)
            theory = theory_bytes(psi, "zero3", n, "fp32")
            for cat in CATS:
                assert within(c[cat], theory[cat]), (rank, impl, cat, c[cat], theory[cat])


@pytest.mark.timeout(60)
def test_census_writes_no_warning():
    """census() must not warn: nbgrader scores a test cell 0 when it writes to stderr, and
    the lessons call census() in graded cells. (Scanning every live object must not touch
    deprecated module attributes such as torch.distributed.reduce_op.)"""
    import torch.distributed  # noqa: F401  (imported by every multi-rank lesson)

    model = big_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    one_step(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerokit.census(model, opt)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def probe_worker(rank, world_size):
    """One probed step per stage (after a first, unprobed one): at-rest and peak census."""
    from zerokit.bench.buffers import buffer_bytes

    out = {}
    for stage in ("zero1", "zero2", "zero3"):
        gc.collect()
        model = big_mlp()
        if stage == "zero1":
            opt = zerokit.ZeRO1Adam(model.parameters(), lr=1e-3)
        elif stage == "zero2":
            opt = zerokit.ZeRO2Adam(model.parameters(), lr=1e-3, bucket_mb=0.1)
        else:
            opt = zerokit.ZeRO3Adam(model, lr=1e-3)
        one_step(model, opt, rank, world_size)
        opt.zero_grad()
        probe = zerokit.MemoryProbe(model, opt)
        with probe:
            one_step(model, opt, rank, world_size)
            opt.zero_grad()
        out[stage] = {"psi": sum(b.param_numel for b in opt.buckets), "buckets": len(opt.buckets),
                      "at_rest": {k: probe.after_step[k] for k in CATS},
                      "peak": {k: probe.peak[k] for k in CATS},
                      "buffers": {k: b for k, (b, _) in buffer_bytes(stage, opt, model).items()}}
        del model, opt, probe
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_probe_at_rest_and_peak_match_stage_theory():
    """MemoryProbe on 2 ranks. At rest (right after step(), nothing in transit) each category
    is the paper's figure, up to padding. At its peak each category is the paper's figure
    plus the buffers zerokit.bench.buffers.buffer_bytes derives from the stage's buckets and units:
    ZeRO-2's reduce-scatters in flight (their flat inputs and output shards are gradients),
    ZeRO-3's gathered and prefetched units (parameters, also while the all-gather is in flight).
    """
    n = 2
    for rank, got in enumerate(run_ranks(probe_worker, n)):
        for stage, g in got.items():
            theory = theory_bytes(g["psi"], stage, n, "fp32")
            padding = 8 * padding_bound(len(SIZES) * 2 - 2, g["buckets"], n)  # bytes: m and v of the padding
            for cat in CATS:
                assert within(g["at_rest"][cat], theory[cat]), (rank, stage, cat, g["at_rest"][cat], theory[cat])
                assert g["at_rest"][cat] <= theory[cat] + padding, (rank, stage, cat)  # padding only
                expected = theory[cat] + g["buffers"].get(cat, 0)
                # the structure's figure is an upper bound (a bucket's gradients but its last, ...)
                assert within(g["peak"][cat], expected) and g["peak"][cat] <= expected + padding, (
                    f"rank {rank} {stage} {cat}: peak {g['peak'][cat]} B, theory + buffers {expected:.0f} B")
        assert got["zero2"]["buffers"]["gradients"] > 0.1 * got["zero2"]["psi"]  # buckets in flight are seen
        assert got["zero3"]["buffers"]["parameters"] > 0.1 * got["zero3"]["psi"]  # gathered units are seen
