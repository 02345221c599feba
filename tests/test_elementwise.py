"""zerokit.ZeRO1 / ZeRO2 with the optimizer a user brings (zerokit/elementwise.py).

Against the unsharded torch optimizer on one process, run inside a one-rank zerokit launch (the
same thread count as the ranks: a matmul's rounding depends on it), on EdgeCaseNet (tied, frozen
and unused parameters, sizes not divisible by 2 or 3):
- N = 2, both ranks on the SAME batch: bit for bit (torch.equal) after every step, for SGD
  (momentum, nesterov, weight decay), Adam, AdamW, RMSprop and Adagrad: the mean of two
  identical gradients is exact, and each optimizer is elementwise, so a slice of a parameter is
  updated exactly as the whole;
- N = 3, each rank its own third of the batch: within 1e-5 (the sum of three gradients rounds
  in another order than one process's matmul over the whole batch);
- per-rank optimizer state 1/N of the unsharded optimizer's (up to a padding element per bucket);
- param groups, a StepLR scheduler, add_param_group after construction, state_dict round trip;
- whole-tensor optimizers are refused at construction, saying why.
"""

import copy

import pytest
import torch

import zerokit
from conftest import batch, new_model, run_ranks
from zerokit.elementwise import LocalOptimizerState
from zerokit.models import loss_for

STEPS, BATCH = 5, 12
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.01)),
}
STAGES = {"zero1": zerokit.ZeRO1, "zero2": zerokit.ZeRO2}


def _snap(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _state_numel(opt):
    states = opt.state.values() if not hasattr(opt, "local_optimizers") else [
        st for local in opt.local_optimizers() for st in local.state.values()]
    return sum(v.numel() for st in states for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _run(rank, world_size, name, stage, same_data):
    """Train EdgeCaseNet for STEPS steps; stage None: the unsharded optimizer on the whole batch."""
    cls, kw = OPTIMIZERS[name]
    model = new_model("edge")
    if stage is None:
        opt = cls([p for p in model.parameters() if p.requires_grad], **kw)
    else:
        opt = STAGES[stage](model.parameters(), cls, bucket_mb=100 * 4 / 2**20, **kw) if stage == "zero2" \
            else STAGES[stage](model.parameters(), cls, **kw)
    snaps = []
    for step in range(STEPS):
        x, y = batch("edge", step, BATCH)
        if stage is not None and not same_data:
            m = BATCH // world_size
            x, y = x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m]
        loss_for("edge", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        snaps.append(_snap(model))
    if stage is None:  # the elements that have state: every trainable parameter that ever had a gradient
        return snaps, _state_numel(opt), sum(p.numel() for p in opt.state)
    return snaps, _state_numel(opt), sum(b.shard_numel for b in opt.buckets)  # ... and this rank's shard size


def _all(rank, world_size, stages, same_data):
    return {(name, stage): _run(rank, world_size, name, stage, same_data) for name in OPTIMIZERS for stage in stages}


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_all, 1, [None], True)[0]


@pytest.mark.distributed
def test_two_ranks_on_the_same_batch_are_bitwise_equal_to_the_unsharded_optimizer(reference):
    per_rank = run_ranks(_all, 2, list(STAGES), True)
    for (name, stage), _ in per_rank[0].items():
        ref_snaps, ref_numel, stateful = reference[(name, None)]
        per_element = ref_numel // stateful  # state tensors per element: 1 for SGD's momentum, 2 for Adam's m, v
        for rank, results in enumerate(per_rank):
            snaps, numel, shard = results[(name, stage)]
            assert numel <= per_element * shard, (stage, name, rank, numel, shard)
            for step, (got, want) in enumerate(zip(snaps, ref_snaps)):
                bad = [k for k in want if not torch.equal(got[k], want[k])]
                assert not bad, f"{stage} {name} rank {rank} step {step + 1}: not bitwise equal in {bad}"
        # the state is cut in N: together the ranks hold the unsharded optimizer's state, once
        total = sum(results[(name, stage)][1] for results in per_rank)
        assert total == ref_numel, (stage, name, total, ref_numel)


@pytest.mark.distributed
def test_three_ranks_on_their_own_data_match_within_fp32_rounding(reference):
    """Not bitwise: three partial sums add in another order than one matmul over the batch."""
    per_rank = run_ranks(_all, 3, list(STAGES), False)
    worst = 0.0
    for (name, stage), (ref_snaps, *_) in ((k, reference[(k[0], None)]) for k in per_rank[0]):
        for results in per_rank:
            snaps, *_ = results[(name, stage)]
            for got, want in zip(snaps, ref_snaps):
                d = max((got[k] - want[k]).abs().max().item() for k in want)
                assert d <= 1e-5, (stage, name, d)
                worst = max(worst, d)
    assert worst > 0  # a real check: different data really does round differently


def _groups_run(rank, world_size, sharded):
    model = new_model("mlp")
    first, second, last = model.layers
    groups = [{"params": list(first.parameters()), "lr": 0.05},
              {"params": list(second.parameters()), "lr": 0.01, "momentum": 0.5}]
    if sharded:
        opt = zerokit.ZeRO1(groups, torch.optim.SGD, lr=0.02, momentum=0.9)
    else:
        opt = torch.optim.SGD(groups, lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    snaps, saved = [], None
    for step in range(6):
        if step == 2:  # the last layer joins training late
            opt.add_param_group({"params": list(last.parameters()), "lr": 0.03})
        x, y = batch("mlp", step, BATCH)
        loss_for("mlp", model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        snaps.append(_snap(model))
        if step == 3 and sharded:
            saved = copy.deepcopy(opt.state_dict())  # as torch's: it holds the live state tensors
    resumed = None
    if sharded:  # a fresh optimizer from the state_dict of step 4 must continue the same way
        model2 = new_model("mlp")
        with torch.no_grad():
            for p, q in zip(model2.parameters(), snaps[3].values()):
                p.copy_(q)
        a, b, c = model2.layers
        opt2 = zerokit.ZeRO1([{"params": list(a.parameters()), "lr": 0.05},
                              {"params": list(b.parameters()), "lr": 0.01, "momentum": 0.5}],
                             torch.optim.SGD, lr=0.02, momentum=0.9)
        opt2.add_param_group({"params": list(c.parameters()), "lr": 0.03})
        opt2.load_state_dict(saved)
        for step in (4, 5):
            x, y = batch("mlp", step, BATCH)
            loss_for("mlp", model2(x), y).backward()
            opt2.step()
            opt2.zero_grad()
        resumed = _snap(model2)
    return snaps, [g["lr"] for g in opt.param_groups], resumed


@pytest.mark.distributed
def test_param_groups_scheduler_add_param_group_and_state_dict():
    ref_snaps, ref_lrs, _ = run_ranks(_groups_run, 1, False)[0]
    for snaps, lrs, resumed in run_ranks(_groups_run, 2, True):
        assert lrs == ref_lrs
        for step, (got, want) in enumerate(zip(snaps, ref_snaps)):
            assert all(torch.equal(got[k], want[k]) for k in want), f"step {step + 1}"
        assert all(torch.equal(resumed[k], ref_snaps[-1][k]) for k in resumed), "resumed from state_dict"


def _refused(rank, world_size, cls, kw):
    model = new_model("mlp")
    try:
        zerokit.ZeRO1(model.parameters(), cls, **kw)
    except TypeError as exc:
        return str(exc)
    return None


class Whole(torch.optim.SGD):
    elementwise = False


@pytest.mark.distributed
def test_whole_tensor_optimizers_are_refused_with_the_reason():
    cases = [(torch.optim.LBFGS, {}, "line search"), (Whole, {"lr": 0.1}, "declares itself"),
             (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), {}, "a torch.optim.Optimizer class")]
    if hasattr(torch.optim, "Muon"):
        cases.append((torch.optim.Muon, {}, "orthogonalises"))
    if hasattr(torch.optim, "Adafactor"):
        cases.append((torch.optim.Adafactor, {}, "row and column"))
    for cls, kw, why in cases:
        said = run_ranks(_refused, 2, cls, kw)[0]
        assert said is not None and why in said, (cls, said)
    # a keyword the class does not take: the class's own error, at construction
    said = run_ranks(_refused, 2, torch.optim.SGD, {"lr": 0.1, "betas": (0.9, 0.99)})[0]
    assert said is not None and "unexpected keyword argument 'betas'" in said, said


def test_the_state_of_a_shard_holds_views_of_the_weights():
    from zerokit.flat import FlatBucket

    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2, 3))]
    bucket = FlatBucket(params, world_size=3, rank=1, align_bytes=16)  # offsets 0 and 8, as zerokit's stages align
    flat = bucket.flatten([p.data for p in params])
    state = LocalOptimizerState(bucket, torch.optim.SGD, {"lr": 1.0})
    shard = bucket.shard(flat)
    grad = torch.ones(bucket.shard_numel)
    state.update(shard, grad, [True, True], {"lr": 1.0})
    want = bucket.flatten([p.data for p in params])
    # the step wrote into the flat buffer through the segment views, each parameter's piece of this
    # rank's shard; the padding that aligns the parameters (zerokit.flat) is no segment, and stays zero
    where = bucket.flatten([torch.ones_like(p) for p in params])
    want[bucket.shard_start:bucket.shard_end] -= where[bucket.shard_start:bucket.shard_end]
    assert 0 < where[bucket.shard_start:bucket.shard_end].sum() < bucket.shard_numel  # both kinds in this shard
    assert torch.equal(flat, want)
