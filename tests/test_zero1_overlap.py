"""ZeRO1Adam(bucket_mb=...): each bucket reduce-scattered as soon as backward completes it.

The overlap must not change a single bit, and must not read a buffer before its transfer is
done. Checked on OddMLP and EdgeCaseNet (tied, frozen and unused parameters) with buckets of 100
elements (a larger parameter gets a bucket of its own), against ZeRO1Adam without buckets (the reduce in step()), which
tests/test_bitwise.py holds bitwise to torch.optim.AdamW at N = 2 on the same batch:
- N = 2, the same batch on both ranks: bitwise equal after every step, and equal to
  torch.optim.AdamW on one process (launched, one thread, as the ranks run);
- the same with a *lazy* reduce-scatter and all-gather (test doubles whose output is NaN
  until wait() and whose data is read from the input only at wait()): reading the shard
  before waiting, writing into the gradient buffer while it is on its way, or step()
  returning before the updated weights have arrived, changes the numbers;
- on OddMLP every bucket but the last leaves during backward (recorded at issue time); on
  EdgeCaseNet the unused parameter's bucket is the first in backward's order and holds every
  bucket behind it until step() (buckets leave in order: the ranks' collectives must match);
- N = 3, each rank its own slice: within 1e-6 of the unbucketed run (3 partial sums
  round in the ring's order, which depends on where a bucket starts);
- accumulation over 2 micro-batches (a gradient arriving after its bucket left: the
  transfer is stale and step() reduces the bucket again), with a branch that one rank
  skips in one micro-batch only, so the ranks disagree on which buckets are stale: no
  deadlock, and bitwise equal to the unbucketed run at N = 2;
- zero_grad() after a backward without a step finishes the transfers it dropped;
- bf16 weights with gradients reduced in fp32 (no hooks: the gradients are copied into the
  fp32 buffer, all in step()), or in bf16 (sent during backward: mixed precision reads every
  shard before the update), clip_grad_norm_ (which reads every shard before step()), and a
  backward with create_graph=True (whose gradients the hooks leave alone): the same numbers
  as without buckets, gradients untouched.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist

import zerokit
import zerokit.zero1
from conftest import LazyWork, poison_scratch, run_ranks
from zerokit.models import build_model, model_batch, model_loss

pytestmark = pytest.mark.distributed

STEPS, BATCH, LR, WD = 6, 12, 1e-2, 0.1
BUCKET_MB = 100 * 4 / 2**20  # 100 fp32 elements


def _lazy_reduce_scatter(real):
    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op:
            return real(output, input, op=op, group=group)
        output.fill_(float("nan"))  # nothing has arrived yet
        return LazyWork(lambda: real(output, input, op=op, group=group))  # read the input only now
    return reduce_scatter


def _lazy_all_gather(real):
    """step()'s all-gathers are in place (the input is this rank's part of the output): NaN
    everywhere else until wait(), and the input read only then."""
    def all_gather(output, input, group=None, async_op=False):
        if not async_op:
            return real(output, input, group=group)
        lo = (input.data_ptr() - output.data_ptr()) // output.element_size()
        output[:lo].fill_(float("nan"))
        output[lo + input.numel():].fill_(float("nan"))
        return LazyWork(lambda: real(output, input, group=group))
    return all_gather


def _train(rank, world_size, bucket_mb, same_data, lazy=False, micro=1, kind="edge", bf16=False, clip=None):
    poison_scratch()  # a gradient buffer's unwritten part (an unused parameter's, a padding) must never be read
    if lazy:
        zerokit.zero1.reduce_scatter = _lazy_reduce_scatter(zerokit.zero1.reduce_scatter)
        zerokit.zero1.all_gather = _lazy_all_gather(zerokit.zero1.all_gather)
    issued = []
    real = zerokit.zero1.reduce_scatter

    def recording(*args, **kwargs):
        issued.append(torch._C._current_graph_task_id() != -1)  # inside a backward?
        return real(*args, **kwargs)

    zerokit.zero1.reduce_scatter = recording
    model = build_model(kind)
    # bf16: the dtype gradients are reduced in, "fp32" or "bf16" (False: an fp32 run)
    precision = zerokit.MixedPrecision("bf16", reduce_dtype=torch.float32 if bf16 == "fp32" else None) if bf16 else None
    opt = zerokit.ZeRO1Adam(model.parameters(), lr=LR, weight_decay=WD, bucket_mb=bucket_mb, precision=precision)
    snaps = []
    for step in range(STEPS):
        x, y = model_batch(kind, BATCH, step)
        if not same_data:
            m = BATCH // world_size
            x, y = x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m]
        for k in range(micro):
            xs, ys = x[k::micro], y[k::micro]
            if kind == "branch":  # rank 1 skips the branch in the second micro-batch only
                out = model(xs, use_branch=not (rank == 1 and k == 1))
            else:
                out = model(xs.to(torch.bfloat16) if bf16 else xs).float()
            (model_loss(kind, out, ys) / micro).backward()
        if clip is not None:
            assert opt.clip_grad_norm_(clip) > clip  # it does scale the gradients
        opt.step()
        opt.zero_grad()
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snaps, issued, len(opt.buckets)


def _reference(rank, world_size, kind):
    """torch.optim.AdamW on one process (launched: one thread, as each rank)."""
    model = build_model(kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                            foreach=False)
    for step in range(STEPS):
        x, y = model_batch(kind, BATCH, step)
        model_loss(kind, model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _pair(rank, world_size, same_data, lazy=False, micro=1, kind="edge", bf16=False, clip=None):
    return (_train(rank, world_size, None, same_data, micro=micro, kind=kind, bf16=bf16, clip=clip),
            _train(rank, world_size, BUCKET_MB, same_data, lazy=lazy, micro=micro, kind=kind, bf16=bf16, clip=clip))


def _equal(a, b):
    return all(torch.equal(x[n], y[n]) for x, y in zip(a, b) for n in x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["mlp", "edge"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_two_ranks_same_batch_bitwise_as_without_buckets_and_as_adamw(lazy, kind):
    results = run_ranks(_pair, 2, True, lazy, 1, kind)
    reference = run_ranks(_reference, 1, kind)[0]
    for (plain, _, _), (bucketed, issued, n_buckets) in results:
        assert n_buckets >= 4
        assert _equal(bucketed, plain)
        assert all(torch.equal(bucketed[-1][n], reference[n]) for n in reference)
        per_step = len(issued) // STEPS
        assert per_step == n_buckets  # one reduce-scatter per bucket and step
        in_backward = sum(issued[:per_step])
        if kind == "mlp":  # every parameter gets a gradient: all but the first layer's buckets leave early
            assert in_backward >= n_buckets - 1, f"{in_backward} of {per_step} reduce-scatters during backward"
        else:  # backward reaches EdgeCaseNet's unused parameter first: its bucket holds every other back
            assert in_backward == 0


@pytest.mark.timeout(120)
def test_three_ranks_on_their_own_slices_stay_with_the_unbucketed_run():
    for (plain, _, _), (bucketed, _, _) in run_ranks(_pair, 3, False):
        worst = max(float((a[n] - b[n]).abs().max()) for a, b in zip(plain, bucketed) for n in a)
        assert worst < 1e-6, worst


@pytest.mark.timeout(120)
def test_accumulation_with_ranks_disagreeing_on_stale_buckets_is_exact():
    for (plain, _, _), (bucketed, issued, _) in run_ranks(_pair, 2, True, True, 2, "branch"):
        assert _equal(bucketed, plain)
        assert any(issued)  # some buckets left during the first backward, and were sent again


def _one_rank_skips(rank, world_size, make):
    """Rank 1 never runs the branch: on it, the branch's gradient is None, which counts as zero."""
    poison_scratch()
    model = build_model("branch")
    opt = make(model.parameters())
    for step in range(5):
        x, y = model_batch("branch", BATCH, step)
        model_loss("branch", model(x, use_branch=rank != 1), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bucket_mb", [None, BUCKET_MB], ids=["one-bucket", "buckets"])
def test_a_parameter_only_one_rank_used_is_averaged_with_zeros(bucket_mb):
    """As data parallel does (DistributedAdam: all-reduce with zeros for None). The gradient buffer
    starts uninitialised (FlatBucket.scratch), so the missing gradient must be written as zeros."""
    zero1 = run_ranks(_one_rank_skips, 2, partial(zerokit.ZeRO1Adam, lr=LR, weight_decay=WD, bucket_mb=bucket_mb))
    ddp = run_ranks(_one_rank_skips, 2, partial(zerokit.DistributedAdam, lr=LR, weight_decay=WD))
    for mine, theirs in zip(zero1, ddp):
        assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
        assert not torch.equal(mine["branch.weight"], build_model("branch").branch.weight)  # it was trained


def _dropped(rank, world_size):
    model = build_model("edge")
    opt = zerokit.ZeRO1Adam(model.parameters(), lr=LR, bucket_mb=BUCKET_MB)
    x, y = model_batch("edge", BATCH, 0)
    model_loss("edge", model(x), y).backward()
    opt.zero_grad()  # no step: the transfers backward started are finished and dropped
    model_loss("edge", model(x), y).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_zero_grad_without_a_step_finishes_the_dropped_transfers():
    a, b = run_ranks(_dropped, 2)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.timeout(60)
def test_bf16_with_fp32_reduction_sends_copies_in_step_and_matches():
    for (plain, _, _), (bucketed, issued, _) in run_ranks(_pair, 2, False, True, 1, "mlp", "fp32"):
        assert _equal(bucketed, plain)
        assert not any(issued)  # no gradient is a view of an fp32 buffer: nothing leaves during backward


@pytest.mark.timeout(60)
def test_bf16_reduced_in_bf16_waits_for_every_shard_before_converting_them():
    """Mixed precision converts every shard to fp32 (and would check them for inf) before the
    first update: a shard read before its transfer is done shows up as NaN."""
    for (plain, _, _), (bucketed, issued, _) in run_ranks(_pair, 2, False, True, 1, "mlp", "bf16"):
        assert _equal(bucketed, plain)
        assert any(issued)  # the gradients are views of a bf16 buffer: buckets leave during backward


@pytest.mark.timeout(60)
def test_clipping_reads_the_shards_after_they_arrived():
    """clip_grad_norm_, called before step(), reads every shard: each must have arrived."""
    for eager, lazy in run_ranks(_clipped, 2):  # the same buckets (one norm sums them in one order)
        assert _equal(eager, lazy)


def _clipped(rank, world_size):
    return [_train(rank, world_size, BUCKET_MB, False, lazy=lazy, kind="mlp", clip=0.05)[0] for lazy in (False, True)]


def _double_backward(rank, world_size):
    model = build_model("mlp")
    opt = zerokit.ZeRO1Adam(model.parameters(), lr=LR, bucket_mb=BUCKET_MB)
    x, y = model_batch("mlp", BATCH, 0)
    loss = model_loss("mlp", model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads)  # a gradient penalty: backward through the gradients
    (loss + penalty).backward(create_graph=True)
    kept = [p.grad.requires_grad for p in model.parameters()]
    opt.step()
    return all(kept), {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(60)
def test_create_graph_gradients_are_left_alone_and_still_reduced():
    (ok0, a), (ok1, b) = run_ranks(_double_backward, 2)
    assert ok0 and ok1 and all(torch.equal(a[n], b[n]) for n in a)
