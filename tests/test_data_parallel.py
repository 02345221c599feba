"""zerokit.DataParallel (DistributedDataParallel's shape) against one process on the whole batch.

One launch per world size (2 and 3) runs every scenario; the references run in a one-rank
zerokit.launch, so with the one intra-op thread each rank has (a matmul's rounding depends on
the thread count). The optimizers are torch's own, built on `model.parameters()` after wrapping.

- Data split across ranks (SGD with momentum, AdamW; OddMLP and EdgeCaseNet; N = 2, 3): the
  parameters after every step within 1e-5 of one process. Not bitwise: N partial gradients sum
  in another order than one backward over the whole batch.
- The same batch on 2 ranks: bitwise (torch.equal) one process after every step, since the
  mean of two identical gradients, (x + x) / 2, is exact.
- Frozen, tied and unused parameters; a branch only some ranks (or none) run; gradients that
  arrive out of bucket order; no_sync(); overlap of the all-reduces with backward.

Measured here (2 CPU cores, torch 2.13; run with -s to print), max abs diff to one process:
split data 2.4e-7 at N = 2 and at N = 3 (EdgeCaseNet with AdamW; SGD 1.5e-8 on OddMLP, 1.2e-7
on EdgeCaseNet); no_sync 3e-8; gradients with a branch only rank 0 runs 0 at N = 2 (bitwise
there, though not asserted) and 1.9e-8 at N = 3.
"""

import functools
import time

import pytest
import torch
from torch import nn

import zerokit
from conftest import align, batch, max_diff, new_model, rank_slice, run_ranks, snapshot
from zerokit.models import BranchNet, loss_for, make_batch

STEPS = 6
GLOBAL_BATCH = 12  # splits over 2 and 3 ranks, and into micro-batches of 2 on each
TOL = 1e-5
BUCKET_NUMEL = 250  # 4 buckets on OddMLP, 5 on EdgeCaseNet
OVERLAP_BUCKET_NUMEL = 1200  # OddMLP in 3 buckets: [layer 2, layer 1's bias], [layer 1's weight, layer 0's bias], [layer 0's weight]
KINDS = ("mlp", "edge")
OPTIMIZERS = ("sgd", "adamw")
MEASURED = {}


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def wrap(model, bucket_numel=BUCKET_NUMEL):
    return zerokit.DataParallel(model, bucket_mb=bucket_numel * 4 / 2**20)  # fp32: 4 bytes an element


def small_batch(step, size=GLOBAL_BATCH):
    """Inputs for BranchNet and ReversedMLP (9 -> 5)."""
    return make_batch("mlp", size, seed=500 + step, n_in=9, n_out=5)


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


class ReversedMLP(nn.Module):
    """Layers registered last to first: the buckets (filled from the last registered parameter)
    start with the first layer, whose gradients backward produces last."""

    def __init__(self):
        super().__init__()
        self.last = nn.Linear(11, 5)
        self.mid = nn.Linear(11, 11)
        self.first = nn.Linear(9, 11)

    def forward(self, x):
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


# --------------------------------------------------------------------------------------
# on each rank


def trajectory(rank, world_size, kind, opt_name, same_batch):
    model = new_model(kind, seed=rank)  # different weights per rank: the wrapper must broadcast rank 0's
    dp = wrap(model)
    opt = make_optimizer(opt_name, dp.parameters())
    snaps = []
    for step in range(STEPS):
        x, y = batch(kind, step, GLOBAL_BATCH)
        if not same_batch:
            x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        loss_for(kind, dp(x), y).backward()
        opt.step()
        opt.zero_grad()
        snaps.append(snapshot(dp.module))
    return snaps


def edge_cases(rank, world_size):
    """EdgeCaseNet: what the buckets hold, the broadcast buffer, the gradients after backward."""
    model = new_model("edge", seed=rank)
    model.scale.fill_(0.5 + rank)  # a buffer: rank 0's value (0.5, the reference's) must win
    dp = wrap(model)
    name_of = {p: n for n, p in model.named_parameters()}
    opt = make_optimizer("sgd", dp.parameters())
    grads = []
    for step in range(3):
        x, y = batch("edge", step, GLOBAL_BATCH)
        loss_for("edge", dp(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"buckets": [[name_of[p] for p in b.params] for b in dp.buckets], "scale": model.scale.item(),
            "grads": grads, "module_is_model": dp.module is model, "final": snapshot(model)}


def accumulation(rank, world_size, use_no_sync):
    """Micro-batches of 2 (3 of them at N = 2, 2 at N = 3), each loss divided by their count."""
    model = new_model("mlp")
    dp = wrap(model)
    opt = make_optimizer("sgd", dp.parameters())
    k = GLOBAL_BATCH // world_size // 2
    snaps, calls, volumes, inside = [], [], [], []
    for step in range(STEPS):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        with zerokit.CommCounter() as comm:
            for i in range(k):
                loss = loss_for("mlp", dp(x[2 * i:2 * i + 2]), y[2 * i:2 * i + 2]) / k
                if use_no_sync and i < k - 1:
                    with dp.no_sync():
                        loss.backward()
                    inside.append(comm.count())
                else:
                    loss.backward()
        calls.append(comm.count("all_reduce"))
        volumes.append(comm.volume("all_reduce"))
        opt.step()
        opt.zero_grad()
        snaps.append(snapshot(model))
    return {"snaps": snaps, "calls": calls, "volumes": volumes, "inside_no_sync": inside,
            "buckets": len(dp.buckets), "k": k}


def overlap(rank, world_size):
    model = new_model("mlp")
    arrived = []  # registered before the wrapper's hooks, so it runs first
    model.layers[0].weight.register_post_accumulate_grad_hook(lambda p: arrived.append(time.perf_counter()))
    dp = wrap(model, OVERLAP_BUCKET_NUMEL)
    name_of = {p: n for n, p in model.named_parameters()}
    opt = make_optimizer("sgd", dp.parameters())
    steps = []
    for step in range(3):
        x, y = batch("mlp", step, GLOBAL_BATCH)
        loss = loss_for("mlp", dp(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
        with zerokit.CommCounter(clock=time.perf_counter) as comm:
            loss.backward()
        steps.append({"issued": [c.time for c in comm.calls if c.op == "all_reduce"], "first_layer": arrived[-1]})
        opt.step()
        opt.zero_grad()
    return {"buckets": [[name_of[p] for p in b.params] for b in dp.buckets], "steps": steps}


def branch_grads(rank, world_size, bucket_numel, used_on):
    """BranchNet's gradients after one backward where only the ranks in `used_on` run the branch."""
    torch.manual_seed(0)
    model = BranchNet()
    dp = wrap(model, bucket_numel)
    x, y = small_batch(0)
    with zerokit.CommCounter() as comm:
        mse(dp(rank_slice(x, rank, world_size), use_branch=rank in used_on), rank_slice(y, rank, world_size)).backward()
    return {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            "sizes": [c.numel for c in comm.calls], "buckets": len(dp.buckets)}


def reversed_trajectory(rank, world_size):
    torch.manual_seed(0)
    model = ReversedMLP()
    dp = wrap(model, 1)  # one parameter a bucket: 6 buckets, first layer's first
    opt = make_optimizer("sgd", dp.parameters())
    snaps, sizes = [], []
    for step in range(STEPS):
        x, y = small_batch(step)
        with zerokit.CommCounter() as comm:
            mse(dp(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
        sizes.append([c.numel for c in comm.calls])
        opt.step()
        opt.zero_grad()
        snaps.append(snapshot(model))
    return {"snaps": snaps, "sizes": sizes, "bucket_sizes": [b.numel + len(b.params) for b in dp.buckets]}


BRANCH_CASES = ((100, (0,)), (400, (0,)), (400, ()))  # (bucket numel, ranks that run the branch)


def worker(rank, world_size):
    out = {"split": {(k, o): trajectory(rank, world_size, k, o, False) for k in KINDS for o in OPTIMIZERS}}
    if world_size == 2:
        out["same"] = {(k, o): trajectory(rank, world_size, k, o, True) for k in KINDS for o in OPTIMIZERS}
        out["overlap"] = overlap(rank, world_size)
    out["edge"] = edge_cases(rank, world_size)
    out["no_sync"] = accumulation(rank, world_size, True)
    out["every"] = accumulation(rank, world_size, False)
    out["branch"] = {case: branch_grads(rank, world_size, *case) for case in BRANCH_CASES}
    out["reversed"] = reversed_trajectory(rank, world_size)
    return out


# --------------------------------------------------------------------------------------
# one process


def reference_worker(rank, world_size):
    out = {"traj": {}, "branch": {}}
    for kind in KINDS:
        for opt_name in OPTIMIZERS:
            model = new_model(kind)
            opt = make_optimizer(opt_name, model.parameters())
            snaps = []
            for step in range(STEPS):
                x, y = batch(kind, step, GLOBAL_BATCH)
                loss_for(kind, model(x), y).backward()
                opt.step()
                opt.zero_grad()
                snaps.append(snapshot(model))
            out["traj"][kind, opt_name] = snaps
    for n in (2, 3):  # the branch, run on the slices of the ranks that run it: the mean of N losses
        for used_on in ((0,), ()):
            torch.manual_seed(0)
            model = BranchNet()
            x, y = small_batch(0)
            sum(mse(model(rank_slice(x, r, n), use_branch=r in used_on), rank_slice(y, r, n)) for r in range(n)).div(n).backward()
            out["branch"][n, used_on] = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
    torch.manual_seed(0)
    model = ReversedMLP()
    opt = make_optimizer("sgd", model.parameters())
    out["reversed"] = []
    for step in range(STEPS):
        x, y = small_batch(step)
        mse(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out["reversed"].append(snapshot(model))
    return out


@functools.lru_cache(maxsize=None)
def reference():
    return run_ranks(reference_worker, 1, timeout=60)[0]


@functools.lru_cache(maxsize=None)
def results(world_size):
    return run_ranks(worker, world_size, timeout=120)


def within(snaps_per_rank, ref_snaps, label):
    worst = 0.0
    for rank, snaps in enumerate(snaps_per_rank):
        for step, (got, want) in enumerate(zip(snaps, ref_snaps, strict=True)):
            d = max_diff(got, want)
            assert d <= TOL, f"{label}: rank {rank} step {step + 1}: max abs diff {d:.3e} > {TOL}"
            worst = max(worst, d)
    MEASURED[label] = worst
    return worst


def report(prefix):
    print(" ".join(f"{k}: {v:.2e}" for k, v in MEASURED.items() if k.startswith(prefix)))


# --------------------------------------------------------------------------------------
# the checks


def test_needs_a_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="zerokit.launch"):
        zerokit.DataParallel(nn.Linear(2, 2))


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", (2, 3))
def test_split_batch_matches_one_process(world_size):
    """Each rank on its slice, torch's SGD (momentum) and AdamW: one process on the whole batch."""
    res = results(world_size)
    for kind in KINDS:
        for opt_name in OPTIMIZERS:
            within([r["split"][kind, opt_name] for r in res], reference()["traj"][kind, opt_name],
                   f"N={world_size} split {kind} {opt_name}")
    report(f"N={world_size} split")


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_same_batch_on_two_ranks_is_bitwise_one_process():
    res = results(2)
    for kind in KINDS:
        for opt_name in OPTIMIZERS:
            want = reference()["traj"][kind, opt_name]
            for rank, r in enumerate(res):
                for step, (got, ref) in enumerate(zip(r["same"][kind, opt_name], want, strict=True)):
                    for name in ref:
                        assert torch.equal(got[name], ref[name]), (
                            f"{kind} {opt_name} rank {rank} step {step + 1} {name}: "
                            f"{(got[name] - ref[name]).abs().max().item():.3e} apart, not bitwise")


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", (2, 3))
def test_frozen_tied_and_unused_parameters(world_size):
    res = results(world_size)
    start = snapshot(new_model("edge"))
    trainable = [n for n, p in new_model("edge").named_parameters() if p.requires_grad]
    for rank, r in enumerate(res):
        e = r["edge"]
        assert e["module_is_model"]
        names = [n for b in e["buckets"] for n in b]
        # frozen left out, the tied head.weight is embed.weight, sent once; unused still bucketed
        assert sorted(names) == sorted(trainable) and len(names) == len(set(names)), names
        assert "frozen.weight" not in names and "head.weight" not in names and "unused.weight" in names
        assert e["scale"] == 0.5, f"rank {rank}: buffer not broadcast from rank 0"
        for g in e["grads"]:
            assert g["unused.weight"] is None, f"rank {rank}: an unused parameter got a gradient"
            assert g["frozen.weight"] is None and g["frozen.bias"] is None
            assert all(g[n] is not None for n in trainable if n != "unused.weight")
        for name in ("frozen.weight", "frozen.bias", "unused.weight"):
            assert torch.equal(e["final"][name], start[name]), f"rank {rank}: {name} changed"
    for step in range(3):  # replicated gradients: identical on every rank
        for name, g in res[0]["edge"]["grads"][step].items():
            for r in res[1:]:
                other = r["edge"]["grads"][step][name]
                assert (g is None and other is None) or torch.equal(g, other), (step, name)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", (2, 3))
def test_a_branch_some_ranks_skip_gets_the_mean_with_zeros(world_size):
    """BranchNet with the branch on rank 0 only: its gradient is the mean with zeros elsewhere
    (one process: the mean of the ranks' losses); with the branch nowhere, .grad is None
    everywhere. Each rank's gradients arrive in its own order; the collectives do not."""
    res = results(world_size)
    worst = 0.0
    for case in BRANCH_CASES:
        want = reference()["branch"][world_size, case[1]]
        sizes = [r["branch"][case]["sizes"] for r in res]
        assert all(s == sizes[0] for s in sizes), (case, sizes)  # same collectives, same order
        assert len(sizes[0]) == res[0]["branch"][case]["buckets"]
        for rank, r in enumerate(res):
            got = r["branch"][case]["grads"]
            for name, w in want.items():
                if w is None:
                    assert got[name] is None, (case, rank, name)
                else:
                    d = (got[name] - w).abs().max().item()
                    assert d <= TOL, (case, rank, name, d)
                    worst = max(worst, d)
        if not case[1]:
            assert want["branch.weight"] is None
    MEASURED[f"N={world_size} branch"] = worst
    report(f"N={world_size} branch")


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", (2, 3))
def test_gradients_out_of_bucket_order(world_size):
    """ReversedMLP's first bucket is the first layer, whose gradient comes last: nothing can be
    sent until then, then everything goes, in bucket order, on every rank. No hang, right numbers."""
    res = results(world_size)
    within([r["reversed"]["snaps"] for r in res], reference()["reversed"], f"N={world_size} reversed")
    for r in res:
        rev = r["reversed"]
        assert len(rev["bucket_sizes"]) == 6
        assert rev["sizes"] == [rev["bucket_sizes"]] * STEPS  # bucket order, every step


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", (2, 3))
def test_no_sync_reduces_once(world_size):
    """k micro-batches, the first k - 1 under no_sync(): one all-reduce per bucket per step, and
    the same parameters as one backward on their concatenation (the split-batch trajectory) and
    as one process. Without no_sync each micro-batch reduces: k times the traffic, same result."""
    res = results(world_size)
    psi = sum(p.numel() for p in new_model("mlp").parameters())
    slots = len(list(new_model("mlp").parameters()))  # one presence slot per parameter
    for rank, r in enumerate(res):
        a, b = r["no_sync"], r["every"]
        k, nb = a["k"], a["buckets"]
        assert k >= 2 and nb >= 2
        assert a["inside_no_sync"] == [0] * (STEPS * (k - 1)), "something was sent inside no_sync()"
        # each bucket: its gradients, the gaps that align them (under one alignment per parameter,
        # zerokit.flat) and a presence slot per parameter, all-reduced (the volume counts it twice)
        for volumes, times in ((a["volumes"], 1), (b["volumes"], k)):
            assert all(2 * times * (psi + slots) <= v < 2 * times * (psi + slots + align() * slots) for v in volumes)
            assert len(set(volumes)) == 1, volumes
        assert a["calls"] == [nb] * STEPS and b["calls"] == [k * nb] * STEPS
        one_backward = r["split"]["mlp", "sgd"]
        MEASURED[f"N={world_size} no_sync vs one backward rank {rank}"] = max(
            max_diff(x, y) for x, y in zip(a["snaps"], one_backward))
        assert MEASURED[f"N={world_size} no_sync vs one backward rank {rank}"] <= TOL
    ref = reference()["traj"]["mlp", "sgd"]
    within([r["no_sync"]["snaps"] for r in res], ref, f"N={world_size} no_sync")
    within([r["every"]["snaps"] for r in res], ref, f"N={world_size} reduce every micro-batch")
    report(f"N={world_size} no")


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_buckets_are_sent_during_backward():
    """The last layer's bucket is on the wire before the first layer's weight has its gradient."""
    for r in results(2):
        o = r["overlap"]
        assert o["buckets"] == [["layers.2.bias", "layers.2.weight", "layers.1.bias"],
                                ["layers.1.weight", "layers.0.bias"], ["layers.0.weight"]]
        for s in o["steps"]:
            assert len(s["issued"]) == 3
            assert s["issued"][0] < s["first_layer"], "the first bucket waited for the end of backward"
            assert s["issued"][-1] > s["first_layer"]
