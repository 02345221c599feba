r"""Checks for lesson 04 (ZeRO-2): gradients reduce-scattered in buckets during backward.

The student's class builds on zerokit.ZeRO1Adam (lesson 03's reference: Adam on the
shard, all-gather of the weights) and writes the three methods that make it ZeRO-2:
`_on_grad_ready` (the post-accumulate-grad hook), `_send` (one bucket's reduce-scatter)
and `_end_of_backward` (flush and wait). Each check runs it on real ranks, each rank on its
own slice of the batch, and looks at one thing:

- check_matches_adamw        numerics: the reduced gradient shard, the weights and Adam's
                             m and v against one process running torch.optim.AdamW, every step;
- check_gradients_sharded    the memory point: no .grad survives backward, each bucket's
                             full gradient is gone once it is sent, and the bytes this rank
                             holds after backward are Ψ/N gradient elements, measured;
- check_reduced_during_backward  the communication point: one reduce-scatter per bucket, in
                             bucket order, each sent as soon as its bucket is complete (counted
                             in hooks inside backward), none in step(), no all-reduce;
- check_unused_parameters    a parameter with no gradient (on every rank, or on some ranks
                             only) neither hangs nor corrupts: buckets flushed in order;
- check_accumulation         k backward calls before one step: k reduce-scatters per bucket,
                             the shards summed, the same weights as AdamW on the whole batch.

The single-process reference (torch.optim.AdamW) runs before the ranks start, in a one-rank
launch of its own (the harness forbids torch.optim.Adam/AdamW where the student's code runs,
and the notebook's process may have rebound it), cached per configuration.
"""

import gc
import inspect
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..comm import CommCounter
from ..flat import make_buckets
from ..memory import census
from ..reference import build_model, global_batch
from ..models import loss_for
from ..zero2 import ZeRO2Adam
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks

__all__ = ["check_matches_adamw", "check_gradients_sharded", "check_reduced_during_backward",
           "check_unused_parameters", "check_accumulation", "BranchNet"]

# eps 1e-6, not AdamW's default 1e-8: Adam divides each gradient element by sqrt(v) + eps, so
# an element that is ~1e-9 by cancellation (the transformer has a few) turns the rounding of a
# different summation order into weight differences of ~1e-4 at eps = 1e-8; at 1e-6, ~1e-6.
LR, WEIGHT_DECAY, EPS = 1e-2, 0.1, 1e-6
PER_MICRO = 3  # samples per rank per micro-batch
EXERCISE = ("_on_grad_ready", "_send", "_end_of_backward")


# ---------------------------------------------------------------------------------------
# models and data


class BranchNet(nn.Module):
    """An MLP with a side branch that only even ranks run (data-dependent control flow, as in
    a mixture of experts): on odd ranks the branch's parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(9, 17)
        self.branch = nn.Linear(17, 17)
        self.out = nn.Linear(17, 5)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.inp(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def _build(kind):
    if kind == "branch":
        torch.manual_seed(0)
        return BranchNet()
    return build_model(kind)


def _micro_batch(kind, step, world_size, rank, k, accum):
    """Rank `rank`'s micro-batch k of `step`: every rank a different slice of one global batch."""
    size = world_size * accum * PER_MICRO
    if kind == "branch":
        g = torch.Generator().manual_seed(7_000 + step)
        x, y = torch.randn(size, 9, generator=g), torch.randn(size, 5, generator=g)
    else:
        x, y = global_batch(kind, step, size)
    lo = (rank * accum + k) * PER_MICRO
    return x[lo:lo + PER_MICRO], y[lo:lo + PER_MICRO]


def _loss(kind, model, x, y, rank):
    if kind == "branch":
        return F.mse_loss(model(x, use_branch=rank % 2 == 0), y)
    return loss_for(kind, model(x), y)


_REFERENCES = {}  # (kind, world_size, steps, accum) -> the reference's records


def _reference(kind, world_size, steps, accum, timeout=60.0):
    """torch.optim.AdamW in one process on the mean loss over every rank's micro-batches.

    Per step: the mean gradient (before the step), then the weights and Adam's m and v after it.
    It runs in a fresh one-rank launch, not in the notebook's process, whose torch.optim.AdamW a
    cell may have rebound; the launch's one intra-op thread is what the ranks use too.
    """
    key = (kind, world_size, steps, accum)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_on_ranks(_reference_case, 1, args=(kind, world_size, steps, accum), timeout=timeout,
                                        forbid_adam=False, what="the reference (torch.optim.AdamW)")[0]
    return _REFERENCES[key]


def _reference_case(_rank, _one, kind, world_size, steps, accum):
    return _reference_run(kind, world_size, steps, accum)


def _reference_run(kind, world_size, steps, accum):
    model = _build(kind)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS, foreach=False)
    out = []
    for step in range(steps):
        for r in range(world_size):
            for k in range(accum):
                x, y = _micro_batch(kind, step, world_size, r, k, accum)
                (_loss(kind, model, x, y, r) / (world_size * accum)).backward()
        rec = {"grads": {n: None if p.grad is None else p.grad.clone() for n, p in named}}
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        rec["exp_avg"] = {n: opt.state[p]["exp_avg"].clone() for n, p in named if p in opt.state}
        rec["exp_avg_sq"] = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in named if p in opt.state}
        out.append(rec)
    return out


# ---------------------------------------------------------------------------------------
# before the ranks start


def _validate(cls):
    """The class is the student's ZeRO-2, not zerokit's under another name (in the notebook's process, so
    CheckFailed: no harness turns an AssertionError into one here)."""
    if not isinstance(cls, type):
        raise CheckFailed(f"expected your optimizer class (MyZeRO2Adam), got {type(cls).__name__}")
    if issubclass(cls, ZeRO2Adam):
        raise CheckFailed(f"{cls.__name__} subclasses zerokit.ZeRO2Adam, the class this exercise re-implements: "
                          "build on zerokit.ZeRO1Adam, as the scaffold does, and write the hook yourself")
    for name in EXERCISE:
        mine, theirs = getattr(cls, name, None), getattr(ZeRO2Adam, name)
        if mine is None:
            raise CheckFailed(f"{cls.__name__} has no method {name}: keep the scaffold's method names")
        # unwrap: every @torch.no_grad() method shares the decorator's own code object
        if mine is theirs or getattr(inspect.unwrap(mine), "__code__", None) is inspect.unwrap(theirs).__code__:
            raise CheckFailed(f"{cls.__name__}.{name} is zerokit.ZeRO2Adam.{name}: write it yourself")


def _bucket_mb(bucket_numel):
    """bucket_mb for buckets of bucket_numel fp32 elements (exact: a power-of-two division)."""
    return bucket_numel * 4 / 2**20


# ---------------------------------------------------------------------------------------
# inside the workers


def _setup(rank, world_size, cls, kind, bucket_numel):
    """The model, the student's optimizer, the buckets it must use and a name per parameter."""
    model = _build(kind)
    opt = cls(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS, bucket_mb=_bucket_mb(bucket_numel))
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = make_buckets(trainable, world_size, rank, bucket_numel)
    name_of = {p: n for n, p in model.named_parameters()}
    got = [[name_of.get(p, "?") for p in b.params] for b in getattr(opt, "buckets", [])]
    want = [[name_of[p] for p in b.params] for b in expected]
    if got != want:
        raise AssertionError(f"your optimizer's buckets are {got}, expected {want} (keep the scaffold's _make_buckets)")
    return model, opt, expected, name_of


def _bucket_label(bi, bucket, name_of):
    names = [name_of[p] for p in bucket.params]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"bucket {bi} ({shown})"


def _grad_shards(opt, bi, label):
    shards = getattr(opt, "grad_shards", None)
    if not isinstance(shards, list) or len(shards) != len(opt.buckets):
        raise AssertionError("opt.grad_shards must stay a list with one entry per bucket (the scaffold sets it up)")
    g = shards[bi]
    if g is None:
        raise AssertionError(f"after backward, grad_shards[{bi}] is None for {label}: _end_of_backward must wait "
                             "for each bucket's reduce-scatter and keep its output in grad_shards")
    if not isinstance(g, torch.Tensor):
        raise AssertionError(f"grad_shards[{bi}] is a {type(g).__name__}, expected a tensor")
    return g


def _state_shard(bucket, ref, name_of):
    """This rank's shard of a reference per-parameter tensor dict (zeros where a parameter has none)."""
    return bucket.shard_of([ref.get(name_of[p]) for p in bucket.params])


def _numerics_case(rank, world_size, cls, kind, bucket_numel, ref):
    model, opt, buckets, name_of = _setup(rank, world_size, cls, kind, bucket_numel)
    for step, want in enumerate(ref):
        x, y = _micro_batch(kind, step, world_size, rank, 0, 1)
        _loss(kind, model, x, y, rank).backward()
        for bi, b in enumerate(buckets):
            label = _bucket_label(bi, b, name_of)
            expected = _state_shard(b, {n: g for n, g in want["grads"].items() if g is not None}, name_of)
            assert_close(_grad_shards(opt, bi, label), expected,
                         f"step {step + 1}: this rank's shard of the mean gradient of {label} "
                         "(reduce-scatter with ReduceOp.AVG: the mean over ranks, not the sum)",
                         atol=1e-6, rtol=1e-4)
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            assert_close(p.detach(), want["params"][name], f"step {step + 1}: parameter {name} after the step")
        for bi, (b, st) in enumerate(zip(buckets, opt.shards)):
            label = _bucket_label(bi, b, name_of)
            assert_close(st.exp_avg, _state_shard(b, want["exp_avg"], name_of),
                         f"step {step + 1}: Adam's m (exp_avg) for this rank's shard of {label}", atol=1e-6, rtol=1e-4)
            assert_close(st.exp_avg_sq, _state_shard(b, want["exp_avg_sq"], name_of),
                         f"step {step + 1}: Adam's v (exp_avg_sq) for this rank's shard of {label}",
                         atol=1e-10, rtol=1e-3)
    return True


def _params_case(rank, world_size, cls, kind, bucket_numel, ref, accum):
    """Weights after every step, against the reference; `accum` backward calls per step.

    Returns the reducing collectives counted in each backward call and the bucket count.
    """
    model, opt, buckets, name_of = _setup(rank, world_size, cls, kind, bucket_numel)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    counts = []
    for step, want in enumerate(ref):
        for k in range(accum):
            x, y = _micro_batch(kind, step, world_size, rank, k, accum)
            with CommCounter() as comm:
                (_loss(kind, model, x, y, rank) / accum).backward()
            # how the gradient is reduced is check_reduced_during_backward's business: count
            # every reducing collective, so this check is only about "once per backward"
            counts.append(sum(comm.count(op) for op in ("reduce_scatter", "all_reduce", "reduce")))
            # a .grad left behind is check_gradients_sharded's business; dropping it here
            # keeps this check about summing the shards of several backward calls
            for _, p in trainable:
                p.grad = None
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            hint = "" if accum == 1 else (f" ({accum} backward calls before this step: each one's reduced shard "
                                          "must be added to grad_shards, not replace it)")
            assert_close(p.detach(), want["params"][name], f"step {step + 1}: parameter {name} after the step{hint}")
    return {"reductions": counts, "buckets": len(buckets)}


def _watch(model, name_of, counter, log):
    """Hooks that run after the optimizer's own (registered later): record, per arriving
    gradient, how many reduce-scatters had been issued and which gradients were still alive."""
    params = [p for p in model.parameters() if p.requires_grad]

    def hook(param):
        alive = [name_of[p] for p in params if p.grad is not None]
        log.append((name_of[param], counter.count("reduce_scatter"), alive))

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


def _expected_sent(arrived, buckets, name_of):
    """Buckets 0..k-1 complete among the arrived gradients: what has to be sent by now."""
    k = 0
    while k < len(buckets) and all(name_of[p] in arrived for p in buckets[k].params):
        k += 1
    return k


def _sharded_case(rank, world_size, cls, kind, bucket_numel, steps):
    model, opt, buckets, name_of = _setup(rank, world_size, cls, kind, bucket_numel)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for step in range(steps):
        x, y = _micro_batch(kind, step, world_size, rank, 0, 1)
        log = []
        with CommCounter() as comm:
            handles = _watch(model, name_of, comm, log)
            _loss(kind, model, x, y, rank).backward()
        for h in handles:
            h.remove()
        kept = [n for n, p in trainable if p.grad is not None]
        if kept:
            raise AssertionError(f"step {step + 1}: after backward, {kept[0]}.grad is still set "
                                 f"({len(kept)} of {len(trainable)} parameters keep a full gradient): ZeRO-2 keeps "
                                 "only this rank's shard of each bucket's mean gradient; set .grad to None once sent")
        for name, sent, alive in log:  # each sent bucket's full gradient is already gone
            for bi in range(min(sent, len(buckets))):
                kept = [name_of[p] for p in buckets[bi].params if name_of[p] in alive]
                if kept:
                    raise AssertionError(
                        f"step {step + 1}: when the gradient of {name} arrived, {_bucket_label(bi, buckets[bi], name_of)} "
                        f"had been sent, but {kept[0]}.grad was still alive: set each parameter's .grad to None "
                        "as soon as its bucket is flattened for the reduce-scatter")
        for bi, b in enumerate(buckets):
            g = _grad_shards(opt, bi, _bucket_label(bi, b, name_of))
            if g.numel() != b.shard_numel:
                raise AssertionError(f"grad_shards[{bi}] has {g.numel()} elements, expected this rank's shard: "
                                     f"{b.shard_numel} = {b.padded_numel} / {world_size}")
            held = g.untyped_storage().nbytes()
            if held > g.numel() * g.element_size():
                raise AssertionError(
                    f"grad_shards[{bi}] is a view into a buffer of {held // g.element_size()} elements "
                    f"({_bucket_label(bi, b, name_of)} has {b.numel}): the full gradient stays alive behind it; "
                    f"keep only the {b.shard_numel}-element output of a reduce-scatter")
        opt.step()
        opt.zero_grad()
    # measured: what this rank holds after backward beyond what it held at rest
    x, y = _micro_batch(kind, steps, world_size, rank, 0, 1)
    gc.collect()
    at_rest = census(model, opt)["total"]
    loss = _loss(kind, model, x, y, rank)
    loss.backward()
    del loss
    psi = sum(p.numel() for _, p in trainable)
    shard_bytes = 4 * sum(b.shard_numel for b in buckets)
    # gloo's threads let go of a finished transfer's buffers a moment after wait() returns
    # (seen once in ~10 runs: a full flat buffer still alive): look again for up to 1 s.
    # What the optimizer itself keeps stays, however long we wait.
    for _ in range(20):
        gc.collect()
        grown = census(model, opt)["total"] - at_rest
        if grown <= 1.25 * shard_bytes + 1024:
            break
        time.sleep(0.05)
    if grown > 1.25 * shard_bytes + 1024:
        raise AssertionError(
            f"after backward this rank holds {grown} bytes more than at rest; its gradient shard is {shard_bytes} "
            f"bytes (Ψ/N = {psi}/{world_size} elements x 4), a full gradient {4 * psi}: something keeps "
            "full-size gradient buffers alive (the flat buffers sent, or .grad)")
    opt.step()
    opt.zero_grad()
    return {"grown": grown, "shard_bytes": shard_bytes, "psi": psi}


def _timing_case(rank, world_size, cls, kind, bucket_numel, steps):
    model, opt, buckets, name_of = _setup(rank, world_size, cls, kind, bucket_numel)
    want_sizes = [b.padded_numel for b in buckets]
    out = {}
    for step in range(steps):
        x, y = _micro_batch(kind, step, world_size, rank, 0, 1)
        log = []
        with CommCounter() as in_backward:
            handles = _watch(model, name_of, in_backward, log)
            _loss(kind, model, x, y, rank).backward()
        for h in handles:
            h.remove()
        with CommCounter() as in_step:
            opt.step()
        opt.zero_grad()
        ops = in_backward.table()
        if "all_reduce" in ops:
            raise AssertionError(
                f"backward made {ops['all_reduce']['calls']} all-reduce(s) ({ops['all_reduce']['volume'] // 2} "
                "elements): ZeRO-2 reduce-scatters, since each rank needs only its shard of the mean gradient; "
                "an all-reduce moves twice the data and leaves the full gradient on every rank")
        funnel = [op for op in ("reduce", "scatter", "gather", "broadcast") if op in ops]
        if funnel:
            raise AssertionError(
                f"backward used {' + '.join(funnel)}: gradients funnelled through one rank, which holds the full "
                "gradient and carries N times the traffic; one reduce-scatter per bucket gives every rank its shard")
        sizes = [c.numel for c in in_backward.calls if c.op == "reduce_scatter"]
        if sizes != want_sizes:
            raise AssertionError(
                f"step {step + 1}: backward made {len(sizes)} reduce-scatter(s) of {sizes} elements; expected one per "
                f"bucket, in bucket order: {len(want_sizes)} of {want_sizes} (each bucket's padded flat gradient)")
        arrived = set()
        for i, (name, sent, _) in enumerate(log):
            arrived.add(name)
            due = _expected_sent(arrived, buckets, name_of)
            if sent < due:
                raise AssertionError(
                    f"step {step + 1}: when the gradient of {name} arrived (gradient {i + 1} of {len(log)}), buckets "
                    f"0..{due - 1} were complete but only {sent} reduce-scatter(s) had been issued: send each bucket "
                    "from the hook as soon as its last gradient arrives, not at the end of backward")
            if sent > due:
                raise AssertionError(
                    f"step {step + 1}: when the gradient of {name} arrived, {sent} reduce-scatter(s) had been issued "
                    f"but only {due} bucket(s) were complete (in order): a bucket went out before all its gradients "
                    "were in, or out of order")
        if in_step.count("reduce_scatter"):
            raise AssertionError(f"step() made {in_step.count('reduce_scatter')} reduce-scatter(s): ZeRO-2 reduces "
                                 "every gradient during backward; step() only updates the shard and all-gathers")
        out = {"backward": ops, "step": in_step.table(), "buckets": len(buckets),
               "psi": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    return out


# ---------------------------------------------------------------------------------------
# in the notebook


def _run(case, cls, world_size, args, what, timeout):
    __tracebackhide__ = True
    _validate(cls)
    return run_on_ranks(case, world_size, args=(cls, *args), what=what, timeout=timeout)


def check_matches_adamw(cls, world_size=2, kind="mlp", bucket_numel=300, steps=4, timeout=60.0):
    """Every step: each rank's reduced gradient shard, the weights, and Adam's m and v shards
    equal one process running torch.optim.AdamW on the whole batch."""
    __tracebackhide__ = True
    ref = _reference(kind, world_size, steps, 1, timeout)
    _run(_numerics_case, cls, world_size, (kind, bucket_numel, ref), f"{cls.__name__} on {kind}", timeout)
    passed(f"{cls.__name__} matches torch.optim.AdamW on {world_size} ranks ({kind}, buckets of {bucket_numel}): "
           f"gradient shards, weights and Adam's m, v after each of {steps} steps")


def check_gradients_sharded(cls, world_size=2, kind="mlp", bucket_numel=300, steps=2, timeout=60.0):
    """No full gradient survives: .grad is None after backward, each bucket's gradients are
    freed when it is sent, grad_shards hold Ψ/N elements, and the bytes measured agree."""
    __tracebackhide__ = True
    res = _run(_sharded_case, cls, world_size, (kind, bucket_numel, steps), f"{cls.__name__} on {kind}", timeout)
    r = res[0]
    passed(f"{cls.__name__} keeps no full gradient on {world_size} ranks ({kind}): every .grad is None after "
           f"backward; measured {r['grown']} bytes of gradient per rank, its shard {r['shard_bytes']} "
           f"(Ψ/N = {r['psi']}/{world_size} elements), a full gradient {4 * r['psi']}")


def check_reduced_during_backward(cls, world_size=2, kind="mlp", bucket_numel=300, steps=2, timeout=60.0):
    """One reduce-scatter per bucket, in order, each issued as soon as its bucket is complete;
    none in step(); no all-reduce."""
    __tracebackhide__ = True
    res = _run(_timing_case, cls, world_size, (kind, bucket_numel, steps), f"{cls.__name__} on {kind}", timeout)
    r = res[0]
    rs, ag = r["backward"]["reduce_scatter"], r["step"].get("all_gather", {"calls": 0, "volume": 0})
    passed(f"{cls.__name__} reduce-scatters during backward on {world_size} ranks ({kind}, buckets of "
           f"{bucket_numel}): {rs['calls']} buckets, each sent as soon as complete; per step reduce-scatter "
           f"{rs['volume']} + all-gather {ag['volume']} elements = 2Ψ + padding (Ψ = {r['psi']})")


def check_unused_parameters(cls, world_size=2, kinds=("edge", "branch"), bucket_numel=100, steps=3, timeout=60.0):
    """Parameters without a gradient (on every rank: "edge"; on odd ranks only: "branch")
    neither hang nor corrupt: the weights follow torch.optim.AdamW every step."""
    __tracebackhide__ = True
    for kind in kinds:
        ref = _reference(kind, world_size, steps, 1, timeout)
        what = {"edge": f"{cls.__name__} on a model with an unused parameter",
                "branch": f"{cls.__name__} on a model whose branch gets a gradient on even ranks only"}.get(kind, kind)
        try:
            _run(_params_case, cls, world_size, (kind, bucket_numel, ref, 1), what, timeout)
        except CheckFailed as exc:
            raise CheckFailed(f"{exc}\n  (every rank must issue the same reduce-scatters in the same order: buckets "
                              "0, 1, 2, ... strictly in turn, and at the end of backward every bucket not sent yet, "
                              "with zeros for the gradients that never came)") from None
    passed(f"{cls.__name__} handles parameters without a gradient on {world_size} ranks ({', '.join(kinds)}): "
           f"no hang, weights match torch.optim.AdamW for {steps} steps")


def check_accumulation(cls, world_size=2, kind="mlp", bucket_numel=300, accum=3, steps=3, timeout=60.0):
    """`accum` backward calls per step: accum reduce-scatters per bucket, shards summed, and
    the weights of torch.optim.AdamW on the whole batch."""
    __tracebackhide__ = True
    ref = _reference(kind, world_size, steps, accum, timeout)
    res = _run(_params_case, cls, world_size, (kind, bucket_numel, ref, accum), f"{cls.__name__} on {kind}", timeout)
    for rank, r in enumerate(res):
        want = [r["buckets"]] * (accum * steps)
        if r["reductions"] != want:
            raise CheckFailed(f"[rank {rank}] with {accum} backward calls per step, the backward calls made "
                              f"{r['reductions']} gradient reductions; expected {r['buckets']} in every one "
                              f"(one per bucket: ZeRO-2 reduces whatever each backward produced)")
    passed(f"{cls.__name__} accumulates {accum} micro-batches on {world_size} ranks ({kind}): "
           f"{accum} x {res[0]['buckets']} reduce-scatters per step, weights match torch.optim.AdamW")
