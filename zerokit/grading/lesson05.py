r"""Checks for lesson 05 (ZeRO-3): parameters sharded at rest, gathered around each use.

Two exercises. `ShardedParameters` (built on zerokit.ZeRO2Adam, lesson 04's reference)
keeps only this rank's shard of each unit's parameters; the student writes its mechanics:
`start_gather` (an asynchronous all-gather), `finish_gather` (wait, install the full
parameters as views of the gathered buffer) and `free` (back to empty, the buffer's
memory released in place: `resize_(0)`, which also frees it under the views autograd saved
for backward; the scaffold's `gather_buffer` re-allocates that same storage). `MyZeRO3Adam`
builds on it and writes the hooks: `gather_unit` (with prefetch), `pre_forward`,
`post_forward` (free, and hook the outputs for the pre-backward gather), `pre_backward`
and `send` (reduce-scatter, then free). Each check runs on real ranks, each rank on its
own slice of the batch, and looks at one thing:

- check_gather_free           the mechanics alone: one all-gather per gather, on self.group
                              (the class is given a group of its own: an all-gather without
                              group= runs on the default group), its work waited for before
                              finish_gather returns (each transfer delivers its data only at
                              wait(): kit.lazy_transfers), a prefetch is not gathered twice,
                              the values are every rank's current shard in place, free()
                              empties the parameters and releases the buffer's memory in
                              place (autograd's saved views of it too; and the buffer of a
                              prefetch nobody used, once its transfer is waited for), and
                              the next gather refills that same buffer; no copy of the
                              gathered weights survives (census of the process); then real
                              steps under zerokit's hooks on BranchNet, whose second step
                              skips a unit: no gathered buffer stays allocated between steps;
- check_numerics              weights, gradient shards and Adam's m and v shards against
                              one process running torch.optim.AdamW, every step; on units
                              with several outputs (awkward, units="children"), a backward
                              that fails on empty weights is explained by when the hooks
                              fired (_EntryWatch: a hook on one output, or mode="all");
- check_memory                the stage's point: every parameter empty between steps, the
                              bytes this rank holds at rest ~ (4 + 8) Ψ/N (census), each unit
                              full during its forward and freed right after it, freed in
                              backward once its gradients are sent, and the peak of live
                              parameter bytes inside forward within the shards, the root and
                              two units; no unit gathered in backward after its gradients
                              were sent (a backward prefetch in forward order); after an eval
                              forward under torch.no_grad(), every unit freed (the root too,
                              where it owns parameters, as awkward's does: no backward follows);
- check_traffic               the price: at most two all-gathers per unit per step (forward,
                              backward), one for the root (full from its forward to the end
                              of backward), one reduce-scatter, ≤ 3Ψ in all (1.5x data parallel),
                              and prefetch: the next unit's all-gather is issued before the
                              current unit computes (and none ahead with prefetch=False), and
                              the hooks never wait for a unit's transfer before asking for the
                              next one's (calls from the hooks only: zerokit's mechanics, which
                              carry one transfer at a time, wait inside start_gather too).
                              Its ✓ reports what it measured, phase by phase (a ZeRO-3 that
                              never frees passes it at 2Ψ, saying so: check_memory fails it).

Isolation: the hook checks give the student's MyZeRO3Adam zerokit's own `start_gather`,
`finish_gather` and `free` (and `gather_buffer`, `finish_transfers`), those of zerokit.ZeRO3Adam,
so a bug in the mechanics costs check_gather_free only. They also name a `post_forward` that
fails on a unit's output that is not one tensor (model "awkward" with units="children": `attn`
returns a tuple, `mix` a dict).
The single-process reference (torch.optim.AdamW) runs before the ranks start, in a one-rank
launch of its own (the harness forbids torch.optim.Adam/AdamW where the student's code runs,
and the notebook's process may have rebound it), cached per configuration.
"""

import gc
import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from ..comm import CommCounter, process_group_of
from ..memory import census
from ..models import build_model, model_loss
from ..zero2 import ZeRO2Adam
from ..zero3 import ZeRO3Adam, bucket_plan, install_unit_hooks, unit_list
from .compare import assert_close
from .harness import passed, run_on_ranks
from .kit import (SHARDED_HYPER, adamw_reference, alias, assert_adam_shards, batch_backward, bucket_label, check_class,
                  lazy_transfers, rank_batch, renamed_args)

__all__ = ["check_gather_free", "check_numerics", "check_memory", "check_traffic", "units_of",
           "with_reference_mechanics", "live_parameter_bytes"]

HYPER = SHARDED_HYPER  # eps 1e-6, not AdamW's default 1e-8: kit says why
PER_RANK = 3  # samples per rank per step
MECHANICS = ("start_gather", "finish_gather", "free")
HOOKS = ("gather_unit", "pre_forward", "post_forward", "pre_backward", "send")

# which of kit.SITUATIONS the hidden tests meet (tests/test_situations.py holds this to them)
SITUATIONS = {
    # every call: the class is given a group of its own (dist.new_group), not the default group
    "subgroup": "check_gather_free",
    # every call: BranchNet's second step skips its unit `branch` (its Adam step count lags)
    "sits-out": "check_gather_free",
    "n3": "check_numerics: world_size=3",
    "frozen": "check_numerics: edge",
    "tied": "check_numerics: edge",
    "unused": "check_numerics: edge",
    "tuple-output": "check_numerics: awkward",  # units="children": `attn` returns a tuple, `mix` a dict
    "root-params": "check_traffic: awkward",  # the root (a tied embedding) gathered once per step
    # every call ends with an eval forward under no_grad; awkward's root owns the tied embedding
    "eval-no-grad": "check_memory: awkward",
    "peak-memory": "check_memory",  # the peak of live parameter bytes inside forward, not only at rest
    "zero3": "check_numerics",  # the lesson's code is ZeRO-3 itself
    "zero-grad-shard": "n/a: the gradient shards come from the scaffold's base, zerokit.ZeRO2Adam (lesson 04's "
                       "checks); nothing the student writes here reads or reduces a gradient",
    "out-of-order": "n/a: ZeRO-2 underneath calls the student's send in bucket order, whatever order the "
                    "gradients arrive in, so no code of this lesson sees the arrival order",
    "fp16-scale": "n/a: lesson 05 trains in float32; mixed precision and its loss scale arrive in lesson 06",
}


# ---------------------------------------------------------------------------------------
# units, data and the reference


def units_of(model, units):
    """units=None: the default (every module owning parameters); "blocks": one per block;
    "children": one per child of the model (for "awkward": `attn` returns a tuple, `mix` a
    dict, which the default units, the linear layers inside them, never do)."""
    if units is None:
        return None
    if units == "blocks":
        return list(model.blocks)
    if units == "children":
        return list(model.children())
    raise ValueError(f"units must be None, 'blocks' or 'children', not {units!r}")


# ---------------------------------------------------------------------------------------
# before the ranks start


def _validate(cls, methods, expected_name):
    """The class is the student's, not zerokit's ZeRO3Adam (both exercises' reference) under another name."""
    base = "zerokit.ZeRO2Adam, as the scaffold does" if methods == MECHANICS else \
        "the scaffold's ShardedParameters (zerokit.ZeRO2Adam underneath)"
    refuse = [(ZeRO3Adam, f"the class this exercise re-implements; build on {base} and write the methods yourself")]
    check_class(cls, f"your class ({expected_name})", refuse=refuse, base=ZeRO2Adam, methods=methods,
                written_in=(ZeRO3Adam, ZeRO2Adam))


def with_reference_mechanics(cls):
    """cls with zerokit's start_gather, finish_gather and free() (and what they call:
    gather_buffer, finish_transfers, gather_collective), those of zerokit.ZeRO3Adam: the hook
    checks grade the hooks, and a bug in the mechanics costs check_gather_free only. Its
    post_forward names a failure on an output that is not one tensor."""
    names = MECHANICS + ("gather_buffer", "finish_transfers", "gather_collective")
    methods = {name: ZeRO3Adam.__dict__[name] for name in names}

    def post_forward(self, u, module, args, output):
        __tracebackhide__ = True
        try:
            return cls.post_forward(self, u, module, args, output)
        except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
            if isinstance(output, torch.Tensor):
                raise
            kind = "a dict" if isinstance(output, dict) else f"a {type(output).__name__}"
            raise AssertionError(
                f"unit {_module_name(self.module, module)} returned {kind}, and your post_forward failed on it "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): the hook assumed one "
                "tensor output; a module may return a tuple, a list or a dict (nn.MultiheadAttention returns a "
                "tuple): hook every tensor among its leaves (tree_flatten) that requires grad") from None

    methods["post_forward"] = post_forward
    return type(cls.__name__, (cls,), methods)


def _expected_buckets(model, units):
    """[(parameters, unit module)] in the order ZeRO-3 lays its buckets out: one per unit that
    owns trainable parameters, the last unit first (as zerokit.zero3 assigns them)."""
    chosen = unit_list(model, units_of(model, units))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [(mine, chosen[u]) for u, mine in bucket_plan(chosen, trainable)]


# ---------------------------------------------------------------------------------------
# inside the workers


def _setup(rank, world_size, cls, model_name, units, prefetch=True, reference_mechanics=True):
    """The model, the student's optimizer, a name per parameter, the unit of each bucket."""
    model = build_model(model_name)
    expected = _expected_buckets(model, units)
    if reference_mechanics:
        cls = with_reference_mechanics(cls)
    opt = cls(model, units=units_of(model, units), prefetch=prefetch, **HYPER)
    name_of = {p: n for n, p in model.named_parameters()}
    got = [[name_of.get(p, "?") for p in b.params] for b in getattr(opt, "buckets", [])]
    want = [[name_of[p] for p in params] for params, _ in expected]
    if got != want:
        raise AssertionError(f"your optimizer's buckets are {got}, expected {want} (one per unit, the last unit "
                             "first: keep the scaffold's _make_buckets)")
    return model, opt, name_of, [unit for _, unit in expected]


def _is_shape_error(exc):
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(w in text for w in ("size of tensor", "shape", "mat1", "size mismatch",
                                                                      "storage of size 0"))


def _forward(model_name, model, x, y, step):
    try:
        return model_loss(model_name, model(x), y)
    except RuntimeError as exc:
        if _is_shape_error(exc):
            raise AssertionError(f"step {step + 1}: forward failed ({str(exc).splitlines()[0]}): a module ran with "
                                 "empty parameters: gather each unit in its forward pre-hook (pre_forward)") from None
        raise


def _leaf_names(output):
    """A name for each leaf of a unit's output, in tree_flatten's order: "" for one tensor,
    "[0]", "[1]" for a tuple or list, "['gate']" for a dict (nested containers: their index)."""
    leaves = tree_flatten(output)[0]
    if isinstance(output, dict) and len(leaves) == len(output):
        return [f"[{k!r}]" for k in output]  # tree_flatten keeps a dict's order
    if isinstance(output, (tuple, list)) and len(leaves) == len(output):
        return [f"[{i}]" for i in range(len(output))]
    return [f"(leaf {i})" if len(leaves) > 1 else "" for i in range(len(leaves))]


class _EntryWatch:
    """Forward hooks registered after the optimizer's, which hook every output tensor of every
    unit: when the first gradient of a unit's outputs arrives (autograd is about to go into
    that unit), the unit must be full. A hook on one output only,
    or one that waits for all of them (register_multi_grad_hook(..., mode="all")), gathers too
    late for a unit with several outputs: backward then fails on its empty weights, and this
    names why."""

    def __init__(self, model, opt, units):
        self.problems, self.handles = [], []
        for unit in dict.fromkeys(units):  # a unit may hold several buckets
            buckets = [bi for bi, u in enumerate(units) if u is unit]
            self.handles.append(unit.register_forward_hook(
                lambda m, a, out, buckets=buckets, name=_module_name(model, unit): self._hook(opt, name, buckets, out)))

    def _hook(self, opt, name, buckets, output):
        if not torch.is_grad_enabled():
            return
        leaves = [(n, t) for n, t in zip(_leaf_names(output), tree_flatten(output)[0])
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        # the optimizer's forward hook ran before this one: which leaves did it hook?
        hooked = [leaf for leaf, t in leaves if t._backward_hooks]
        first = []
        for leaf, t in leaves:
            t.register_hook(lambda grad, leaf=leaf: self._arrived(opt, name, buckets, leaf, len(leaves), hooked, first))

    def _arrived(self, opt, name, buckets, leaf, count, hooked, first):
        if first:
            return
        first.append(leaf)
        # after the optimizer's own hooks on this tensor (registered before ours): its gather is done
        ready = all(p.numel() for bi in buckets for p in opt.buckets[bi].params)
        if ready or count < 2 or not hooked or self.problems:  # no hook at all: backward's own message says so
            return
        why = (f"your hook is on {', '.join(hooked)} only: hook every tensor among the output's leaves that "
               "requires grad" if len(hooked) < count else
               "your hook is on every output, but it had not fired: mode=\"all\" fires once the last of them has its "
               "gradient, after autograd has gone into the unit; mode=\"any\" fires at the first")
        self.problems.append(
            f"in backward, when the gradient of {name}'s output {leaf} arrived (the first of its {count} output "
            f"tensors to get one), {name}'s parameters were still empty: autograd goes into a unit as soon as the "
            "gradient of any one of its outputs is computed, so the hook that gathers it again must fire then, "
            f"one multi-grad hook on them all with mode=\"any\"; {why}")

    def remove(self):
        for h in self.handles:
            h.remove()


def _backward(loss, step, watch=None):
    try:
        loss.backward()
    except RuntimeError as exc:
        if watch is not None and watch.problems and _is_shape_error(exc):
            raise AssertionError(f"step {step + 1}: {watch.problems[0]}") from None
        if _is_shape_error(exc):
            raise AssertionError(
                f"step {step + 1}: backward failed ({str(exc).splitlines()[0]}): autograd found a unit's parameters "
                "empty; the weights freed after forward must be gathered again before that unit's backward "
                "(post_forward registers a multi-grad hook on its outputs that calls pre_backward)") from None
        raise


def _full_values(bucket, tensors, world_size, offsets=None):
    """The full flat buffer of a bucket from full tensors, plus offsets[r] on rank r's shard."""
    flat = bucket.flatten(tensors)
    if offsets is not None:
        s = bucket.shard_numel
        for r in range(world_size):
            flat[r * s:(r + 1) * s] += offsets[r]
    return flat


def _mechanics_case(rank, world_size, cls, model_name):
    # a group of its own, not the default one (the same ranks): an all-gather that leaves out
    # group= runs on the default group, which a subgroup would make wrong or crash
    group = dist.new_group(list(range(world_size)))
    gc.collect()
    before = census()["total"]  # everything alive in this process before the model exists
    model = build_model(model_name)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = cls(model, lr=HYPER["lr"], group=group)
    name_of = {p: n for n, p in model.named_parameters()}
    offsets = [float(r + 1) for r in range(world_size)]
    # every transfer start_gather starts delivers its data only at wait(), as a slow network would
    with lazy_transfers(opt, "start_gather", "gathering") as lazies:
        for bi, b in enumerate(opt.buckets):
            label = bucket_label(bi, b, name_of)
            truth = _full_values(b, [full[name_of[p]] for p in b.params], world_size)
            _check_bucket(opt, bi, b, label, truth, name_of, full, offsets, rank, world_size, lazies, group)
    del full, truth, lazies  # the check's own copies
    gc.collect()
    shard = sum(b.shard_numel for b in opt.buckets)
    replicated = sum(t.untyped_storage().nbytes() for t in [*model.buffers(), *model.parameters()]
                     if not t.requires_grad)  # frozen parameters and buffers are not sharded
    grown = census()["total"] - before - replicated
    want = 12 * shard  # the shards (4 Ψ/N) and Adam's m and v (8 Ψ/N)
    psi = sum(b.param_numel for b in opt.buckets)
    if grown > want + max(2048, psi):  # a quarter of a full copy (4 Ψ bytes) or 2 KiB, whichever is more
        raise AssertionError(
            f"after every bucket was gathered and freed, this rank holds {grown} bytes of model state; its shards "
            f"and Adam's m and v are {want}, a full copy of the parameters {4 * psi}: "
            "something keeps a copy of the gathered weights (a clone, or the buffer in another attribute)")
    return {"buckets": len(opt.buckets), "psi": psi, "grown": grown, "want": want}


def _gather_free_case(rank, world_size, cls, model_name):
    out = _mechanics_case(rank, world_size, cls, model_name)
    _skipped_unit_case(rank, world_size, cls)
    return out


def _expect_full(opt, bi, b, what, flat, name_of):
    for p, want in zip(b.params, b.views(flat)):
        if tuple(p.shape) != tuple(want.shape):
            raise AssertionError(f"{what}: {name_of[p]} has shape {tuple(p.shape)}, expected {tuple(want.shape)}: "
                                 "finish_gather must make every parameter of the bucket full again "
                                 "(p.data = a view of the gathered buffer)")
        assert_close(p.detach(), want, f"{what}: {name_of[p]}", atol=0, rtol=0)
    full = getattr(opt, "full", None)
    buf = full[bi] if isinstance(full, list) and len(full) > bi else None
    if not isinstance(buf, torch.Tensor) or buf.numel() != b.padded_numel:
        raise AssertionError(f"{what}: self.full[{bi}] should be the gathered flat buffer ({b.padded_numel} "
                             f"elements), found {type(buf).__name__}"
                             + (f" of {buf.numel()} elements" if isinstance(buf, torch.Tensor) else ""))
    strays = [name_of[p] for p in b.params if p.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()]
    if strays:
        raise AssertionError(f"{what}: {strays[0]} is not a view of self.full[{bi}]: install the parameters as "
                             "views of the gathered buffer (bucket.views), so that dropping the buffer frees them")


def _expect_empty(opt, bi, b, what, name_of, who="free"):
    kept = [(name_of[p], p.numel()) for p in b.params if p.numel() != 0]
    if kept:
        fix = ("keep the scaffold's __init__ and _install_flat_params, which empty them" if who != "free" else
               "free() must leave every parameter of the bucket empty (p.data = an empty tensor)")
        raise AssertionError(f"{what}: {kept[0][0]} still holds {kept[0][1]} elements: {fix}")
    full = getattr(opt, "full", None)
    if isinstance(full, list) and len(full) > bi and full[bi] is not None:
        raise AssertionError(f"{what}: self.full[{bi}] still holds the gathered buffer: set it to None")
    if bi in getattr(opt, "gathering", {}):
        raise AssertionError(f"{what}: self.gathering still has an entry for bucket {bi}: free() must wait for "
                             "an all-gather still in flight (a prefetch nobody used) and drop it")


def _expect_released(left, lead):
    """`left` bytes still allocated in a gather's buffer after free(): say so, after `lead`."""
    if left:
        raise AssertionError(
            f"{lead}: {left} bytes are still allocated in the buffer: free() must release the buffer of a gather "
            "still in flight (a prefetch nobody used) as it does a full unit's: wait for the transfer, then "
            "resize_(0) its storage. Otherwise every unit a data-dependent branch skips, and every prefetch "
            "that is never used, keeps a full-size buffer alive between steps")


def _storage_bytes(t):
    return t.untyped_storage().nbytes() if isinstance(t, torch.Tensor) else 0


def _expect_waited(lazies, bi, call, label):
    """The all-gather start_gather started for bucket bi was waited for (wait()) by `call`."""
    lazy = lazies.get(bi)
    if lazy is not None and not lazy.waited:
        raise AssertionError(
            f"{call} of {label} never called wait() on the all-gather's work (the first entry start_gather "
            f"kept in self.gathering[{bi}]): an all-gather started with async_op=True may still be writing into "
            "its buffer until work.wait() returns, so a view installed before then holds whatever the transfer "
            "has written so far (this check's transfer delivers its data only at wait(), as a slow network "
            "does: your parameters held NaN). Pop the entry, wait, then install the views")


class _GroupSpy(CommCounter):
    """A CommCounter that also notes the process group each collective ran on."""

    def __init__(self):
        super().__init__()
        self.groups = []  # (op, group name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        group = process_group_of(args) if func.namespace == "c10d" else None
        if group is not None:
            self.groups.append((func.__name__.split(".")[0], group.group_name))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _expect_group(spy, group, call):
    """Every collective `call` made ran on `group`, the one the optimizer was given."""
    strays = [name for _, name in spy.groups if name != group.group_name]
    if strays:
        where = ("the default group (every rank)" if dist.group.WORLD.group_name in strays
                 else "a process group other than self.group")
        raise AssertionError(
            f"{call} ran its all-gather on {where}, not on self.group, the group this optimizer was given (here "
            "a group of its own): the all-gather was issued without group=self.group; on a subgroup it would "
            "gather other ranks' shards, or crash on the sizes")


def _check_bucket(opt, bi, b, label, truth, name_of, full, offsets, rank, world_size, lazies, group):
    _expect_empty(opt, bi, b, f"at rest, {label}", name_of, who="the scaffold")
    if opt.flat_params[bi].numel() != b.shard_numel:
        raise AssertionError(f"at rest, flat_params[{bi}] has {opt.flat_params[bi].numel()} elements, expected "
                             f"this rank's shard: {b.shard_numel} (keep the scaffold's _install_flat_params)")

    # 1. finish_gather on its own: one all-gather of the padded bucket, waited for, the right values
    lazies.pop(bi, None)
    with _GroupSpy() as comm:
        opt.finish_gather(bi)
    _expect_group(comm, group, f"finish_gather({bi}) of {label}")
    _expect_waited(lazies, bi, f"finish_gather({bi})", label)
    calls = [(c.op, c.numel) for c in comm.calls]
    if calls != [("all_gather", b.padded_numel)]:
        raise AssertionError(f"finish_gather({bi}) on an empty {label} made {calls or 'no collective'}; expected "
                             f"one all-gather of the padded bucket: [('all_gather', {b.padded_numel})]")
    _expect_full(opt, bi, b, f"after finish_gather({bi}) of {label} (every rank's shard end to end, rank r's at "
                 "[r·S, (r+1)·S) of the buffer, each parameter at its offset: bucket.views)", truth, name_of)
    with CommCounter() as comm:
        opt.finish_gather(bi)
    if comm.calls:
        raise AssertionError(f"finish_gather({bi}) on a bucket that is already full made {len(comm.calls)} "
                             "collective(s): a unit that is already gathered must not be gathered again")
    # what autograd keeps for backward: a view of the gathered buffer (a linear layer saves weight.t())
    saved_view = opt.full[bi][:b.numel]
    opt.free(bi)
    _expect_empty(opt, bi, b, f"after free({bi}) of {label}", name_of)
    if saved_view.untyped_storage().nbytes() != 0:
        raise AssertionError(
            f"after free({bi}) of {label}, a view of the gathered buffer taken before (as autograd keeps one "
            f"for backward) still has {saved_view.untyped_storage().nbytes()} bytes behind it: dropping your "
            "references does not free memory that autograd's saved views share; release it in place, "
            "self.full[bi].untyped_storage().resize_(0)")

    # 2. a prefetch: start_gather twice, then finish_gather, is one all-gather
    lazies.pop(bi, None)
    with CommCounter() as comm:
        opt.start_gather(bi)
        opt.start_gather(bi)
        pending = getattr(opt, "gathering", {}).get(bi)
        started_full = [name_of[p] for p in b.params if p.numel() != 0]
        opt.finish_gather(bi)
    if comm.count("all_gather") != 1:
        raise AssertionError(f"start_gather({bi}) twice and then finish_gather({bi}) made "
                             f"{comm.count('all_gather')} all-gathers of {label}; expected 1: a bucket whose gather is "
                             "in flight (in self.gathering) must not be gathered again, and finish_gather must "
                             "wait for that transfer instead of starting another")
    if not (isinstance(pending, tuple) and len(pending) == 3 and hasattr(pending[0], "wait")):
        raise AssertionError(f"after start_gather({bi}), self.gathering[{bi}] is {type(pending).__name__}: start "
                             "the all-gather with async_op=True and keep (work, full buffer, shard) there, for "
                             "finish_gather to wait on")
    if started_full:
        raise AssertionError(f"right after start_gather({bi}), {started_full[0]} is already full: start_gather "
                             "only starts the transfer (it may still be in flight); finish_gather waits for it "
                             "and installs the parameters")
    _expect_waited(lazies, bi, f"start_gather({bi}) and then finish_gather({bi})", label)
    _expect_full(opt, bi, b, f"after start_gather({bi}) and finish_gather({bi}) of {label}", truth, name_of)
    if saved_view.untyped_storage().nbytes() == 0:
        raise AssertionError(
            f"after free({bi}) and a new gather of {label}, a view of the buffer taken before free() (as autograd "
            "keeps one for backward) still has no memory behind it: backward would fail on it. Gather into the "
            "same buffer every time (self.gather_buffer(bi, shard)), re-allocated, not into a new tensor")
    assert_close(saved_view, truth[:b.numel], f"a view of {label}'s gathered buffer taken before free(), after the "
                 "next gather (autograd's saved views must see the weights again)", atol=0, rtol=0)
    opt.free(bi)

    # 3. a prefetch nobody used: start_gather, then free()
    lazies.pop(bi, None)
    opt.start_gather(bi)
    pending = getattr(opt, "gathering", {}).get(bi)  # (work, buffer, shard): its shape was checked in 2.
    opt.free(bi)
    what = f"after start_gather({bi}) and then free({bi}) of {label} (a prefetch nobody used)"
    _expect_empty(opt, bi, b, what, name_of)
    lazy = lazies.get(bi)
    if lazy is not None and (not lazy.waited or lazy.released_first):
        raise AssertionError(
            f"free({bi}) of {label} while its all-gather was in flight (a prefetch nobody used) released the "
            "buffer " + ("before waiting for the transfer" if lazy.waited else "without waiting for the transfer")
            + " (work.wait(), the first entry of self.gathering[bi]): the all-gather may still be writing into "
            "that memory; wait for it first, then resize_(0) its storage")
    _expect_released(_storage_bytes(pending[1]) if isinstance(pending, tuple) and len(pending) > 1 else 0,
                     f"{what}, the all-gather's buffer was not released")

    # 4. the gather reads every rank's current shard: step() updates them in place
    with torch.no_grad():
        opt.flat_params[bi].add_(offsets[rank])
    opt.finish_gather(bi)
    moved = _full_values(b, [full[name_of[p]] for p in b.params], world_size, offsets)
    _expect_full(opt, bi, b, f"after each rank r added r + 1 to its shard (flat_params[{bi}]) and {label} was "
                 "gathered again (each rank's current shard, in its place; never a cached copy)", moved, name_of)
    opt.free(bi)
    with torch.no_grad():
        opt.flat_params[bi].sub_(offsets[rank])


class _ReferenceHooks:
    """zerokit.ZeRO3Adam's hooks (exercise 2) on top of a student's ShardedParameters
    (exercise 1): check_gather_free runs the student's mechanics in real steps with them.
    The methods without super() are zerokit's own; the three with it are written again here
    (a mixin's super() reaches the student's class)."""

    record_order = ZeRO3Adam.record_order
    next_in_forward = ZeRO3Adam.next_in_forward
    next_in_backward = ZeRO3Adam.next_in_backward
    gather_unit = ZeRO3Adam.gather_unit
    pre_forward = ZeRO3Adam.pre_forward
    post_forward = ZeRO3Adam.post_forward
    pre_backward = ZeRO3Adam.pre_backward

    def __init__(self, module, **kwargs):
        super().__init__(module, **kwargs)
        install_unit_hooks(self)

    def _end_of_backward(self):
        super()._end_of_backward()
        for bi in range(len(self.buckets)):
            self.free(bi)

    def send(self, bi):
        super().send(bi)
        self.free(bi)


SKIPPING = "branch"  # BranchNet: its forward(x, use_branch=False) skips the unit `branch`


def _skipped_unit_case(rank, world_size, cls):
    """The student's mechanics under zerokit's hooks, on a model whose second step skips a unit
    (the same on every rank, as ZeRO-3 requires): the prefetch issued for that unit is never
    used, and between steps no gathered buffer may hold memory."""
    model = build_model(SKIPPING)
    opt = type(cls.__name__, (_ReferenceHooks, cls), {})(model, lr=HYPER["lr"])
    name_of = {p: n for n, p in model.named_parameters()}
    seen = {}  # bucket -> weak references to every buffer its gathers used

    def note(*_):
        for bi, v in list(getattr(opt, "gathering", {}).items()):
            if isinstance(v, tuple) and len(v) > 1 and isinstance(v[1], torch.Tensor):
                seen.setdefault(bi, []).append(weakref.ref(v[1]))
        for bi, t in enumerate(getattr(opt, "full", [])):
            if isinstance(t, torch.Tensor):
                seen.setdefault(bi, []).append(weakref.ref(t))

    handles = [m.register_forward_pre_hook(note) for m in model.modules()]
    handles += [m.register_forward_hook(note) for m in model.modules()]
    for step, use_branch in enumerate((True, False, True)):
        x, y = rank_batch(SKIPPING, step, world_size * PER_RANK, rank, world_size)
        # zerokit's hooks: an error here comes from the mechanics, reported as raised (no advice about hooks)
        model_loss(SKIPPING, model(x, use_branch=use_branch), y).backward()
        opt.step()
        opt.zero_grad()
        for bi, refs in sorted(seen.items()):
            left = max((_storage_bytes(r()) for r in refs), default=0)
            label = bucket_label(bi, opt.buckets[bi], name_of)
            if use_branch:
                lead = f"between steps, after step {step + 1}, a buffer of {label} was not released"
            else:
                lead = (f"after step {step + 1}, in which BranchNet skipped its unit `branch` (a data-dependent "
                        "branch, the same on every rank), so the all-gather prefetched for it was never used, the "
                        f"buffer of {label} was not released between steps")
            _expect_released(left, lead)
    for h in handles:
        h.remove()
    return True


def _numerics_case(rank, world_size, cls, model_name, units, ref):
    model, opt, name_of, unit_of_bucket = _setup(rank, world_size, cls, model_name, units)
    watch = _EntryWatch(model, opt, unit_of_bucket)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for step, want in enumerate(ref):
        x, y = rank_batch(model_name, step, world_size * PER_RANK, rank, world_size)
        _backward(_forward(model_name, model, x, y, step), step, watch)
        for bi, b in enumerate(opt.buckets):
            expected = b.shard_of([want["grads"].get(name_of[p]) for p in b.params])
            g = opt.grad_shards[bi]
            assert_close(expected if g is None and not expected.any() else g, expected,
                         f"step {step + 1}: this rank's shard of the mean gradient of {bucket_label(bi, b, name_of)}",
                         atol=1e-6, rtol=1e-4)
        opt.step()
        opt.zero_grad()
        kept = [(n, p.numel()) for n, p in trainable if p.numel() != 0]
        if kept:
            raise AssertionError(f"after step {step + 1}, {kept[0][0]} holds {kept[0][1]} elements: between steps "
                                 "every parameter must be empty, only this rank's shard kept")
        with opt.gathered():
            for name, p in model.named_parameters():
                assert_close(p.detach(), want["params"][name], f"step {step + 1}: parameter {name} after the step")
        assert_adam_shards(opt.shards, opt.buckets, want, name_of, f"step {step + 1}")
    return True


def live_parameter_bytes(model, opt):
    """Bytes of the distinct storages behind the parameters now: installed full parameters,
    the shards, and the gathered or in-flight buffers the optimizer holds."""
    tensors = [p for p in model.parameters() if p.requires_grad and p.numel()]
    tensors += list(getattr(opt, "flat_params", []))
    tensors += [t for t in getattr(opt, "full", []) if isinstance(t, torch.Tensor)]
    tensors += [v[1] for v in getattr(opt, "gathering", {}).values()
                if isinstance(v, tuple) and len(v) > 1 and isinstance(v[1], torch.Tensor)]
    sizes = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            sizes[s.data_ptr()] = max(sizes.get(s.data_ptr(), 0), s.nbytes())
    return sum(sizes.values())


def _module_name(model, module):
    name = next(n for n, m in model.named_modules() if m is module)
    return name or "the model (root unit)"


def _memory_case(rank, world_size, cls, model_name, units, steps):
    gc.collect()
    before = census()["total"]  # everything alive in this process before the model exists
    model, opt, name_of, unit_of_bucket = _setup(rank, world_size, cls, model_name, units)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    buckets = opt.buckets
    psi = sum(b.param_numel for b in buckets)
    problems = []  # the first violation seen inside a hook, raised once autograd is done
    peak = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def sample():
        peak[phase[0]] = max(peak[phase[0]], live_parameter_bytes(model, opt))

    handles = []
    for b, unit in zip(buckets, unit_of_bucket):
        mname, is_root = _module_name(model, unit), unit is model

        def pre(module, args, b=b, mname=mname):
            empty = [name_of[p] for p in b.params if p.numel() == 0]
            if empty and not problems:
                problems.append(f"when {mname}'s forward began, {empty[0]} was empty: gather a unit's parameters "
                                "in its forward pre-hook")
            sample()

        def post(module, args, output, b=b, mname=mname, is_root=is_root):
            sample()
            kept = [name_of[p] for p in b.params if p.numel() != 0]
            if kept and not is_root and not problems:
                problems.append(f"right after {mname}'s forward, {kept[0]} still held its full weights: free each "
                                "unit's parameters in its forward post-hook (only the root unit stays gathered "
                                "until backward ends)")

        # registered after the optimizer's hooks, so they run after them and see their work
        handles += [unit.register_forward_pre_hook(pre), unit.register_forward_hook(post)]
    arrived = set()

    def on_grad(param):
        arrived.add(param)
        due = 0  # ZeRO-2 sends buckets in order: buckets 0..due-1 are complete, hence sent
        while due < len(buckets) and all(p in arrived for p in buckets[due].params):
            due += 1
        for bi in range(due):
            kept = [name_of[p] for p in buckets[bi].params if p.numel() != 0]
            if kept and not problems:
                problems.append(f"in backward, once every gradient of {bucket_label(bi, buckets[bi], name_of)} "
                                f"had arrived and been reduce-scattered, {kept[0]} still held its full weights: "
                                "free a unit's parameters as soon as its gradients are sent (send())")
        sample()

    handles += [p.register_post_accumulate_grad_hook(on_grad) for _, p in trainable]
    sent = set()  # the buckets whose gradients were sent in this backward

    def sending(bi, send=opt.send):
        sent.add(bi)
        send(bi)

    def starting(bi, start=opt.start_gather, opt=opt):
        if phase[0] == "backward" and bi in sent and bi not in opt.gathering and opt.full[bi] is None \
                and not problems:
            problems.append(f"in backward, the all-gather of {bucket_label(bi, buckets[bi], name_of)} was started after "
                            "its gradients had been sent (its backward was over, nothing needs it again): a prefetch "
                            "in backward must be of the unit whose backward comes next, the one before it in forward "
                            "(next_in_backward), not the next one in forward order")
        start(bi)

    opt.send, opt.start_gather = sending, starting  # the hooks and zerokit's mechanics call them through self
    for step in range(steps):
        x, y = rank_batch(model_name, step, world_size * PER_RANK, rank, world_size)
        phase[0] = "forward"
        loss = _forward(model_name, model, x, y, step)
        arrived.clear()
        sent.clear()
        phase[0] = "backward"
        _backward(loss, step)
        if problems:
            raise AssertionError(f"step {step + 1}: {problems[0]}")
        opt.step()
        opt.zero_grad()
        del loss, x, y
        kept = [(n, p.numel()) for n, p in trainable if p.numel() != 0]
        if kept:
            raise AssertionError(f"after step {step + 1}, {kept[0][0]} holds {kept[0][1]} elements: between steps "
                                 "every parameter must be empty, only this rank's shard kept")
    # an evaluation: a forward under torch.no_grad(), which no backward follows
    x, _ = rank_batch(model_name, steps, world_size * PER_RANK, rank, world_size)
    phase[0] = "forward"
    with torch.no_grad():
        model(x)
    del x
    if problems:
        raise AssertionError(f"in an eval forward under torch.no_grad(): {problems[0]}")
    root = {p for b, u in zip(buckets, unit_of_bucket) if u is model for p in b.params}
    kept = [(n, p.numel(), p in root) for n, p in trainable if p.numel() != 0]
    if kept:
        name, numel, of_root = kept[0]
        why = ("the root unit was kept gathered for a backward, and none follows a forward under no_grad: free "
               "the root in its forward hook when gradients are disabled (an LLM would keep its tied embedding "
               "full after every evaluation)" if of_root else
               "every unit must be freed after its forward under no_grad too")
        raise AssertionError(f"after an eval forward under torch.no_grad(), {name} still holds {numel} elements: {why}")
    for h in handles:
        h.remove()
    gc.collect()
    at_rest = census(model, opt)
    shard = sum(b.shard_numel for b in buckets)
    frozen = sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.requires_grad)
    buffers = sum(t.untyped_storage().nbytes() for t in model.buffers())
    params_at_rest = at_rest["parameters"] - frozen  # frozen parameters are replicated, not model state
    grown = at_rest["total"] - before - frozen - buffers  # model state now in this process
    want = 12 * shard  # the shards (4 Ψ/N) and Adam's m and v (8 Ψ/N)
    # slack: a quarter of a full copy (4 Ψ bytes) or 2 KiB; a correct rank holds exactly `want`
    if params_at_rest > 4 * shard + 1024 or grown > want + max(2048, psi):
        raise AssertionError(
            f"between steps this rank holds {params_at_rest} bytes of parameters and {grown} bytes of model "
            f"state in all; its parameter shards are {4 * shard} bytes (Ψ/N = {psi}/{world_size} elements x 4), "
            f"{want} with Adam's m and v; a full copy of the parameters is {4 * psi}: something keeps full-size "
            "buffers alive")
    others_numel = sorted((b.padded_numel for b, u in zip(buckets, unit_of_bucket) if u is not model), reverse=True)
    root_numel = sum(b.padded_numel for b, u in zip(buckets, unit_of_bucket) if u is model)
    bound = 4 * (shard + sum(others_numel[:2]) + root_numel)
    if peak["forward"] > bound:
        raise AssertionError(
            f"inside forward this rank held up to {peak['forward']} bytes of parameters; a unit's forward needs its "
            f"own weights and at most the next unit's (prefetch) beside the shards and the root unit: {bound} bytes "
            f"here; a full copy is {4 * psi}: more units were full or on their way at once (units gathered and not "
            "freed, or prefetched more than one ahead)")
    root_params = [name_of[p] for b, u in zip(buckets, unit_of_bucket) if u is model for p in b.params]
    return {"psi": psi, "shard_bytes": 4 * shard, "grown": grown, "params_at_rest": params_at_rest,
            "peak_forward": peak["forward"], "peak_backward": peak["backward"], "bound": bound,
            "root": sum(b.numel for b, u in zip(buckets, unit_of_bucket) if u is model), "root_params": root_params}


def _comm_case(rank, world_size, cls, model_name, units, steps):
    out = {}
    for prefetch in (True, False):
        model, opt, name_of, unit_of_bucket = _setup(rank, world_size, cls, model_name, units, prefetch=prefetch)
        buckets = opt.buckets
        names = [_module_name(model, u) for u in unit_of_bucket]
        counter = [None]
        events = []  # (phase, bucket, all-gathers issued in this phase before the unit's own hook ran)
        issued = {"forward": [], "backward": []}  # the buckets whose all-gather was issued, by phase
        phase = ["forward"]

        sent = set()  # buckets whose gradients were sent in this backward (their backward is over)
        regathered = []  # buckets whose all-gather was issued in backward after they were sent
        waits = []  # (phase, bucket waited for, the buckets full or on their way at that moment)

        asked = set()  # the buckets the hooks asked to gather (start_gather) in this phase
        depth = [0]  # calls from the hooks are at depth 0; zerokit's mechanics call each other

        def counting(bi, start=opt.start_gather, opt=opt):
            fresh = bi not in opt.gathering and opt.full[bi] is None
            if depth[0] == 0:
                asked.add(bi)
            depth[0] += 1
            try:
                start(bi)
            finally:
                depth[0] -= 1
            if fresh and bi in opt.gathering:
                issued[phase[0]].append(bi)
                if phase[0] == "backward" and bi in sent:
                    regathered.append(bi)

        def finishing(bi, finish=opt.finish_gather, opt=opt):
            # the hooks wait for a transfer here (started now, or earlier): which had they asked for?
            if depth[0] == 0 and opt.full[bi] is None:
                waits.append((phase[0], bi, asked | {b for b in range(len(opt.buckets))
                                                     if b in opt.gathering or opt.full[b] is not None}))
            depth[0] += 1
            try:
                finish(bi)
            finally:
                depth[0] -= 1

        def sending(bi, send=opt.send):
            sent.add(bi)
            send(bi)

        # the hooks and zerokit's finish_gather call them through self
        opt.start_gather, opt.finish_gather, opt.send = counting, finishing, sending

        def pre(module, args, bi):
            events.append(("forward", bi, counter[0].count("all_gather")))

        def ready(bi, opt=opt):
            """Bucket bi full, or its all-gather issued (in self.gathering, the reference's
            bookkeeping: the hook checks run with zerokit's mechanics)."""
            return bi in opt.gathering or all(p.numel() != 0 for p in opt.buckets[bi].params)

        def post(module, args, output, bi):
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(
                    tensors, lambda grad, bi=bi: events.append(("backward", bi, ready(bi))), mode="any")

        # every unit in the order this forward runs it (units without a bucket too: a prefetch of
        # one of those moves nothing)
        unit_order = []
        handles = [unit.register_forward_pre_hook(lambda m, a: unit_order.append(m) if m not in unit_order else None,
                                                  prepend=True)
                   for unit in unit_list(model, units_of(model, units))]
        for bi, unit in enumerate(unit_of_bucket):
            # prepended: they run before the optimizer's hooks (and their multi-grad hooks fire
            # before its pre-backward), so they see what was issued *before* the unit's turn
            handles += [unit.register_forward_pre_hook(lambda m, a, bi=bi: pre(m, a, bi), prepend=True),
                        unit.register_forward_hook(lambda m, a, o, bi=bi: post(m, a, o, bi), prepend=True)]
        rows = []
        for step in range(steps):
            x, y = rank_batch(model_name, step, world_size * PER_RANK, rank, world_size)
            events.clear()
            for calls in (*issued.values(), regathered, waits, unit_order):
                calls.clear()
            sent.clear()
            asked.clear()
            phase[0] = "forward"
            with CommCounter() as fwd:
                counter[0] = fwd
                loss = _forward(model_name, model, x, y, step)
            # the units forward left with only their shard (freed, nothing in flight): backward must gather them
            freed = {bi for bi, b in enumerate(buckets)
                     if bi not in opt.gathering and all(p.numel() == 0 for p in b.params)}
            phase[0] = "backward"
            asked.clear()
            with CommCounter() as bwd:
                counter[0] = bwd
                _backward(loss, step)
            with CommCounter() as stp:
                opt.step()
                opt.zero_grad()
            _check_regathered(step, regathered, names)
            _check_root_gathers(step, issued, buckets, unit_of_bucket, model, name_of)
            ahead = _check_traffic(step, fwd, bwd, buckets, events, names, prefetch, model, unit_of_bucket, freed)
            overlapped = _check_wait_order(step, waits, unit_order, unit_of_bucket, names, prefetch)
            total = {op: fwd.volume(op) + bwd.volume(op) + stp.volume(op)
                     for op in ("all_gather", "reduce_scatter", "all_reduce")}
            rows.append({"forward": fwd.table(), "backward": bwd.table(), "step": stp.table(), "total": total,
                         "gathered": {"forward": fwd.volume("all_gather"), "backward": bwd.volume("all_gather")},
                         "ahead": ahead, "overlapped": overlapped})
        for h in handles:
            h.remove()
        out[prefetch] = {"rows": rows, "psi": sum(b.param_numel for b in buckets),
                         "padded": sum(b.padded_numel for b in buckets)}
    return out


def _check_regathered(step, regathered, names):
    """No unit is gathered in backward after its gradients were sent: its backward is over."""
    if regathered:
        bi = regathered[0]
        raise AssertionError(
            f"step {step + 1}: in backward, {names[bi]}'s all-gather was issued after its gradients had been sent (its "
            "backward was already over): a prefetch in backward must be of the unit whose backward comes next, "
            "the one before it in forward (next_in_backward), not the next one in forward order; this gather "
            "moves a unit nobody needs and keeps it until backward ends")


def _check_wait_order(step, waits, unit_order, unit_of_bucket, names, prefetch):
    """With prefetch, whenever the hooks wait for a unit's transfer, the next unit's (in this phase's
    order: forward's, or its reverse) is already on its way, so that the two travel together.
    Returns (such waits, waits checked)."""
    checked = overlapped = 0
    for phase, bi, ready in waits:
        unit = unit_of_bucket[bi]
        if not prefetch or step == 0 or unit not in unit_order:  # the first step learns the order
            continue
        k = unit_order.index(unit) + (1 if phase == "forward" else -1)
        nxt = [b for b, u in enumerate(unit_of_bucket) if 0 <= k < len(unit_order) and u is unit_order[k]]
        if not nxt:  # the last unit of the phase, or a next unit that owns no bucket: nothing to prefetch
            continue
        checked += 1
        if all(b in ready for b in nxt):
            overlapped += 1
            continue
        nxt = nxt[0]
        raise AssertionError(
            f"step {step + 1}: in {phase}, the hooks waited for {names[bi]}'s all-gather before they had started "
            f"{names[nxt]}'s, the unit that comes next: {names[nxt]}'s transfer still overlaps {names[bi]}'s compute, "
            f"but not the wait for {names[bi]}'s own transfer, so the two travel one after the other. Where a unit's "
            "transfer has not arrived when its turn comes (forward's first unit's never has), that wait is "
            "time the next transfer could have used: in gather_unit, start the next unit's gather before waiting "
            "for this one's")
    return overlapped, checked


def _check_root_gathers(step, issued, buckets, unit_of_bucket, model, name_of):
    """The root unit is gathered once per step: it stays full from its forward to the end of backward."""
    for bi, (b, unit) in enumerate(zip(buckets, unit_of_bucket)):
        if unit is not model:
            continue
        f, bw = issued["forward"].count(bi), issued["backward"].count(bi)
        if f + bw > 1:
            how = ("it was freed after its forward and gathered again for backward" if f and bw else
                   "it was freed and gathered again within one phase")
            raise AssertionError(
                f"step {step + 1}: the root unit (the model itself, owning {', '.join(name_of[p] for p in b.params)}) "
                f"was all-gathered {f + bw} times ({f} in forward, {bw} in backward): {how}, an extra all-gather "
                "of the root every step (for a language model, its tied embedding); the root stays gathered from "
                "the start of forward to the end of backward")


def _check_traffic(step, fwd, bwd, buckets, events, names, prefetch, model, unit_of_bucket, freed):
    """Raise at the first violation; return what was measured of prefetch, for the message:
    {"forward": (units gathered ahead of their forward, units after the first),
     "backward": (units gathered ahead of their backward, units after the first that forward had freed)}."""
    ran = sorted({bi for phase, bi, _ in events if phase == "forward"})
    for where, c in (("forward", fwd), ("backward", bwd)):
        odd = [op for op in ("all_reduce", "broadcast", "reduce", "gather", "scatter") if c.count(op)]
        if odd:
            raise AssertionError(f"step {step + 1}: {where} made {' + '.join(odd)}: ZeRO-3 needs all-gathers of "
                                 "the parameters and reduce-scatters of the gradients only")
    gathers = fwd.count("all_gather") + bwd.count("all_gather")
    volume = fwd.volume("all_gather") + bwd.volume("all_gather")
    volume_limit = 2 * sum(buckets[bi].padded_numel for bi in ran)
    if gathers > 2 * len(ran) or volume > volume_limit:
        raise AssertionError(
            f"step {step + 1}: {gathers} all-gathers ({fwd.count('all_gather')} in forward, {bwd.count('all_gather')} "
            f"in backward) moving {volume} elements, for {len(ran)} units that ran: at most two per unit (before its "
            f"forward, before its backward), {volume_limit} elements; a unit already gathered, or whose gather is "
            "in flight, must not be gathered again, and a prefetch must be of the unit that runs next")
    if bwd.count("reduce_scatter") != len(buckets):
        raise AssertionError(f"step {step + 1}: backward made {bwd.count('reduce_scatter')} reduce-scatters; "
                             f"expected one per bucket ({len(buckets)}): send() must call ZeRO-2's (super().send(bi))")
    # the k-th unit to run was prefetched if its all-gather was issued before its own pre-hook
    forward = [(bi, c) for phase, bi, c in events if phase == "forward"]
    ahead = {"forward": (sum(c >= k + 1 for k, (_, c) in enumerate(forward) if k > 0), max(len(forward) - 1, 0))}
    for k, (bi, c) in enumerate(forward):
        if prefetch and step > 0 and k > 0 and c < k + 1:
            raise AssertionError(
                f"step {step + 1}: when {names[bi]}'s forward was about to begin, its all-gather had not been issued "
                f"({c} in this forward, for the {k} unit(s) before it): with prefetch, each unit's gather starts "
                "while the unit before it computes (in gather_unit, before waiting for the current unit's)")
        if not prefetch and c != k:
            raise AssertionError(
                f"step {step + 1}, prefetch=False: when {names[bi]}'s forward was about to begin, {c} all-gather(s) "
                f"had been issued in this forward, expected {k} (one per unit before it): without prefetch nothing "
                "is gathered ahead")
    # in backward, by state rather than by count: a unit never freed needs no gather
    seen, backward = [], []
    for phase, bi, is_ready in events:
        if phase != "backward" or unit_of_bucket[bi] is model or bi in seen:
            continue
        seen.append(bi)
        if bi in freed and len(seen) > 1:  # the first unit's turn comes before any hook could prefetch it
            backward.append(is_ready)
        if prefetch and len(seen) > 1 and not is_ready:
            raise AssertionError(
                f"step {step + 1}: when {names[bi]}'s backward was about to begin, its parameters were empty "
                "and no all-gather of them had been issued: with prefetch, the unit whose backward comes next "
                "(the one before it in forward order: next_in_backward) is gathered while the current one computes")
    ahead["backward"] = (sum(backward), len(backward))
    return ahead


# ---------------------------------------------------------------------------------------
# in the notebook


@renamed_args(kind="model")
def check_gather_free(cls, world_size=2, model="mlp", timeout=60.0):
    """ShardedParameters' mechanics, bucket by bucket, the class given a process group of its
    own: finish_gather makes one all-gather, on that group, and installs every rank's current
    shard in place, as views of self.full[bi]; start_gather starts it asynchronously and is
    not repeated; free() empties the parameters, releases the buffer's memory in place (a view
    taken before, as autograd keeps, has no bytes left), and waits for a prefetch nobody used
    before it releases that buffer too; the next gather refills
    that same storage; no copy of the gathered weights survives. Then real steps under
    zerokit's hooks on BranchNet, whose second step skips a unit: no buffer stays allocated
    between steps."""
    __tracebackhide__ = True
    _validate(cls, MECHANICS, "ShardedParameters")
    res = run_on_ranks(_gather_free_case, world_size, args=(cls, model), what=f"{cls.__name__} on {model}",
                       timeout=timeout)
    passed(f"{cls.__name__} gathers and frees correctly on {world_size} ranks ({model}, {res[0]['buckets']} buckets): "
           "one all-gather per gather, on the group it was given, its work waited for before finish_gather returned, "
           "prefetches not repeated, every rank's current shard in place, the buffer's memory released by free() "
           "(under autograd's saved views too, and for a prefetch nobody used, once its transfer was waited for) and "
           "refilled by the next gather; in real steps under zerokit's hooks, a unit the model skipped left no "
           "buffer allocated")


def _hooks_run(case, cls, world_size, args, what, timeout):
    __tracebackhide__ = True
    _validate(cls, HOOKS, "MyZeRO3Adam")
    return run_on_ranks(case, world_size, args=(cls, *args), what=what, timeout=timeout)


@renamed_args(kind="model")
def check_numerics(cls, world_size=2, model="mlp", units=None, steps=4, timeout=60.0):
    """Every step, each rank on its own data: the gradient shards, the weights (gathered) and
    Adam's m and v shards equal one process running torch.optim.AdamW on the whole batch."""
    __tracebackhide__ = True
    ref = adamw_reference(model, steps, HYPER, batch_backward, (model, world_size * PER_RANK), timeout=timeout)
    _hooks_run(_numerics_case, cls, world_size, (model, units, ref), f"{cls.__name__} on {model}", timeout)
    how = "" if units is None else f", units={units}"
    passed(f"{cls.__name__} matches torch.optim.AdamW on {world_size} ranks ({model}{how}): gradient shards, weights "
           f"and Adam's m, v after each of {steps} steps, every parameter empty between steps")


@renamed_args(kind="model")
def check_memory(cls, world_size=2, model="nested", units=None, steps=2, timeout=60.0):
    """Parameters 1/N per rank: empty between steps, model state at rest ~ 12Ψ/N bytes,
    each unit full for its forward and freed right after, freed in backward once its
    gradients are sent, and the peak of live parameter bytes in forward far below Ψ. After an
    eval forward under torch.no_grad(), every unit is freed, the root too."""
    __tracebackhide__ = True
    res = _hooks_run(_memory_case, cls, world_size, (model, units, steps), f"{cls.__name__} on {model}", timeout)
    r = res[0]
    passed(f"{cls.__name__} keeps parameters sharded on {world_size} ranks ({model}, Ψ = {r['psi']}): between steps "
           f"{r['params_at_rest']} bytes of parameters per rank (its shards: 4Ψ/N = {r['shard_bytes']}); inside "
           f"forward at most {r['peak_forward'] - r['shard_bytes']} bytes gathered beside them (a full copy would be "
           f"{4 * r['psi']}); each unit freed after its forward and once its gradients are sent, and every unit "
           + (f"after an eval forward under torch.no_grad(), the root included ({r['root']} elements: "
              f"{', '.join(r['root_params'])})" if r["root"] else
              "after an eval forward under torch.no_grad() (this model's root unit owns no parameters)"))


@renamed_args(kind="model")
def check_traffic(cls, world_size=2, model="mlp", units=None, steps=2, timeout=60.0):
    """Per step: at most two all-gathers per unit (one for the root, gathered from its forward
    to the end of backward), one reduce-scatter per bucket, no all-reduce in forward or
    backward: ≤ 3Ψ (1.5x data parallel). Prefetch: the next unit's
    all-gather is issued before the current unit computes, in forward and in backward;
    none ahead with prefetch=False."""
    __tracebackhide__ = True
    res = _hooks_run(_comm_case, cls, world_size, (model, units, steps), f"{cls.__name__} on {model}", timeout)
    r = res[0][True]
    passed(_traffic_message(cls.__name__, world_size, model, r, res[0][False]))


def _traffic_message(name, world_size, model, measured, without_prefetch):
    """What check_traffic saw, and only that: the volumes of the last step, by phase, and which
    units were gathered ahead of their turn (a ✓ never claims what did not happen)."""
    last, psi = measured["rows"][-1], measured["psi"]
    fwd, bwd = last["gathered"]["forward"], last["gathered"]["backward"]
    scatter = last["total"]["reduce_scatter"]
    moved = last["total"]["all_gather"] + scatter
    if bwd:
        gathers = f"all-gather {fwd} in forward + {bwd} in backward"
    else:
        gathers = (f"all-gather {fwd} in forward, no all-gather in backward (no unit was freed after its forward, "
                   "so none had to be gathered again: the memory check judges that)")
    (f_ahead, f_units), (b_ahead, b_units) = last["ahead"]["forward"], last["ahead"]["backward"]
    prefetched = f"{f_ahead} of {f_units} units in forward"
    prefetched += f", {b_ahead} of {b_units} in backward" if b_units else ", none needed in backward"
    prefetched += " (each phase's first unit cannot be)"
    overlapped, checked = last["overlapped"]
    if checked:
        prefetched += (f"; each of the {checked} waits for a unit's transfer had the next unit's already on its way"
                       if overlapped == checked else f"; {overlapped} of {checked} waits had the next transfer on its way")
    none_ahead = all(row["ahead"]["forward"][0] == 0 for row in without_prefetch["rows"])
    return (f"{name} communicates {moved / psi:.2f}Ψ per step on {world_size} ranks ({model}, Ψ = {psi}): {gathers}, "
            f"reduce-scatter {scatter} (ZeRO-3 as taught: 3Ψ; data parallel: 2Ψ). Gathered ahead of their turn: "
            f"{prefetched}" + ("; with prefetch=False, none ahead" if none_ahead else ""))


check_matches_adamw = alias(check_numerics, "check_matches_adamw", kind="model")
check_parameters_sharded = alias(check_memory, "check_parameters_sharded", kind="model")
check_communication = alias(check_traffic, "check_communication", kind="model")
