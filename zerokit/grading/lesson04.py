r"""Checks for lesson 04 (ZeRO-2): gradients reduce-scattered in buckets during backward.

The student's class builds on zerokit.ZeRO1Adam (lesson 03's reference: Adam on the
shard, all-gather of the weights) and writes the three methods that make it ZeRO-2:
`_on_grad_ready` (the post-accumulate-grad hook), `send` (one bucket's reduce-scatter)
and `_end_of_backward` (flush and wait). Each check runs it on real ranks, each rank on its
own slice of the batch, and looks at one thing:

- check_numerics             the reduced gradient shard, the weights and Adam's m and v
                             against one process running torch.optim.AdamW, every step;
- check_memory               the stage's point: no .grad survives backward, each bucket's
                             full gradient is gone once it is sent, and the bytes this rank
                             holds after backward are Ψ/N gradient elements, measured;
- check_traffic              one reduce-scatter per bucket, in bucket order, each sent as soon
                             as its bucket is complete (counted in hooks inside backward; a
                             gradient that completes several buckets sends them all), each left
                             to travel (its work, a kit.LazyWork, not waited for in the hook
                             that sent it), on the optimizer's group, none in step(), no all-reduce;
- check_unused_parameters    a parameter with no gradient (on every rank, or on some ranks
                             only) neither hangs nor corrupts: buckets flushed in order;
- check_accumulation         k backward calls before one step, each on its own micro-batch, .grad
                             left as the student's code leaves it: after EVERY backward the
                             shards hold the running sum of the micro-batches' mean gradients
                             (plain autograd in the worker is the yardstick), k reduce-scatters
                             per bucket, and the weights of AdamW on the whole batch.

The optional stretch, ungraded: `check_clipping(fn)` runs the student's
clip_sharded_grad_norm_(optimizer, max_norm) on zerokit.ZeRO2Adam against
torch.nn.utils.clip_grad_norm_ and AdamW in one process; `try_stretch(fn)` is what the
notebook's ungraded cell calls: it checks fn if defined and prints ✓ or the reason, never raising.

The single-process reference (torch.optim.AdamW) runs before the ranks start, in a one-rank
launch of its own (the harness forbids torch.optim.Adam/AdamW where the student's code runs,
and the notebook's process may have rebound it), cached per configuration.
"""

import contextlib
import gc
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ..comm import CommCounter
from ..flat import make_buckets
from ..memory import census
from ..models import build_model, model_loss
from ..zero2 import ZeRO2Adam
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks
from .kit import try_stretch as run_stretch
from .kit import (SHARDED_HYPER, LazyWork, adamw_reference, alias, assert_adam_shards, bucket_label, check_class,
                  gather_object, global_batch, refusing, renamed_args, state_shard)

__all__ = ["check_numerics", "check_memory", "check_traffic", "check_unused_parameters", "check_accumulation",
           "check_clipping", "try_stretch"]

HYPER = SHARDED_HYPER  # eps 1e-6, not AdamW's default 1e-8: kit says why
PER_MICRO = 3  # samples per rank per micro-batch
EXERCISE = ("_on_grad_ready", "send", "_end_of_backward")

# which of kit.SITUATIONS the hidden tests meet (tests/test_situations.py holds this to them)
_NO_UNITS = "n/a: ZeRO-2 hooks each parameter's gradient, not modules: no unit, its outputs or its owner is involved"
SITUATIONS = {
    "zero-grad-shard": "check_numerics: sparse-embed",
    "frozen": "check_unused_parameters: edge",
    "tied": "check_unused_parameters: edge",
    "unused": "check_unused_parameters: edge",  # and "branch": no gradient on some ranks only
    "sits-out": "check_unused_parameters: branch",
    "n3": "check_numerics: world_size=3",  # and check_memory, check_accumulation, check_unused_parameters
    "subgroup": "check_traffic: group_ranks=(1, 2)",
    # LayerNorm's weight gradient arrives before its bias's, which sits in the bucket before
    "out-of-order": "check_traffic: bucket_numel=30",
    "peak-memory": "check_memory",  # while backward runs: a sent bucket's .grad already gone
    "tuple-output": _NO_UNITS,
    "root-params": _NO_UNITS,
    "eval-no-grad": "n/a: the exercise's code runs only in gradient hooks: a forward under torch.no_grad makes no "
                    "gradient and calls none of it",
    "fp16-scale": "n/a: lesson 04 trains in float32; the loss scale arrives with mixed precision in lesson 06",
    "zero3": "n/a: the exercise is ZeRO-2 only; ZeRO-3's gradients (lesson 05) are checked there",
}


# ---------------------------------------------------------------------------------------
# data, and the reference


def _micro_batch(model, step, world_size, rank, k, accum):
    """Rank `rank`'s micro-batch k of `step`: every rank a different slice of one global batch."""
    x, y = global_batch(model, step, world_size * accum * PER_MICRO)
    lo = (rank * accum + k) * PER_MICRO
    return x[lo:lo + PER_MICRO], y[lo:lo + PER_MICRO]


def _loss(model, net, x, y, rank):
    if model == "branch":  # the side branch runs on even ranks only (zerokit.models.BranchNet)
        return F.mse_loss(net(x, use_branch=rank % 2 == 0), y)
    return model_loss(model, net(x), y)


def _whole_batch(net, step, model, world_size, accum):
    """The reference's gradient: the mean loss over every rank's micro-batches, in one process."""
    for r in range(world_size):
        for k in range(accum):
            x, y = _micro_batch(model, step, world_size, r, k, accum)
            (_loss(model, net, x, y, r) / (world_size * accum)).backward()


def _reference(model, world_size, steps, accum, timeout):
    return adamw_reference(model, steps, HYPER, _whole_batch, (model, world_size, accum), timeout=timeout)


def _validate(cls):
    """The class is the student's ZeRO-2, not zerokit's under another name."""
    check_class(cls, "your optimizer class (MyZeRO2Adam)",
                refuse=[(ZeRO2Adam, "the class this exercise re-implements; build on zerokit.ZeRO1Adam, as the "
                         "scaffold does, and write the hook yourself")],
                methods=EXERCISE, written_in=(ZeRO2Adam,))


def _bucket_mb(bucket_numel):
    """bucket_mb for buckets of bucket_numel fp32 elements (exact: a power-of-two division)."""
    return bucket_numel * 4 / 2**20


# ---------------------------------------------------------------------------------------
# inside the workers


def _setup(rank, world_size, cls, model_name, bucket_numel, group=None):
    """The model, the student's optimizer, the buckets it must use and a name per parameter.
    group: the optimizer's process group (world_size and rank are then the group's)."""
    model = build_model(model_name)
    opt = cls(model.parameters(), bucket_mb=_bucket_mb(bucket_numel), **HYPER,
              **({} if group is None else {"group": group}))
    trainable = [p for p in model.parameters() if p.requires_grad]
    expected = make_buckets(trainable, world_size, rank, bucket_numel)
    name_of = {p: n for n, p in model.named_parameters()}
    got = [[name_of.get(p, "?") for p in b.params] for b in getattr(opt, "buckets", [])]
    want = [[name_of[p] for p in b.params] for b in expected]
    if got != want:
        raise AssertionError(f"your optimizer's buckets are {got}, expected {want} (keep the scaffold's _make_buckets)")
    return model, opt, expected, name_of


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


def _numerics_case(rank, world_size, cls, model_name, bucket_numel, ref):
    model, opt, buckets, name_of = _setup(rank, world_size, cls, model_name, bucket_numel)
    for step, want in enumerate(ref):
        x, y = _micro_batch(model_name, step, world_size, rank, 0, 1)
        _loss(model_name, model, x, y, rank).backward()
        for bi, b in enumerate(buckets):
            label = bucket_label(bi, b, name_of)
            expected = state_shard(b, {n: g for n, g in want["grads"].items() if g is not None}, name_of)
            got = _grad_shards(opt, bi, label)
            what = f"step {step + 1}: this rank's shard of the mean gradient of {label}"
            if world_size > 1 and got.shape == expected.shape and bool(expected.abs().max() > 0) and \
                    torch.allclose(got, world_size * expected, atol=1e-6, rtol=1e-4):
                raise AssertionError(f"{what} is {world_size} x the mean (N = {world_size}): the reduce-scatter "
                                     "summed the ranks' gradients; the loss is a mean over the whole batch, so "
                                     "reduce-scatter with ReduceOp.AVG, the mean over ranks, not the sum")
            assert_close(got, expected, f"{what} (reduce-scatter with ReduceOp.AVG: the mean over ranks, not the sum)",
                         atol=1e-6, rtol=1e-4)
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            assert_close(p.detach(), want["params"][name], f"step {step + 1}: parameter {name} after the step")
        assert_adam_shards(opt.shards, buckets, want, name_of, f"step {step + 1}")
    return True


ORDER_RULE = ("every rank must issue the same reduce-scatters in the same order: buckets 0, 1, 2, ... strictly in "
              "turn, and at the end of backward every bucket not sent yet, with zeros for the gradients that never "
              "came")


def _params_case(rank, world_size, cls, model_name, bucket_numel, ref):
    """Weights after every step, against the reference (one backward per step). Wrong weights are
    explained from the gradient shards backward left (kept before the step): the rule of
    check_unused_parameters only where a bucket's shard is missing or wrong."""
    model, opt, buckets, name_of = _setup(rank, world_size, cls, model_name, bucket_numel)
    weights = None  # the zoo's initial weights, as the reference's
    for step, want in enumerate(ref):
        x, y = _micro_batch(model_name, step, world_size, rank, 0, 1)
        _loss(model_name, model, x, y, rank).backward()
        shards = getattr(opt, "grad_shards", None)
        kept = [g.detach().clone() if isinstance(g, torch.Tensor) else g for g in shards] \
            if isinstance(shards, list) else None
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            try:
                assert_close(p.detach(), want["params"][name], f"step {step + 1}: parameter {name} after the step")
            except AssertionError as exc:
                cause = _shard_cause(model_name, weights, step, world_size, kept, buckets, name_of)
                raise AssertionError(f"{exc} ({cause})") from None
        weights = want["params"]
    return True


def _shard_cause(model_name, weights, step, world_size, kept, buckets, name_of):
    """Why the weights after `step` are wrong, read from this rank's gradient shards after backward."""
    expected = _micro_gradients(model_name, weights, step, world_size, 1)[0]
    expected = {n: g for n, g in expected.items() if g is not None}
    if kept is None or len(kept) != len(buckets):
        return ORDER_RULE
    for bi, b in enumerate(buckets):
        got, want = kept[bi], state_shard(b, expected, name_of)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"after backward grad_shards[{bi}] was {'None' if got is None else 'not its shard'}: {ORDER_RULE}"
        if torch.allclose(got, want, atol=1e-6, rtol=1e-4):
            continue
        if bool(want.abs().max() > 0) and torch.allclose(got, world_size * want, atol=1e-6, rtol=1e-4):
            return (f"after backward grad_shards[{bi}] was {world_size} x the mean gradient: the reduce-scatter "
                    "summed; average over the ranks (ReduceOp.AVG)")
        return f"after backward grad_shards[{bi}] was not this rank's shard of the mean gradient: {ORDER_RULE}"
    return ("the gradient shards were right after backward, so the difference comes from the step, not from "
            "the reduce-scatters")


def _micro_gradients(model_name, weights, step, world_size, accum):
    """The independent yardstick of accumulation: plain autograd in this process, at the weights
    the step starts from (None: the zoo's initial weights). Entry k: the mean over ranks of micro-batch k's gradient (its loss
    divided by accum), {name: tensor or None}."""
    net = build_model(model_name)  # step 1 starts from the zoo's weights, as the reference does
    if weights is not None:
        with torch.no_grad():
            for name, p in net.named_parameters():
                p.copy_(weights[name])
    out = []
    for k in range(accum):
        net.zero_grad(set_to_none=True)
        for r in range(world_size):
            x, y = _micro_batch(model_name, step, world_size, r, k, accum)
            (_loss(model_name, net, x, y, r) / (accum * world_size)).backward()
        out.append({n: None if p.grad is None else p.grad.detach().clone()
                    for n, p in net.named_parameters() if p.requires_grad})
    return out


def _running_sums(micro):
    """After backward k: the sum of entries 0..k of micro (None where no entry had a gradient)."""
    sums, total = [], {}
    for grads in micro:
        for n, g in grads.items():
            if g is not None:
                total[n] = g.clone() if total.get(n) is None else total[n] + g
        sums.append({n: g.clone() for n, g in total.items()})
    return sums


def _accumulation_case(rank, world_size, cls, model_name, bucket_numel, ref, accum):
    """`accum` backward calls per step, each on its own micro-batch: after EVERY backward this
    rank's grad_shards must hold the sum of the micro-batches' mean gradients so far, and after
    the step the weights must be AdamW's. .grad is left as the student's code leaves it.

    Returns the reducing collectives counted in each backward call and the bucket count.
    """
    model, opt, buckets, name_of = _setup(rank, world_size, cls, model_name, bucket_numel)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    counts = []
    weights = None  # where each step starts: the zoo's initial weights, then AdamW's after each step
    for step, want in enumerate(ref):
        micro = _micro_gradients(model_name, weights, step, world_size, accum)
        expected_after = _running_sums(micro)
        kept_before = []  # parameters whose .grad the previous backward left set
        for k in range(accum):
            x, y = _micro_batch(model_name, step, world_size, rank, k, accum)
            with CommCounter() as comm:
                (_loss(model_name, model, x, y, rank) / accum).backward()
            # how the gradient is reduced is check_traffic's business: count every reducing
            # collective, so this check is only about "once per backward"
            counts.append(sum(comm.count(op) for op in ("reduce_scatter", "all_reduce", "reduce")))
            when = f"step {step + 1}, after backward {k + 1} of {accum}"
            for bi, b in enumerate(buckets):
                label = bucket_label(bi, b, name_of)
                got = _grad_shards(opt, bi, label)
                expected = state_shard(b, expected_after[k], name_of)
                try:
                    assert_close(got, expected, f"{when}: grad_shards[{bi}], this rank's shard of the summed mean "
                                 f"gradients of {label}", atol=1e-6, rtol=1e-4)
                except AssertionError as exc:
                    raise AssertionError(_accumulation_hint(str(exc), got, b, micro[k], kept_before, name_of, when, k)) \
                        from None
            kept_before = [n for n, p in trainable if p.grad is not None]
        opt.step()
        opt.zero_grad()
        for name, p in model.named_parameters():
            assert_close(p.detach(), want["params"][name], f"step {step + 1}: parameter {name} after the step "
                         f"({accum} backward calls before it)")
        weights = want["params"]
    return {"reductions": counts, "buckets": len(buckets)}


def _accumulation_hint(message, got, bucket, this_micro, kept_before, name_of, when, k):
    """Why the shard after backward k+1 is wrong, first, where the numbers say it; the comparison after."""
    if kept_before:
        cause = (f"{when}: {kept_before[0]}.grad is still set from the previous backward ({len(kept_before)} "
                 "parameter(s) keep a full gradient), so autograd added this micro-batch's gradient into it and sent "
                 "the earlier micro-batches again (k·g1 + (k-1)·g2 + ... instead of g1 + g2 + ...): set .grad to "
                 "None once its bucket is sent")
    else:
        only_this = state_shard(bucket, {n: g for n, g in this_micro.items() if g is not None}, name_of)
        if k > 0 and torch.allclose(got, only_this, atol=1e-6, rtol=1e-4):
            cause = (f"{when}: grad_shards holds only this backward's micro-batch: each backward's reduced shard "
                     "must be added to grad_shards, not replace it")
        else:
            cause = (f"{when}: grad_shards is not the sum of the micro-batches' mean gradients so far (each backward "
                     "reduce-scatters the mean over ranks of its own micro-batch, and adds it to grad_shards)")
    return f"{cause}\n  {message}"


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


def _sharded_case(rank, world_size, cls, model_name, bucket_numel, steps):
    model, opt, buckets, name_of = _setup(rank, world_size, cls, model_name, bucket_numel)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for step in range(steps):
        x, y = _micro_batch(model_name, step, world_size, rank, 0, 1)
        log = []
        with CommCounter() as comm:
            handles = _watch(model, name_of, comm, log)
            _loss(model_name, model, x, y, rank).backward()
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
                        f"step {step + 1}: when the gradient of {name} arrived, {bucket_label(bi, buckets[bi], name_of)} "
                        f"had been sent, but {kept[0]}.grad was still alive: set each parameter's .grad to None "
                        "as soon as its bucket is flattened for the reduce-scatter")
        for bi, b in enumerate(buckets):
            g = _grad_shards(opt, bi, bucket_label(bi, b, name_of))
            if g.numel() != b.shard_numel:
                raise AssertionError(f"grad_shards[{bi}] has {g.numel()} elements, expected this rank's shard: "
                                     f"{b.shard_numel} = {b.padded_numel} / {world_size}")
            held = g.untyped_storage().nbytes()
            if held > g.numel() * g.element_size():
                raise AssertionError(
                    f"grad_shards[{bi}] is a view into a buffer of {held // g.element_size()} elements "
                    f"({bucket_label(bi, b, name_of)} has {b.numel}): the full gradient stays alive behind it; "
                    f"keep only the {b.shard_numel}-element output of a reduce-scatter")
        opt.step()
        opt.zero_grad()
    # measured: what this rank holds after backward beyond what it held at rest
    x, y = _micro_batch(model_name, steps, world_size, rank, 0, 1)
    gc.collect()
    at_rest = census(model, opt)["total"]
    loss = _loss(model_name, model, x, y, rank)
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


class _SendWork(LazyWork):
    """The work of one reduce-scatter issued during backward, as the student's code receives it:
    kit.LazyWork (the data arrives only at wait()), remembering when it was issued and when waited
    for, counted in gradients arrived (the check's hooks, after the optimizer's) and transfers issued."""

    def __init__(self, work, output, sends, blocking):
        super().__init__(work, output)
        self.sends, self.blocking = sends, blocking
        self.index, self.issued_at = len(sends["works"]), sends["arrived"]()
        self.issuer = sends["in_send"]  # a token of the send call that issued it (None: issued elsewhere)
        # at the first wait: gradients arrived and transfers issued by then, and inside which send
        self.waited_at = self.issued_by_then = None
        self.in_own_send = self.in_later_send = False

    def wait(self, *args, **kwargs):
        if self.waited_at is None:
            now = self.sends["in_send"]
            self.waited_at, self.issued_by_then = self.sends["arrived"](), len(self.sends["works"])
            self.in_own_send = now is not None and now is self.issuer
            self.in_later_send = now is not None and now is not self.issuer
        return super().wait(*args, **kwargs)

    def waited_before_backward_went_on(self, arrived_in_all):
        """Issued from a gradient's hook and waited for in that same hook, before any later transfer:
        nothing of backward ran while it travelled. A wait inside a later bucket's send is a cap on
        the transfers in flight (section 8), and one at the end of backward has nothing left to overlap."""
        if self.waited_at is None or self.issued_at >= arrived_in_all:
            return False
        return self.waited_at == self.issued_at and self.issued_by_then == self.index + 1 and not self.in_later_send


# ProcessGroup's methods behind torch.distributed's reduce-scatters (reduce_scatter_single, its old name
# reduce_scatter_tensor, and the list form): patched there, they see every call, whatever name the
# student's code imported
_REDUCE_SCATTERS = ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter")


@contextlib.contextmanager
def _watching_sends(opt, arrived):
    """Inside: every reduce-scatter hands the student's code a _SendWork, refuses a group other than the
    optimizer's, and notes the send call it came from. Yields {"works": [_SendWork, ...], ...}."""
    sends = {"works": [], "arrived": arrived, "in_send": None}
    want = dist.get_process_group_ranks(opt.group if opt.group is not None else dist.group.WORLD)
    pg_class = dist.ProcessGroup
    originals = {name: vars(pg_class)[name] for name in _REDUCE_SCATTERS if name in vars(pg_class)}

    def watched(original):
        def reduce_scatter(pg, output, *args):
            got = dist.get_process_group_ranks(pg)
            if got != want:
                raise AssertionError(
                    f"the reduce-scatter of bucket {len(sends['works'])} went to ranks {got} (the default group?), "
                    f"not to the optimizer's group, ranks {want}: pass group=self.group, the ranks this optimizer "
                    "shards over")
            work = original(pg, output, *args)
            out = output
            while isinstance(out, (list, tuple)) and out:  # the list form: the first output tensor
                out = out[0]
            if work is None or not isinstance(out, torch.Tensor):
                return work
            opts = args[-1] if args else None
            blocking = getattr(opts, "asyncOp", True) is False
            sent = _SendWork(work, out, sends, blocking)
            sends["works"].append(sent)
            return sent

        return reduce_scatter

    own_send = opt.send

    def send(bi, *args, **kwargs):  # through self.send: the instance's attribute comes first
        outer, sends["in_send"] = sends["in_send"], object()
        try:
            return own_send(bi, *args, **kwargs)
        finally:
            sends["in_send"] = outer

    for name, fn in originals.items():
        setattr(pg_class, name, watched(fn))
    opt.send = send
    try:
        yield sends
    finally:
        for name, fn in originals.items():
            setattr(pg_class, name, fn)
        vars(opt).pop("send", None)


def _subgroup(world_size, rank, group_ranks):
    """(group, its size, this rank's rank in it): the default group, or a new one of group_ranks
    (every rank creates it, a collective; a rank outside it gets group None and sits the check out)."""
    if group_ranks is None:
        return None, world_size, rank
    group = dist.new_group(list(group_ranks))
    if rank not in group_ranks:
        return None, 0, None
    return group, len(group_ranks), list(group_ranks).index(rank)


def _timing_case(rank, world_size, cls, model_name, bucket_numel, steps, group_ranks=None):
    group, world_size, rank = _subgroup(world_size, rank, group_ranks)
    if rank is None:  # outside the optimizer's group: wait for the ranks inside it
        dist.barrier()
        return None
    model, opt, buckets, name_of = _setup(rank, world_size, cls, model_name, bucket_numel, group)
    want_sizes = [b.padded_numel for b in buckets]
    out = {}
    for step in range(steps):
        x, y = _micro_batch(model_name, step, world_size, rank, 0, 1)
        log = []
        with CommCounter() as in_backward, _watching_sends(opt, log.__len__) as sends:
            handles = _watch(model, name_of, in_backward, log)
            _loss(model_name, model, x, y, rank).backward()
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
        _assert_sent_on_time(step, log, buckets, name_of)
        _assert_left_to_travel(step, sends["works"], len(log), buckets, name_of)
        if in_step.count("reduce_scatter"):
            raise AssertionError(f"step() made {in_step.count('reduce_scatter')} reduce-scatter(s): ZeRO-2 reduces "
                                 "every gradient during backward; step() only updates the shard and all-gathers")
        out = {"backward": ops, "step": in_step.table(), "buckets": len(buckets),
               "psi": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    if group_ranks is not None:
        dist.barrier()  # the rank outside the group leaves with the others
    return out


def _assert_sent_on_time(step, log, buckets, name_of):
    """After each gradient's hooks: the reduce-scatters issued so far are exactly the buckets complete
    in order (the head of the line and every complete bucket behind it)."""
    arrived, sent_before = set(), 0
    for i, (name, sent, _) in enumerate(log):
        arrived.add(name)
        due = _expected_sent(arrived, buckets, name_of)
        if sent_before < sent < due:
            completed = "; ".join(bucket_label(bi, buckets[bi], name_of) for bi in range(sent_before, due))
            raise AssertionError(
                f"step {step + 1}: the gradient of {name} completed {due - sent_before} buckets at once ({completed}: "
                f"those after bucket {sent_before} were complete already, waiting behind it), but its hook sent only "
                f"{sent - sent_before}: one gradient completed several buckets and only the first went out; after "
                "each send look at the new head of the line again (a while, not an if), or complete buckets wait for "
                "a later gradient or the end of backward")
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
        sent_before = sent


def _assert_left_to_travel(step, works, arrived_in_all, buckets, name_of):
    """No reduce-scatter sent from a hook was waited for before backward went on (the k-th is bucket k:
    the sizes were checked in order)."""
    for bi, work in enumerate(works):
        if not work.waited_before_backward_went_on(arrived_in_all):
            continue
        label = bucket_label(bi, buckets[bi], name_of)
        if work.blocking:
            how = "was issued blocking (async_op=False): the call returned only once the transfer was done"
        elif work.in_own_send:
            how = "was waited for inside send(), right after it was issued (work.wait() there)"
        else:
            how = "was waited for in the hook that sent it, before backward went on"
        raise AssertionError(
            f"step {step + 1}: the reduce-scatter of {label} {how}, so backward stood still while it travelled and "
            "nothing overlaps: issue it with async_op=True, keep its work in _in_flight, and wait for it in "
            "_end_of_backward")


# ---------------------------------------------------------------------------------------
# in the notebook


def _run(case, cls, world_size, args, what, timeout):
    __tracebackhide__ = True
    _validate(cls)
    return run_on_ranks(case, world_size, args=(cls, *args), what=what, timeout=timeout)


@renamed_args(kind="model")
def check_numerics(cls, world_size=2, model="mlp", bucket_numel=300, steps=4, timeout=60.0):
    """Every step: each rank's reduced gradient shard, the weights, and Adam's m and v shards
    equal one process running torch.optim.AdamW on the whole batch."""
    __tracebackhide__ = True
    ref = _reference(model, world_size, steps, 1, timeout)
    _run(_numerics_case, cls, world_size, (model, bucket_numel, ref), f"{cls.__name__} on {model}", timeout)
    passed(f"{cls.__name__} matches torch.optim.AdamW on {world_size} ranks ({model}, buckets of {bucket_numel}): "
           f"gradient shards, weights and Adam's m, v after each of {steps} steps")


@renamed_args(kind="model")
def check_memory(cls, world_size=2, model="mlp", bucket_numel=300, steps=2, timeout=60.0):
    """No full gradient survives: .grad is None after backward, each bucket's gradients are
    freed when it is sent, grad_shards hold Ψ/N elements, and the bytes measured agree."""
    __tracebackhide__ = True
    res = _run(_sharded_case, cls, world_size, (model, bucket_numel, steps), f"{cls.__name__} on {model}", timeout)
    r = res[0]
    passed(f"{cls.__name__} keeps no full gradient on {world_size} ranks ({model}): every .grad is None after "
           f"backward; measured {r['grown']} bytes of gradient per rank, its shard {r['shard_bytes']} "
           f"(Ψ/N = {r['psi']}/{world_size} elements), a full gradient {4 * r['psi']}")


@renamed_args(kind="model")
def check_traffic(cls, world_size=2, model="mlp", bucket_numel=300, steps=2, group_ranks=None, timeout=60.0):
    """One reduce-scatter per bucket, in order, each issued as soon as its bucket is complete (every
    complete bucket behind the head too) and left to travel while backward goes on; none in step();
    no all-reduce. group_ranks: the optimizer gets a group of those ranks (the others sit it out)."""
    __tracebackhide__ = True
    res = _run(_timing_case, cls, world_size, (model, bucket_numel, steps, group_ranks), f"{cls.__name__} on {model}",
               timeout)
    r = next(r for r in res if r is not None)
    rs, ag = r["backward"]["reduce_scatter"], r["step"].get("all_gather", {"calls": 0, "volume": 0})
    where = f"{world_size} ranks" if group_ranks is None else f"a group of ranks {list(group_ranks)} of {world_size}"
    passed(f"{cls.__name__} reduce-scatters during backward on {where} ({model}, buckets of {bucket_numel}): "
           f"{rs['calls']} buckets, each sent as soon as complete and waited for at the end of backward; per step "
           f"reduce-scatter {rs['volume']} + all-gather {ag['volume']} elements = 2Ψ + padding (Ψ = {r['psi']})")


@renamed_args(kinds="models")
def check_unused_parameters(cls, world_size=2, models=("edge", "branch"), bucket_numel=100, steps=3, timeout=60.0):
    """Parameters without a gradient (on every rank: "edge"; on odd ranks only: "branch")
    neither hang nor corrupt: the weights follow torch.optim.AdamW every step."""
    __tracebackhide__ = True
    _validate(cls)  # a class that cannot be graded says so, without the rule below
    for model in models:
        ref = _reference(model, world_size, steps, 1, timeout)
        what = {"edge": f"{cls.__name__} on a model with an unused parameter",
                "branch": f"{cls.__name__} on a model whose branch gets a gradient on even ranks only"}.get(model, model)
        try:
            _run(_params_case, cls, world_size, (model, bucket_numel, ref), what, timeout)
        except CheckFailed as exc:
            first, _, rest = str(exc).partition("\n")
            if first.startswith("your code raised"):  # the exception names the problem: the rule after it
                raise CheckFailed(f"{exc}\n  ({ORDER_RULE})") from None
            if "after the step differs" in first:  # wrong weights: _params_case named the cause from the shards
                raise
            # a hang, or a crash (gloo aborts on mismatched collectives): the rule is the likely cause, on the
            # line the feedback shows
            raise CheckFailed(f"{first} ({ORDER_RULE})" + (f"\n{rest}" if rest else "")) from None
    passed(f"{cls.__name__} handles parameters without a gradient on {world_size} ranks ({', '.join(models)}): "
           f"no hang, weights match torch.optim.AdamW for {steps} steps")


@renamed_args(kind="model")
def check_accumulation(cls, world_size=2, model="mlp", bucket_numel=300, accum=3, steps=3, timeout=60.0):
    """`accum` backward calls per step: accum reduce-scatters per bucket, shards summed, and
    the weights of torch.optim.AdamW on the whole batch."""
    __tracebackhide__ = True
    ref = _reference(model, world_size, steps, accum, timeout)
    res = _run(_accumulation_case, cls, world_size, (model, bucket_numel, ref, accum), f"{cls.__name__} on {model}",
               timeout)
    for rank, r in enumerate(res):
        want = [r["buckets"]] * (accum * steps)
        if r["reductions"] != want:
            raise CheckFailed(f"[rank {rank}] with {accum} backward calls per step, the backward calls made "
                              f"{r['reductions']} gradient reductions; expected {r['buckets']} in every one "
                              f"(one per bucket: ZeRO-2 reduces whatever each backward produced)")
    passed(f"{cls.__name__} accumulates {accum} micro-batches on {world_size} ranks ({model}): "
           f"{accum} x {res[0]['buckets']} reduce-scatters per step, weights match torch.optim.AdamW")


# ---------------------------------------------------------------------------------------
# the stretch exercise: clipping sharded gradients (checked when attempted, worth no points)

CLIP_MODEL, CLIP_STEPS, CLIP_BUCKET = "mlp", 4, 300
# between the norms of the mean gradient of the steps below (0.80, 0.92, 0.82, 0.84 on "mlp"): one clips, the rest do not
MAX_NORM = 0.87


def _clipped_whole_batch(net, step, model, world_size, max_norm):
    """The reference's gradient, clipped by torch.nn.utils.clip_grad_norm_ (one process)."""
    _whole_batch(net, step, model, world_size, 1)
    torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], max_norm)


def _clipping_case(rank, world_size, fn, model_name, bucket_numel, ref, max_norm):
    from ..zero1 import ZeRO1Adam

    used = ("your function called zerokit's ZeRO1Adam.clip_grad_norm_: the stretch is to write the clipping "
            "yourself")
    with refusing((ZeRO1Adam, "clip_grad_norm_", used)):
        model = build_model(model_name)
        opt = ZeRO2Adam(model.parameters(), bucket_mb=_bucket_mb(bucket_numel), **HYPER)
        weights, norms = None, []
        for step, want in enumerate(ref):
            x, y = _micro_batch(model_name, step, world_size, rank, 0, 1)
            _loss(model_name, model, x, y, rank).backward()
            expected = [g for g in _micro_gradients(model_name, weights, step, world_size, 1)[0].values()
                        if g is not None]
            expected = float(torch.sqrt(sum((g.double() ** 2).sum() for g in expected)))
            # this rank's shards before the student's function scales them
            mine = float(torch.sqrt(sum((g.double() ** 2).sum() for g in opt.grad_shards if g is not None)))
            got = fn(opt, max_norm)
            try:
                got = float(got)
            except (TypeError, ValueError, RuntimeError):
                raise AssertionError(f"clip_sharded_grad_norm_ returned {got!r}; expected the norm, a number") from None
            everyone, shard_norms = gather_object(got), gather_object(mine)  # collectives: on every rank
            if abs(got - expected) > 1e-4 * expected + 1e-7:
                if len(set(everyone)) > 1 and abs(got - mine) <= 1e-4 * mine + 1e-7:
                    why = ("it is the norm of this rank's shards only, a different number on each rank: add the "
                           "ranks' sums of squares (one all-reduce) before the square root")
                elif abs(got - sum(shard_norms)) <= 1e-4 * expected:
                    why = "it is the sum of the ranks' norms: add their squares, then take the square root"
                else:
                    why = "the global L2 norm of the mean gradient is the square root of the sum of squares over all shards"
                raise AssertionError(f"step {step + 1}: clip_sharded_grad_norm_ returned {got:.6g}, the norm of the "
                                     f"mean gradient is {expected:.6g} (every rank: {everyone}): {why}")
            norms.append(expected)
            opt.step()
            opt.zero_grad()
            for name, p in model.named_parameters():
                try:
                    assert_close(p.detach(), want["params"][name], f"step {step + 1}: parameter {name} after the step")
                except AssertionError as exc:
                    clipped = expected > max_norm
                    raise AssertionError(
                        f"step {step + 1}: the weights differ from torch.optim.AdamW after clip_grad_norm_("
                        f"max_norm={max_norm:g}) (the norm was {expected:.4g}, so the gradient "
                        f"{'must be scaled by max_norm / (norm + 1e-6), in place, in grad_shards' if clipped else 'must be left as it is'})"
                        f"\n  {exc}") from None
            weights = want["params"]
    return norms


def check_clipping(fn, world_size=2, max_norm=MAX_NORM, timeout=60.0):
    """The stretch: clip_sharded_grad_norm_(optimizer, max_norm) on zerokit.ZeRO2Adam returns the global
    norm of the mean gradient on every rank and clips the shards as torch.nn.utils.clip_grad_norm_ does:
    norms and weights after every step against one process running it and torch.optim.AdamW."""
    __tracebackhide__ = True
    if not callable(fn):
        raise CheckFailed(f"expected the function clip_sharded_grad_norm_, got {type(fn).__name__}")
    ref = adamw_reference(CLIP_MODEL, CLIP_STEPS, HYPER, _clipped_whole_batch, (CLIP_MODEL, world_size, max_norm),
                          timeout=timeout)
    norms = run_on_ranks(_clipping_case, world_size, args=(fn, CLIP_MODEL, CLIP_BUCKET, ref, max_norm),
                         timeout=timeout, what="clip_sharded_grad_norm_")[0]
    clipped = sum(n > max_norm for n in norms)
    passed(f"clip_sharded_grad_norm_ gives the global norm on every rank and clips as torch.nn.utils.clip_grad_norm_ "
           f"does ({world_size} ranks, {CLIP_MODEL}, max_norm {max_norm:g}: {clipped} of {len(norms)} steps clipped); "
           "weights match torch.optim.AdamW")


def try_stretch(fn, name="clip_sharded_grad_norm_"):
    """The stretch's cell: check_clipping(fn) if the student defined it, ✓ or the reason printed."""
    return run_stretch(check_clipping, fn, name)


check_matches_adamw = alias(check_numerics, "check_matches_adamw", kind="model")
check_gradients_sharded = alias(check_memory, "check_gradients_sharded", kind="model")
check_reduced_during_backward = alias(check_traffic, "check_reduced_during_backward", kind="model")
