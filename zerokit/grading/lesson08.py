r"""Checks for lesson 08 (beyond model states): activations counted, recomputation under
ZeRO-3, and Adam's state streamed from disk.

Exercise 1, `saved_activation_bytes(module, *inputs) -> int`: the bytes autograd saves for
backward when the module runs once, each storage once, parameters left out. The reference
is computed another way: by walking the autograd graph the forward built and reading each
node's saved tensors (`grad_fn._saved_*`).
- check_saved_bytes     layers whose saved tensors have storages of their own (a linear
                        layer on a 3-D input, LayerNorm, an MLP, tanh, an embedding): the
                        count, and the weights they save left out;
- check_saved_views     modules without parameters that save several views of one storage,
                        in one shape or in several, or a view of part of one (sin x * cos x,
                        attention's q, k, v, sin x * cos of x flattened, a slice,
                        x.t() * x.t()): each storage once, and all of it.

Exercise 2, `RecomputingZeRO3` (on zerokit.ZeRO3Adam): `pre_forward` and `post_forward`
that also do the right thing when backward recomputes a checkpointed block (in_backward()).
The zoo's transformer runs with both blocks checkpointed (zerokit.activations.
checkpoint_modules, non-reentrant) and ZeRO-3's default units, which lie inside them. Each
check grades one hook and gives the student's class zerokit's version of the other (and
zerokit's own recompute handling refuses to run for the student's code):
- check_recompute         `pre_forward` (zerokit's `post_forward`): weights, m and v equal
                          torch.optim.AdamW after every step, so the recomputation ran on full
                          parameters; in backward no unit is gathered twice (a prefetch in
                          forward order fetches a unit whose backward is over);
- check_recompute_memory  `post_forward` in forward (zerokit's `pre_forward`): every unit
                          but the root freed right after its forward although its block is
                          checkpointed, every parameter empty and the model state 12 Psi/N at
                          rest (after an eval forward under no_grad too), and the saved
                          activations of a block are its input only; model="awkward": a root
                          unit that owns a tied embedding stays gathered from its forward to
                          the end of backward, recomputations included;
- check_recompute_traffic `post_forward` in a recomputation (zerokit's `pre_forward`): each
                          bucket reduce-scattered once and gathered at most twice per step: a
                          recomputed unit stays gathered for the backward that follows.

Exercise 3, `disk_adam_step(master, exp_avg, exp_avg_sq, grad, half, step, *, lr, beta1,
beta2, eps, weight_decay, chunk_numel)`: AdamW on a shard whose fp32 master, m and v are
zerokit.offload.DiskTensors, at most chunk_numel elements at a time, writing the rounded
weights into `half`:
- check_offload_numerics  master, m and v (read back from the files) and the 16-bit weights
                          equal torch.optim.AdamW's after each of 3 steps, on 2 ranks;
- check_offload_memory    on a 4 Mi-element shard (48 MiB of state on disk), the peak resident
                          memory of the rank during the step rises by at most 12 MiB, not by
                          the state (the kernel's high-water mark, /proc/self/clear_refs), and
                          none of the three files keeps its pages resident after the step.
"""

import gc
import os
import tempfile

import torch
from torch import nn

from ..activations import SavedActivations, checkpoint_modules
from ..comm import CommCounter
from ..hooks import in_backward
from ..memory import PeakRSS, census, settled_resident_bytes
from ..models import build_model, model_loss
from ..offload import DiskPlace, DiskTensor
from ..zero1 import ShardedAdamState
from ..zero3 import ZeRO3Adam
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks, torch_adam_allowed
from .kit import (SHARDED_HYPER, adamw_reference, assert_adam_shards, batch_backward, bucket_label, check_class,
                  rank_batch, refusing)

__all__ = ["check_saved_bytes", "check_saved_views", "check_recompute", "check_recompute_memory",
           "check_recompute_traffic", "check_offload_numerics", "check_offload_memory", "reference_saved_bytes"]

_HOOKS_ONLY = ("n/a: the hooks decide when a unit is gathered and freed; which parameters train, and how "
               "gradients reach the buckets, is zerokit's ZeRO-3 (lesson 05), given here")
# which of kit.SITUATIONS the hidden tests meet (tests/test_situations.py holds this to them)
SITUATIONS = {
    "root-params": "check_recompute_memory: awkward",  # the root owns the tied embedding: gathered until backward ends
    "tuple-output": "check_recompute_memory: awkward",  # attn returns a tuple, mix a dict (checkpointed both)
    "tied": "check_recompute_memory: awkward",
    "eval-no-grad": "check_recompute_memory",  # after the steps, an eval forward under no_grad: nothing full
    "zero3": "check_recompute",  # exercise 2 is ZeRO-3's hooks (every check of it)
    "n3": "check_recompute: world_size=3",
    "zero-grad-shard": "check_offload_numerics: world_size=3",  # the last rank's gradient is zeros on step 2
    # the kernel's high-water mark during the step. Exercise 1's memory rule (each storage once, all of it) is
    # met by its own modules, not the zoo: check_saved_views saves one storage as views of one shape (q, k, v)
    # and of two (x, and x flattened, as a Block's attention output and the projection's input are)
    "peak-memory": "check_offload_memory",
    "frozen": _HOOKS_ONLY,
    "unused": _HOOKS_ONLY,
    "out-of-order": _HOOKS_ONLY,
    "sits-out": "n/a: a unit that sits out a step runs no hook; its step count is zerokit's (the disk step is "
                "handed one step number for its whole shard)",
    "subgroup": "n/a: the hooks gather and free through zerokit's ZeRO-3 in its group; the disk step is one "
                "rank's own shard, with no collective",
    "fp16-scale": "n/a: the disk step receives the fp32 mean gradient, already unscaled; the hooks move "
                  "weights, not gradients",
}

MiB = 2**20

# ---------------------------------------------------------------------------------------
# exercise 1: counting


class SinCos(nn.Module):
    """sin(x) * cos(x): sin and cos both save x."""

    def forward(self, x):
        return torch.sin(x) * torch.cos(x)


class ChunkAttention(nn.Module):
    """Causal attention on q, k, v cut from one tensor: three views of one storage saved."""

    def forward(self, qkv):
        q, k, v = qkv.chunk(3, dim=-1)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class Square(nn.Module):
    """x * x on a transposed view of x: mul saves both operands, one view, twice."""

    def forward(self, x):
        xt = x.t()
        return xt * xt


class HalfSin(nn.Module):
    """sin of the first half of x: sin saves a view of part of x, which keeps all of x alive."""

    def forward(self, x):
        return torch.sin(x[:, : x.shape[1] // 2])


class SinCosFlat(nn.Module):
    """sin(x) * cos(x flattened): sin saves x, cos saves a view of x in another shape (as a linear layer
    saves its 3-D input reshaped to 2-D): one storage, two views of different shapes."""

    def forward(self, x):
        return torch.sin(x) * torch.cos(x.reshape(-1)).reshape(x.shape)


def _layers(which, seed=0):
    torch.manual_seed(8 + seed)

    def _grad_input(first, *rest):  # the input of a layer deep inside a model; seed: other sizes
        return torch.randn(first + seed, *rest).requires_grad_()

    if which == "plain":
        return [("nn.Linear(13, 7) on a (2, 5, 13) input", nn.Linear(13, 7), (_grad_input(2, 5, 13),)),
                ("nn.LayerNorm(13)", nn.LayerNorm(13), (_grad_input(3, 4, 13),)),
                ("Linear -> GELU -> Linear", nn.Sequential(nn.Linear(13, 29), nn.GELU(), nn.Linear(29, 13)),
                 (_grad_input(6, 13),)),
                ("nn.Tanh()", nn.Tanh(), (_grad_input(4, 6),)),
                ("nn.Embedding(11, 6)", nn.Embedding(11, 6), (torch.randint(0, 11, (3 + seed, 4)),))]
    # no parameters here: a count that includes the weights costs check_saved_bytes only
    return [("sin(x) * cos(x)", SinCos(), (_grad_input(4, 6),)),
            ("attention on q, k, v = qkv.chunk(3)", ChunkAttention(), (_grad_input(2, 3, 7, 12),)),
            ("sin(x) * cos(x.reshape(-1)).reshape(x.shape)", SinCosFlat(), (_grad_input(3, 5),)),
            ("sin of x's first half", HalfSin(), (_grad_input(5, 8),)),
            ("x.t() * x.t()", Square(), (_grad_input(3, 7),))]


def _walk(outputs):
    """Every tensor the autograd graph behind `outputs` holds for backward (grad_fn._saved_*)."""
    seen, stack, found = set(), [o.grad_fn for o in outputs], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                found += [t for t in (value if isinstance(value, (list, tuple)) else [value])
                          if isinstance(t, torch.Tensor)]
        stack += [f for f, _ in node.next_functions]
    return found


def reference_saved_bytes(module, *inputs):
    """{"bytes": the right count, "parameters": the bytes of the saved weights, "per_tensor": each
    saved tensor's storage counted every time, "elements": each storage counted by the elements
    of its views}, read from the autograd graph of one forward."""
    out = module(*inputs)
    saved = [t for t in _walk([o for o in (out if isinstance(out, tuple) else (out,)) if o.grad_fn is not None])
             if t.untyped_storage().nbytes()]
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    acts = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in acts}
    views, shaped = {}, {}
    for t in acts:
        key = t.untyped_storage().data_ptr()
        views[key] = max(views.get(key, 0), t.numel() * t.element_size())
        shaped[(key, tuple(t.shape))] = t.untyped_storage().nbytes()
    return {"bytes": sum(storages.values()),
            "parameters": sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                               for t in saved if t.untyped_storage().data_ptr() in params}.values()),
            "per_tensor": sum(t.untyped_storage().nbytes() for t in acts), "elements": sum(views.values()),
            "by_shape": sum(shaped.values()),
            "tensors": len(acts)}


_NO_COUNTER = (SavedActivations, "_pack", "your code used zerokit.activations.SavedActivations: the exercise is to "
               "count the saved tensors yourself, with torch.autograd.graph.saved_tensors_hooks")


def _count_case(rank, world_size, fn, which, seed):
    rows = []
    for label, module, inputs in _layers(which, seed):
        want = reference_saved_bytes(module, *inputs)
        with refusing(_NO_COUNTER):
            got = fn(module, *inputs)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or got != got:
            raise AssertionError(f"saved_activation_bytes({label}) returned {got!r}: return the number of bytes (an int)")
        if got != want["bytes"]:
            raise AssertionError(_count_hint(label, got, want))
        rows.append((label, int(got)))
    return rows


def _count_hint(label, got, want):
    said = f"{label}: you counted {got:g} bytes, autograd saved {want['bytes']} bytes of activations"
    if want["parameters"] and got == want["bytes"] + want["parameters"]:
        return (f"{said}; the difference, {want['parameters']} bytes, is the layer's weights, which it saves too: "
                "they are model state, not activations; leave out storages that back a parameter")
    if got == want["by_shape"] and want["by_shape"] != want["bytes"]:
        return (f"{said}; {want['by_shape'] - want['bytes']} bytes too many: views of one storage in different "
                "shapes were counted once per shape. A storage is its address alone, whatever the shape of the "
                "view that was saved (key it by untyped_storage().data_ptr(), nothing else)")
    if got == want["per_tensor"]:
        return (f"{said}; it saved {want['tensors']} tensors, some of them views of one storage, and you counted each "
                "view's storage every time: a storage costs its bytes once (key it by untyped_storage().data_ptr())")
    if got == want["elements"]:
        return (f"{said}; you counted the elements of the saved views, but a view of part of a tensor keeps its "
                "whole storage alive: count untyped_storage().nbytes()")
    return f"{said} ({want['tensors']} tensors saved, parameters left out, each storage once)"


def _check_counter(fn, which, seed, timeout):
    __tracebackhide__ = True
    if not callable(fn):
        raise CheckFailed(f"expected your function saved_activation_bytes, got {type(fn).__name__}")
    return run_on_ranks(_count_case, 1, args=(fn, which, seed), what=getattr(fn, "__name__", "your function"),
                        timeout=timeout)[0]


def check_saved_bytes(fn, seed=0, timeout=60.0):
    """The count for layers whose saved tensors each have a storage of their own: the saved
    inputs, outputs and statistics, the saved weights left out."""
    __tracebackhide__ = True
    rows = _check_counter(fn, "plain", seed, timeout)
    passed("saved_activation_bytes equals the count read from the autograd graph (weights left out) on: "
           + "; ".join(f"{label} {n} B" for label, n in rows))


def check_saved_views(fn, seed=0, timeout=60.0):
    """The count where saved tensors share storages: views of one storage counted once, whether
    they have one shape or several, and a view of part of a storage counted as the whole storage
    it keeps alive."""
    __tracebackhide__ = True
    rows = _check_counter(fn, "views", seed, timeout)
    passed("saved_activation_bytes equals the count read from the autograd graph (each storage once, all of it) on: "
           + "; ".join(f"{label} {n} B" for label, n in rows))


# ---------------------------------------------------------------------------------------
# exercise 2: recomputation under ZeRO-3

MODEL = "transformer"
# per model, the modules whose forward is checkpointed: the transformer's blocks (the units inside
# them recomputed); awkward's attn (returns a tuple) and mix (a dict), between the tied embedding
# and head that its root unit owns (gathered from the start of forward to the end of backward)
CHECKPOINTED = {"transformer": lambda net: {f"blocks.{i}": b for i, b in enumerate(net.blocks)},
                "awkward": lambda net: {"attn": net.attn, "mix": net.mix}}
HYPER = SHARDED_HYPER  # eps 1e-6: kit says why
PER_RANK = 2
STEPS = 3
PRE, POST = ("pre_forward", "_pre_recompute"), ("post_forward", "_post_recompute")
_ZEROKIT = {name: ZeRO3Adam.__dict__[name] for name in PRE + POST}  # taken before any check refuses them
_REFUSE_RECOMPUTE = [
    (ZeRO3Adam, name, f"your hooks called zerokit.ZeRO3Adam.{name}, zerokit's own handling of a recomputation: "
     "write what your hook does inside backward yourself") for name in ("_pre_recompute", "_post_recompute")]


def _graded(cls, graded):
    """cls with zerokit's version of the hook not graded here, and a log of the gathers that
    start and the buckets sent."""
    keep = POST if graded == "pre" else PRE
    body = {name: _ZEROKIT[name] for name in keep}

    def start_gather(self, bi):
        starting = self.full[bi] is None and bi not in self.gathering
        ZeRO3Adam.start_gather(self, bi)  # lesson 05's mechanics (zerokit's)
        if starting:
            self.gather_log.append((in_backward(), bi))

    def send(self, bi):
        self.send_log.append(bi)
        ZeRO3Adam.send(self, bi)

    body.update(start_gather=start_gather, send=send)
    return type(cls.__name__, (cls,), body)


def _validate_hooks(cls):
    check_class(cls, "your class (RecomputingZeRO3)", base=ZeRO3Adam,
                base_hint="keep the scaffold's base, zerokit.ZeRO3Adam", methods=("pre_forward", "post_forward"),
                written_in=(ZeRO3Adam,))


def _setup(cls, graded, model_name):
    model = build_model(model_name)
    opt = _graded(cls, graded)(model, **HYPER)
    opt.gather_log, opt.send_log = [], []
    checkpoint_modules(CHECKPOINTED[model_name](model).values())
    names = {p: n for n, p in model.named_parameters()}
    return model, opt, names


def _is_shape_error(exc):
    return isinstance(exc, RuntimeError) and any(w in str(exc) for w in (
        "must be 2-D", "shape", "size", "storage of size 0", "mat1", "normalized_shape", "out of bounds"))


def _train_step(model, opt, step, rank, world_size, model_name):
    x, y = rank_batch(model_name, step, world_size * PER_RANK, rank, world_size)
    try:
        loss = model_loss(model_name, model(x), y)
    except RuntimeError as exc:
        if _is_shape_error(exc):
            raise AssertionError(f"step {step + 1}: forward failed ({str(exc).splitlines()[0]}): a unit ran with "
                                 "empty parameters: in forward, pre_forward gathers the unit") from None
        raise
    try:
        loss.backward()
    except RuntimeError as exc:
        if _is_shape_error(exc):
            raise AssertionError(
                f"step {step + 1}: backward failed ({str(exc).splitlines()[0]}): the recomputation of a checkpointed "
                "block ran a unit whose parameters were freed after its forward: when backward recomputes a unit "
                "(in_backward() is True), pre_forward must gather it") from None
        raise


def _numerics_case(rank, world_size, cls, reference, model_name):
    model, opt, names = _setup(cls, "pre", model_name)
    with refusing(*_REFUSE_RECOMPUTE):
        for step, record in enumerate(reference):
            opt.gather_log.clear()
            _train_step(model, opt, step, rank, world_size, model_name)
            in_bwd = [bi for backward, bi in opt.gather_log if backward]
            twice = sorted({bi for bi in in_bwd if in_bwd.count(bi) > 1})
            if twice:
                bi = twice[0]
                raise AssertionError(
                    f"step {step + 1}: in backward, {bucket_label(bi, opt.buckets[bi], names)} was gathered twice: "
                    "for its own backward, and again by the recomputation of a block computed before it, after its "
                    "backward was over; a recomputation runs the block's units in forward order, but the unit after "
                    "them has had its backward already: in backward, gather the unit and prefetch nothing")
            opt.step()
            assert_adam_shards(opt.shards, opt.buckets, record, names, f"after step {step + 1}")
            with opt.gathered():
                for n, p in model.named_parameters():
                    assert_close(p.detach(), record["params"][n], f"after step {step + 1}: {n}", atol=1e-5, rtol=1e-4)
            opt.zero_grad()
    return len(opt.buckets)


def _memory_case(rank, world_size, cls, model_name):
    gc.collect()
    before = census()["total"]
    model, opt, names = _setup(cls, "post", model_name)
    problems, peak = [], [0]
    units = {m: n or "(root)" for n, m in model.named_modules()}
    shard_bytes = 4 * sum(b.shard_numel for b in opt.buckets)
    root = [p for bi in opt.buckets_of_unit[0] for p in opt.buckets[bi].params]  # a tied embedding, say

    def root_freed():
        return next((names[p] for p in root if not p.numel()), None)

    def post(module, args, output, u):
        if problems:
            return
        if in_backward():  # a recomputation runs in the middle of the backward that needs the root
            if root_freed():
                problems.append(f"during backward, after the recomputed forward of {units[module]}, your post_forward "
                                f"had freed the root unit's {root_freed()}: a recomputation frees nothing, and the "
                                "root stays gathered until backward ends (gradients still to come land in its "
                                "parameters; send() and the end of backward free it)")
            return
        if u == 0 and torch.is_grad_enabled() and root_freed():
            problems.append(f"right after the forward, your post_forward freed the root unit's {root_freed()} "
                            "although backward comes: free every unit but the root, which stays gathered until "
                            "backward ends (its parameters, here a tied embedding, get gradients from the first "
                            "backward and the last)")
        full = [names[p] for bi in opt.buckets_of_unit[u] for p in opt.buckets[bi].params if p.numel()]
        if u != 0 and full:
            problems.append(f"right after {units[module]}'s forward, {full[0]} still held its full weights: free "
                            "every unit after its forward, also inside a checkpointed block; backward's "
                            "recomputation gathers it again when it needs it")
        live = census(model, opt, scan=False)["parameters"]
        peak[0] = max(peak[0], live)

    for u, unit in enumerate(opt.units):  # after the optimizer's hooks: they see what its hook left
        unit.register_forward_hook(lambda m, a, o, u=u: post(m, a, o, u))
    layers = CHECKPOINTED[model_name](model)
    inputs = {}  # each checkpointed module's input, in bytes: all that it may save
    for name, layer in layers.items():
        layer.register_forward_pre_hook(lambda m, a, name=name: inputs.__setitem__(name, sum(
            t.untyped_storage().nbytes() for t in a if isinstance(t, torch.Tensor))))
    with refusing(*_REFUSE_RECOMPUTE):
        for step in range(2):
            with SavedActivations(model, layers) as acts:
                try:
                    _train_step(model, opt, step, rank, world_size, model_name)
                except Exception:  # what the hooks saw first is the cause (a root freed mid-backward crashes later)
                    if not problems:
                        raise
            if problems:
                raise AssertionError(f"step {step + 1}: {problems[0]}")
            opt.step()
            opt.zero_grad()
            kept = [n for n, p in model.named_parameters() if p.requires_grad and p.numel()]
            if kept:
                raise AssertionError(f"after step {step + 1}, {kept[0]} is full: between steps every parameter must "
                                     "be empty, only this rank's shard kept")
        model.eval()  # an evaluation: no backward comes, so nothing may stay gathered, the root included
        with torch.no_grad():
            model(rank_batch(model_name, 2, world_size * PER_RANK, rank, world_size)[0])
        model.train()
        kept = [n for n, p in model.named_parameters() if p.requires_grad and p.numel()]
        if problems or kept:
            raise AssertionError(problems[0] if problems else
                                 f"after an eval forward under torch.no_grad(), {kept[0]} is still full: with no "
                                 "backward coming, every unit is freed after its forward, the root too")
    saved = [acts.per_layer[n] for n in layers]
    block_input = [inputs[n] for n in layers]
    if saved != block_input:
        raise AssertionError(f"each checkpointed block saved {saved} bytes; its input alone is {block_input}")
    gc.collect()
    grown = census(model, opt)["total"] - before
    psi = sum(b.param_numel for b in opt.buckets)
    if grown > 3 * shard_bytes + max(2048, psi):
        raise AssertionError(f"between steps this rank holds {grown} bytes of model state; its shards with Adam's m "
                             f"and v are {3 * shard_bytes}: something keeps full-size buffers alive")
    root_bytes = sum(4 * opt.buckets[bi].padded_numel for bi in opt.buckets_of_unit[0])
    sizes = sorted((4 * opt.buckets[bi].padded_numel for u in range(1, len(opt.units))
                    for bi in opt.buckets_of_unit[u]), reverse=True)
    bound = shard_bytes + root_bytes + sum(sizes[:2])
    if peak[0] > bound:
        raise AssertionError(f"inside forward this rank held up to {peak[0]} bytes of parameters; its shards, the root "
                             f"unit and two units (the one computing, the one prefetched) are at most {bound}; a full "
                             f"copy is {4 * psi}: units are gathered and not freed")
    return {"peak": peak[0], "bound": bound, "psi": psi, "saved": saved, "block_input": block_input,
            "root": [names[p] for p in root]}


def _traffic_case(rank, world_size, cls, model_name):
    model, opt, names = _setup(cls, "post", model_name)
    rows = []
    with refusing(*_REFUSE_RECOMPUTE):
        for step in range(2):
            opt.gather_log.clear(), opt.send_log.clear()
            with CommCounter() as comm:
                _train_step(model, opt, step, rank, world_size, model_name)
            sends = [opt.send_log.count(bi) for bi in range(len(opt.buckets))]
            if comm.count("reduce_scatter") != len(opt.buckets) or any(n != 1 for n in sends):
                bi = max(range(len(sends)), key=sends.__getitem__) if max(sends) > 1 else sends.index(min(sends))
                raise AssertionError(
                    f"step {step + 1}: backward made {comm.count('reduce_scatter')} reduce-scatters for "
                    f"{len(opt.buckets)} buckets; {bucket_label(bi, opt.buckets[bi], names)} was sent {sends[bi]} "
                    "times: a bucket is reduce-scattered once, when its gradients are in (ZeRO-2's hook); the end of "
                    "a recomputed forward sends nothing")
            gathers = [[bi for _, bi in opt.gather_log].count(bi) for bi in range(len(opt.buckets))]
            if any(n > 2 for n in gathers):
                bi = max(range(len(gathers)), key=gathers.__getitem__)
                raise AssertionError(
                    f"step {step + 1}: {bucket_label(bi, opt.buckets[bi], names)} was all-gathered {gathers[bi]} "
                    "times in one step, at most 2 (forward, backward): freed at the end of its recomputation, it "
                    "had to be gathered again for the backward that follows; inside backward, keep the unit "
                    "gathered after its forward (send() frees it once its gradients are sent)")
            opt.step()
            opt.zero_grad()
            rows.append({"gathers": comm.volume("all_gather"), "reduce_scatters": comm.volume("reduce_scatter")})
    return {"rows": rows, "psi": sum(b.param_numel for b in opt.buckets)}


def check_recompute(cls, world_size=2, model=MODEL, timeout=60.0):
    """pre_forward under recomputation: checkpointed blocks train exactly like AdamW on one
    process (the recomputation ran on full parameters), and no unit is gathered twice in backward."""
    __tracebackhide__ = True
    _validate_hooks(cls)
    ref = adamw_reference(model, STEPS, HYPER, batch_backward, (model, world_size * PER_RANK), timeout=timeout)
    n = run_on_ranks(_numerics_case, world_size, args=(cls, ref, model), what=f"{cls.__name__} on {model}",
                     timeout=timeout)[0]
    passed(f"{cls.__name__} with checkpointed blocks matches torch.optim.AdamW on {world_size} ranks ({model}, "
           f"{n} units, most inside the blocks): weights, m and v after each of {STEPS} steps; the recomputation "
           "found its units full and gathered nothing else")


def check_recompute_memory(cls, world_size=2, model=MODEL, timeout=60.0):
    """post_forward in forward: every unit but the root freed right after its forward although its
    block is checkpointed, the root kept until backward ends (model="awkward": a root that owns a tied
    embedding); parameters empty and model state 12 Psi/N at rest, after an eval forward under
    no_grad too; each block keeps its input only."""
    __tracebackhide__ = True
    _validate_hooks(cls)
    r = run_on_ranks(_memory_case, world_size, args=(cls, model), what=f"{cls.__name__} on {model}",
                     timeout=timeout)[0]
    root = f"; the root unit ({', '.join(r['root'])}) kept until backward ends" if r["root"] else ""
    passed(f"{cls.__name__} frees every unit after its forward with checkpointed blocks on {world_size} ranks "
           f"({model}, Ψ = {r['psi']}){root}: parameter bytes inside forward at most {r['peak']} (bound "
           f"{r['bound']}), each block saved {r['block_input']} bytes, its input; nothing full at rest, after an "
           "eval forward under no_grad too")


def check_recompute_traffic(cls, world_size=2, model=MODEL, timeout=60.0):
    """post_forward in a recomputation: each bucket reduce-scattered once and all-gathered at
    most twice per step: the recomputation costs no communication."""
    __tracebackhide__ = True
    _validate_hooks(cls)
    r = run_on_ranks(_traffic_case, world_size, args=(cls, model), what=f"{cls.__name__} on {model}",
                     timeout=timeout)[0]
    last = r["rows"][-1]
    passed(f"{cls.__name__} with checkpointed blocks communicates {last['gathers']} (all-gather) + "
           f"{last['reduce_scatters']} (reduce-scatter) = {(last['gathers'] + last['reduce_scatters']) / r['psi']:.2f}Ψ "
           f"per step on {world_size} ranks ({model}, Ψ = {r['psi']}): no more than without recomputation")


# ---------------------------------------------------------------------------------------
# exercise 3: the disk-offloaded Adam step

OFFLOAD_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
_REFUSE_OFFLOAD = [(DiskPlace, "after_chunk", "your code used zerokit's offloaded optimizer (DiskPlace): write the "
                    "chunked step yourself"),
                   (ShardedAdamState, "update", "your code used zerokit's ShardedAdamState.update: write the chunked "
                    "step yourself")]


def _shard_data(rank, numel, steps):
    g = torch.Generator().manual_seed(800 + rank)
    return torch.randn(numel, generator=g), [torch.randn(numel, generator=g) for _ in range(steps)]


def _files(folder, numel, init, prefix=""):
    # m and v written as zeros, not left as holes: on a tmpfs (the sandbox's /tmp) a read of a hole
    # maps pages that release(a, b) leaves resident (about 5 pages per window), which is the
    # kernel's doing, not the step's
    zeros = torch.zeros(numel)
    return [DiskTensor(os.path.join(folder, f"{prefix}{name}.f32"), numel, init=t)
            for name, t in (("master", init), ("exp_avg", zeros), ("exp_avg_sq", zeros))]


def _offload_numerics_case(rank, world_size, fn, numel, chunk, steps):
    weights, grads = _shard_data(rank, numel, steps)
    if rank == world_size - 1 and steps > 1:  # a shard whose whole gradient is zero (rows no batch used):
        grads[1] = torch.zeros(numel)  # AdamW still steps it (m, v decay; weight decay), nothing is skipped
    expected = []
    with torch_adam_allowed():  # the reference, before any of the student's code runs here
        p = torch.nn.Parameter(weights.clone())
        h = OFFLOAD_HYPER
        ref = torch.optim.AdamW([p], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                weight_decay=h["weight_decay"], foreach=False)
        for g in grads:
            p.grad = g.clone()
            ref.step()
            s = ref.state[p]
            expected.append((p.detach().clone(), s["exp_avg"].clone(), s["exp_avg_sq"].clone()))
    with tempfile.TemporaryDirectory(prefix="lesson08-") as folder:
        master, m, v = _files(folder, numel, weights)
        half = weights.to(torch.bfloat16)
        with refusing(*_REFUSE_OFFLOAD):
            for step, (g, (w, em, ev)) in enumerate(zip(grads, expected)):
                m_before = m.read() if not g.any() else None
                fn(master, m, v, g, half, step + 1, chunk_numel=chunk, **OFFLOAD_HYPER)
                when = f"after step {step + 1}"
                got_m, got_v = m.read(), v.read()
                if m_before is not None and torch.equal(got_m, m_before):
                    raise AssertionError(f"{when}: this rank's gradient was all zeros and your step left m unchanged: "
                                         "a zero gradient is still a step (m and v decay, weight decay and the "
                                         "momentum move the weights); skip nothing")
                if not got_m.any():
                    raise AssertionError(f"{when}: m in its file is still all zeros: the step updated a copy of the "
                                         "chunk (clone, .read(), torch.tensor(...)), not the view of the mapping "
                                         "(exp_avg[a:b] is a view: update it in place)")
                assert_close(got_m, em, f"{when}: m (exp_avg) read back from its file", atol=1e-7, rtol=1e-5)
                assert_close(got_v, ev, f"{when}: v (exp_avg_sq) read back from its file", atol=1e-9, rtol=1e-4)
                assert_close(master.read(), w, f"{when}: the fp32 master read back from its file", atol=1e-6, rtol=1e-5)
                if torch.equal(half, weights.to(torch.bfloat16)):
                    raise AssertionError(f"{when}: `half`, the 16-bit weights the model computes with, did not change: "
                                         "copy each updated chunk of the master into it")
                assert_close(half, w.to(torch.bfloat16), f"{when}: the 16-bit weights (half)")
        for t in (master, m, v):
            t.close()
    return numel


def _resident_file_bytes(path):
    """Bytes of the file at `path` resident in this process: the Rss of its mappings (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split(None, 5)
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line: address range ... path
                inside = len(fields) == 6 and fields[5].rstrip("\n") == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


OFFLOAD_FILES = ("master", "exp_avg", "exp_avg_sq")


def _offload_memory_case(rank, world_size, fn, numel, chunk):
    settled_resident_bytes()  # its first call: large blocks become mappings of their own, RSS follows tensors
    with tempfile.TemporaryDirectory(prefix="lesson08-") as folder, refusing(*_REFUSE_OFFLOAD):
        # a first call on a small shard: what a process allocates once (torch's first use of these
        # operations, the mapping code) is not the step's
        small, (small_grad,) = _shard_data(rank, 4 * chunk, 1)
        files = _files(folder, 4 * chunk, small)
        fn(*files, small_grad, small.to(torch.bfloat16), 1, chunk_numel=chunk, **OFFLOAD_HYPER)
        for t in files:
            t.close()
    weights, (grad,) = _shard_data(rank, numel, 1)
    with tempfile.TemporaryDirectory(prefix="lesson08-") as folder:
        master, m, v = _files(folder, numel, weights)
        half = weights.to(torch.bfloat16)
        before = half.clone()
        with PeakRSS() as peak, refusing(*_REFUSE_OFFLOAD):  # the kernel's high-water mark, reset on entry
            fn(master, m, v, grad, half, 1, chunk_numel=chunk, **OFFLOAD_HYPER)
        if peak.bytes is None:
            raise AssertionError("this machine gives no peak resident memory (/proc/self/status, clear_refs): "
                                 "the check needs Linux")
        rise = peak.bytes
        # what each file still has in memory: release(a, b) leaves none of a window behind
        left = {name: _resident_file_bytes(t.path) for name, t in zip(OFFLOAD_FILES, (master, m, v))}
        changed = not torch.equal(half, before)
        for t in (master, m, v):
            t.close()
    state, file = 3 * 4 * numel, 4 * numel
    # a correct step rises by 0.5-1.5 MiB (0.5-0.9 with chunks of 2**15), 10 MiB under the bound; a
    # file is 16 MiB: one file brought in whole, or copied, is 4 MiB over it
    bound = max(12 * MiB, 16 * 4 * chunk)
    if not changed:
        raise AssertionError("your step left the weights (half) unchanged: there is no step to measure")
    kept = [name for name, n in left.items() if n > file // 4]  # a file not released keeps all of it
    if kept:
        released = [name for name in OFFLOAD_FILES if name not in kept]
        which = (f"{kept[0]} still had {left[kept[0]] / MiB:.1f} MiB of its" if len(kept) == 1 else
                 f"{', '.join(kept)} still had up to {max(left.values()) / MiB:.1f} MiB of their")
        raise AssertionError(
            f"after your step {which} {file / MiB:.0f} MiB resident: the windows were used without release(a, b) "
            "giving the pages back" + (f" (you released {' and '.join(released)}, not {' and '.join(kept)})"
                                       if released else "") + ": release each window of all three files")
    if rise > bound:
        raise AssertionError(
            f"during your step this rank's resident memory rose by {rise / MiB:.1f} MiB; the state on disk is "
            f"{state / MiB:.0f} MiB (master, m, v), a chunk of the three {3 * 4 * chunk / MiB:.2f} MiB, and the step may "
            f"use {bound / MiB:.0f} MiB: the state was brought into memory, whole (one chunk of everything, or a "
            "copy of a whole tensor) or chunk after chunk without release(a, b) giving the pages back")
    return {"rise": rise, "state": state, "bound": bound}


def _check_step_fn(fn):
    if not callable(fn):
        raise CheckFailed(f"expected your function disk_adam_step, got {type(fn).__name__}")


def check_offload_numerics(fn, world_size=2, numel=3001, chunk_numel=512, steps=3, timeout=60.0):
    """disk_adam_step against torch.optim.AdamW, each rank on its own shard: the master, m and v
    in their files and the 16-bit weights after every step."""
    __tracebackhide__ = True
    _check_step_fn(fn)
    run_on_ranks(_offload_numerics_case, world_size, args=(fn, numel, chunk_numel, steps),
                 what=f"{getattr(fn, '__name__', 'your function')}", timeout=timeout)
    passed(f"{getattr(fn, '__name__', 'your step')} matches torch.optim.AdamW on {world_size} ranks ({numel} elements "
           f"per shard, chunks of {chunk_numel}): master, m and v in their files and the 16-bit weights, {steps} steps")


def check_offload_memory(fn, world_size=2, numel=4 * 2**20, chunk_numel=2**16, timeout=90.0):
    """The peak resident memory of a rank during disk_adam_step on a large shard rises by a few
    chunks, not by the state on disk."""
    __tracebackhide__ = True
    _check_step_fn(fn)
    res = run_on_ranks(_offload_memory_case, world_size, args=(fn, numel, chunk_numel),
                       what=f"{getattr(fn, '__name__', 'your function')}", timeout=timeout)
    worst = max(r["rise"] for r in res)
    passed(f"{getattr(fn, '__name__', 'your step')} streams the state: resident memory rose by at most "
           f"{worst / MiB:.1f} MiB on {world_size} ranks, for {res[0]['state'] / MiB:.0f} MiB of state on disk per rank "
           f"(bound {res[0]['bound'] / MiB:.0f} MiB)")
