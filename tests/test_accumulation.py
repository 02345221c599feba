"""Gradient accumulation over k micro-batches with ZeRO-2 and ZeRO-3 (lesson 08).

One launch on 2 gloo ranks: k = 3 micro-batches per step, each backward reduce-scattering
(the default) or the first k - 1 under no_sync(), for ZeRO-2 and ZeRO-3. Checked against
one process running torch.optim.AdamW on the whole batch after every step, and against the
theory (zerokit.comm.theory_volume): the reduce-scatter volume per optimizer step is k
times the padded buckets without no_sync and once with it; ZeRO-3 gathers the parameters
2k times either way. Between micro-batches a rank holds its gradient shards only (4 Psi/N
bytes) or, under no_sync, the full gradients (4 Psi); ZeRO-3 frees every unit after its
backward under no_sync too.
"""

import contextlib

import pytest

import zerokit
from conftest import run_ranks
from zerokit.comm import theory_volume
from zerokit.memory import MemoryProbe, census
from zerokit.models import build_model, model_batch, model_loss
from zerokit.reference import reference_trajectory

K, PER_MICRO, STEPS, LR, WD, TOL = 3, 2, 2, 1e-2, 0.1, 1e-5
WORLD = 2
GLOBAL = K * PER_MICRO * WORLD


def _reference():
    return reference_trajectory("transformer", STEPS, GLOBAL, lr=LR, weight_decay=WD)


def _run(rank, world_size, stage, no_sync):
    net = build_model("transformer")
    psi = sum(p.numel() for p in net.parameters())
    opt = (zerokit.ZeRO3Adam(net, lr=LR, weight_decay=WD) if stage == "zero3"
           else zerokit.ZeRO2Adam(net.parameters(), lr=LR, weight_decay=WD, bucket_mb=0.01))
    rows = []
    for step in range(STEPS):
        x, y = model_batch("transformer", GLOBAL, step)
        mine = slice(rank * K * PER_MICRO, (rank + 1) * K * PER_MICRO)
        x, y = x[mine], y[mine]
        between, empty = [], True
        with zerokit.CommCounter() as comm, MemoryProbe(net, opt) as probe:
            for k in range(K):
                quiet = opt.no_sync() if no_sync and k < K - 1 else contextlib.nullcontext()
                with quiet:
                    micro = slice(k * PER_MICRO, (k + 1) * PER_MICRO)
                    (model_loss("transformer", net(x[micro]), y[micro]) / K).backward()
                if k < K - 1:
                    between.append(census(net, opt, scan=False)["gradients"])
                empty &= all(p.numel() == 0 for p in net.parameters()) if stage == "zero3" else True
            opt.step()
        opt.zero_grad()
        if stage == "zero3":
            with opt.gathered():
                snap = {n: p.detach().clone() for n, p in net.named_parameters()}
        else:
            snap = {n: p.detach().clone() for n, p in net.named_parameters()}
        rows.append({"snap": snap, "between": between, "units_freed": empty, "peak_grad": probe.peak["gradients"],
                     "volume": {op: comm.volume(op) for op in ("reduce_scatter", "all_gather")}})
    return {"rows": rows, "psi": psi, "padded": sum(b.padded_numel for b in opt.buckets)}


def _all(rank, world_size):
    return {(stage, no_sync): _run(rank, world_size, stage, no_sync)
            for stage in ("zero2", "zero3") for no_sync in (False, True)}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all, WORLD)


CASES = [("zero2", False), ("zero2", True), ("zero3", False), ("zero3", True)]


@pytest.mark.distributed
@pytest.mark.parametrize("stage, no_sync", CASES)
def test_accumulated_steps_match_adamw_on_the_whole_batch(runs, stage, no_sync):
    ref = _reference()
    for rank, r in enumerate(runs):
        for step, (row, want) in enumerate(zip(r[(stage, no_sync)]["rows"], ref)):
            worst = max((row["snap"][n] - want[n]).abs().max().item() for n in want)
            assert worst < TOL, f"rank {rank}, {stage}, no_sync={no_sync}, step {step + 1}: {worst:.2e}"


@pytest.mark.distributed
@pytest.mark.parametrize("stage, no_sync", CASES)
def test_volume_per_step_is_k_times_or_once_as_the_theory_says(runs, stage, no_sync):
    r = runs[0][(stage, no_sync)]
    padded = r["padded"]
    for row in r["rows"]:
        v = row["volume"]
        assert v["reduce_scatter"] == (1 if no_sync else K) * padded
        assert v["all_gather"] == (2 * K if stage == "zero3" else 1) * padded
        # the theory counts Ψ; the measured volume counts each bucket's padding too
        assert v["reduce_scatter"] + v["all_gather"] == theory_volume(stage, padded, K, no_sync)
    assert theory_volume(stage, 1, K, no_sync) == {("zero2", False): K + 1, ("zero2", True): 2,
                                                   ("zero3", False): 3 * K, ("zero3", True): 2 * K + 1}[(stage, no_sync)]


@pytest.mark.distributed
def test_gradient_memory_between_micro_batches_is_the_shard_or_the_whole(runs):
    for stage in ("zero2", "zero3"):
        sharded, whole = runs[0][(stage, False)], runs[0][(stage, True)]
        for row in sharded["rows"]:
            assert row["between"] == [4 * sharded["padded"] // WORLD] * (K - 1), (stage, row["between"])
        for row in whole["rows"]:
            assert row["between"] == [4 * whole["psi"]] * (K - 1), (stage, row["between"])
        assert all(row["units_freed"] for row in sharded["rows"] + whole["rows"])
        # inside a step no_sync holds the full gradients (and the shards, once reduced); the sharded
        # peak is the shards plus the buckets in transit, which on a model this small is ~4 Psi too
        assert max(r["peak_grad"] for r in whole["rows"]) >= 4 * whole["psi"]
