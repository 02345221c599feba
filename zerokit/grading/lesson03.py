r"""Checks for lesson 03 (ZeRO-1): padded shards, and an Adam step on one shard per rank.

    check_shard_range(shard_range, world_size)   equal shards tiling ceil(numel/N)*N, nothing dropped
    check_numerics(cls, world_size, model)       weights after every step AND this rank's m, v shard
                                                 against torch.optim.AdamW on the whole batch
    check_unused_parameters(cls, world_size)     parameters without a gradient as AdamW treats them:
                                                 none on any rank -> left alone (no decay, m, v, step
                                                 count unchanged); on some ranks -> updated; a
                                                 gradient of zeros (sparse-embed) -> updated, decayed;
                                                 a step count per parameter
    check_memory(cls, world_size, model)         what the optimizer keeps alive per rank: ~8Ψ/N bytes
    check_traffic(cls, world_size, model)        per step one reduce-scatter and one all-gather
                                                 of Ψ (+padding), no all-reduce of the gradient
    check_param_groups(cls)                      the optional stretch: several param groups, each
                                                 with its own settings (try_stretch: the ungraded
                                                 cell's call, which prints ✓ or the reason, never raises)

Each class check answers one question, so one bug costs one check: the numbers (numerics),
the stage's memory promise (memory), the stage's traffic. An implementation
with the right numbers but full-size m and v passes the first and fails the second;
all-reduce-then-slice passes the first two and fails the third.

What the checks can and cannot see. The collectives are counted at PyTorch's dispatcher
(zerokit.CommCounter), whatever name the student's code called them by, so an all-reduce of
the full gradient is seen as one. Bytes on the wire could not tell it apart on gloo: gloo's
reduce-scatter sends as much as its all-reduce (lesson 00). Memory is counted by walking
every live tensor in the rank's process (Python's garbage collector) after a few steps and
keeping those that existed before the optimizer, are parameters or are gradients out; the
rest is what the optimizer holds, however it stores it (attributes, dicts, closures).
The reference (torch.optim.AdamW, foreach=False, one process, the whole batch) is computed in
a separate one-rank launch, since the checked ranks run with torch's Adam disabled.
"""

import gc

import torch
import torch.distributed as dist

from .. import zero1 as zerokit_zero1
from ..comm import CommCounter, reduce_scatter
from ..flat import padded_numel
from ..flat import shard_range as reference_shard_range
from ..models import build_model
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks
from .kit import try_stretch as run_stretch
from .kit import (ADAM_HYPER, adamw_reference, alias, assert_changed, batch_backward, build_optimizer, check_class,
                  gather_object, optimizer_held_bytes, psi_of, ranks_backward, refusing, trainable)

__all__ = ["check_shard_range", "check_numerics", "check_memory", "check_traffic", "check_unused_parameters"]

# the fixture matrix (kit.SITUATIONS): the hidden test that meets each situation, or why none can
_FLAT = "n/a: ZeRO-1 is an optimizer over one flat buffer; it sees parameters and .grad, never units or their outputs"
SITUATIONS = {
    "zero-grad-shard": "check_unused_parameters: sparse-embed",  # a rank's whole segment of gradient is zeros
    "frozen": "check_numerics: edge",
    "tied": "check_numerics: edge",
    "unused": "check_unused_parameters: edge",
    "sits-out": "check_unused_parameters: branch",  # the branch sits out step 2 on every rank: counts differ
    "n3": "check_numerics: world_size=3",
    "tuple-output": _FLAT,
    "root-params": _FLAT,
    "eval-no-grad": "n/a: MyZeRO1Adam acts only in step(); a forward under torch.no_grad never reaches it (no hooks)",
    "out-of-order": "n/a: step() reads every .grad after backward; no hook sees gradients arrive (that is lesson 04)",
    "subgroup": "n/a: the scaffold's MyZeRO1Adam takes no process group; every collective runs on the default group",
    "fp16-scale": "n/a: lesson 03 trains in fp32; the loss scale arrives with mixed precision in lesson 06",
    "zero3": "n/a: lesson 03's code is ZeRO-1 only; the stages 2 and 3 are lessons 04 and 05",
    "peak-memory": "n/a: lesson 03's memory rule is what the optimizer holds between steps (8Ψ/N, check_memory); it "
                   "states no rule for the peak inside step(), where every rank holds the full gradient anyway",
}

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4: every rank gets its own, equal slice
STREAM = 303  # this lesson's data
HYPER = ADAM_HYPER
STATE_RTOL = 1e-4
SCALARS_ALLOWANCE = 1024  # bytes of small bookkeeping tensors an optimizer may keep

# zerokit's own ZeRO-1 may not do the student's work inside a check (composition)
_USED = ("your optimizer used zerokit's ZeRO1Adam / ShardedAdamState: the exercise is to write the sharded step "
         "yourself")
NO_ZEROKIT_STAGE = [(zerokit_zero1.ZeRO1Adam, "__init__", _USED), (zerokit_zero1.ShardedAdamState, "__init__", _USED)]


# ---------------------------------------------------------------------------------------
# exercise (a): shard_range


def _pair(fn, numel, n, r):
    out = fn(numel, n, r)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise AssertionError(f"shard_range({numel}, {n}, {r}) returned {out!r}; expected a pair (start, end)")
    start, end = out
    for v in (start, end):
        if isinstance(v, bool) or not isinstance(v, int):
            raise AssertionError(f"shard_range({numel}, {n}, {r}) returned {out!r}; start and end must be Python ints")
    return start, end


def _validate_ranges(numel, n, ranges):
    """One line that says what is wrong with the ranges of all n ranks, or None."""
    call = f"shard_range({numel}, {n}, r) for r = 0..{n - 1}"
    sizes = [e - s for s, e in ranges]
    if any(size < 0 for size in sizes):
        return f"{call} gives {ranges}: a shard ends before it starts"
    if len(set(sizes)) != 1:
        return (f"{call} gives shards of sizes {sizes}: reduce-scatter and all-gather need equal shards, "
                "so pad the buffer instead of giving one rank the remainder")
    size = sizes[0]
    for r, (s, _) in enumerate(ranges):
        if s != r * size:
            return f"{call} gives {ranges}: rank {r} must start at r x shard size = {r * size}, so the shards tile the buffer"
    covered = ranges[-1][1]
    if covered < numel:
        return (f"{call} gives {ranges}: they cover elements [0, {covered}) of {numel}, so elements "
                f"{covered}..{numel - 1} belong to no rank. A shard size of numel // N = {numel // n} drops the "
                f"remainder; round up: ceil(numel / N) = {-(-numel // n)}")
    if size != -(-numel // n):
        return (f"{call} gives shards of {size} elements: {covered - numel} elements of padding, but the smallest "
                f"equal shards that hold {numel} elements are ceil({numel}/{n}) = {-(-numel // n)} (padding < N)")
    return None


def _shard_range_case(rank, world_size, fn, sizes, table_world_sizes):
    for numel in sizes:
        mine = _pair(fn, numel, world_size, rank)
        ranges = [None] * world_size
        dist.all_gather_object(ranges, mine)  # what every rank computed for itself
        problem = _validate_ranges(numel, world_size, [tuple(r) for r in ranges])
        if problem:
            raise AssertionError(problem)
        # the ranges must work for the collective they exist for: a reduce-scatter of the padded buffer
        start, end = mine
        size = end - start
        x = torch.zeros(size * world_size)
        x[:numel] = torch.arange(numel, dtype=torch.float32) + 1000 * rank
        shard = torch.empty(size)
        reduce_scatter(shard, x)
        expected = torch.zeros(size * world_size)
        expected[:numel] = world_size * torch.arange(numel, dtype=torch.float32) + 1000 * sum(range(world_size))
        assert_close(shard, expected[start:end], f"the reduce-scatter of a {numel}-element buffer cut by your ranges")
    if rank == 0:  # the rule for other world sizes, without launching them
        for n in table_world_sizes:
            for numel in sizes:
                problem = _validate_ranges(numel, n, [_pair(fn, numel, n, r) for r in range(n)])
                if problem:
                    raise AssertionError(problem)


def check_shard_range(shard_range, world_size=2, sizes=(8, 7, 1), table_world_sizes=(1, 3, 4), timeout=60.0):
    """Every rank's shard_range(numel, N, rank) tiles the buffer padded to ceil(numel/N)*N in equal shards."""
    __tracebackhide__ = True
    if not callable(shard_range):
        raise CheckFailed(f"expected the function shard_range, got {type(shard_range).__name__}")
    run_on_ranks(_shard_range_case, world_size, args=(shard_range, list(sizes), list(table_world_sizes)),
                 timeout=timeout, what="shard_range")
    passed(f"shard_range gives equal, padded shards that tile ceil(numel/N)*N for numel in {list(sizes)} "
           f"on {world_size} real ranks (and N in {list(table_world_sizes)})")


# ---------------------------------------------------------------------------------------
# the optimizer class: shared pieces


def _check_class(cls):
    check_class(cls, "your optimizer class",
                refuse=[(zerokit_zero1.ZeRO1Adam, "the exercise is to write ZeRO-1 yourself (subclass "
                         "torch.optim.Optimizer, as the scaffold does)")])


def _train_step(name, model, opt, step, rank, world_size):
    batch_backward(model, step, name, GLOBAL_BATCH, STREAM, rank, world_size)
    opt.step()
    opt.zero_grad()


def _flat_state(record, key, model):
    """AdamW's m or v of every trainable parameter, laid end to end (zeros where it has none)."""
    return torch.cat([record[key][n].reshape(-1) if n in record[key] else torch.zeros(p.numel())
                      for n, p in trainable(model)])


# ---------------------------------------------------------------------------------------
# numerics: weights and optimizer-state slices against torch.optim.AdamW


def _own_state(opt, attr, psi, world_size, rank):
    """This rank's shard of m or v as the student's optimizer holds it."""
    t = getattr(opt, attr, None)
    if t is None:
        raise AssertionError(f"your optimizer has no attribute {attr}: keep the scaffold's names "
                             "(self.exp_avg and self.exp_avg_sq hold this rank's shard of m and v)")
    if not isinstance(t, torch.Tensor):
        raise AssertionError(f"self.{attr} is a {type(t).__name__}, not a tensor")
    t = t.detach().reshape(-1)
    start, end = reference_shard_range(psi, world_size, rank)
    size = end - start
    if t.numel() == size:
        return t
    if t.numel() in (psi, padded_numel(psi, world_size)):
        # a full-size copy: its numbers are judged here, its size by check_zero1_memory
        full = torch.zeros(padded_numel(psi, world_size), dtype=t.dtype, device=t.device)
        full[:t.numel()] = t[:padded_numel(psi, world_size)]
        return full[start:end]
    raise AssertionError(f"self.{attr} has {t.numel()} elements; this rank's shard has "
                         f"ceil(Ψ/N) = ceil({psi}/{world_size}) = {size}")


def _numerics_case(rank, world_size, cls, name, steps, weight_decay, reference):
    with refusing(*NO_ZEROKIT_STAGE):
        model = build_model(name)
        psi = psi_of(model)
        start, end = reference_shard_range(psi, world_size, rank)
        pad = padded_numel(psi, world_size) - psi
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        opt = build_optimizer(cls, model.parameters(), weight_decay=weight_decay, **HYPER)

        def flat_weights():
            named = dict(model.named_parameters())
            return torch.cat([named[n].detach().reshape(-1) for n in trainable]).clone()

        prev = {"exp_avg": torch.zeros(end - start), "exp_avg_sq": torch.zeros(end - start)}  # AdamW's, last step
        for step in range(steps):
            before = flat_weights()
            _train_step(name, model, opt, step, rank, world_size)
            record = reference[step]
            ref_params, ref_m, ref_v = record["params"], _flat_state(record, "exp_avg", model), \
                _flat_state(record, "exp_avg_sq", model)
            after = f"after step {step + 1}"
            # the state first: it names the cause (a sum for a mean, state that does not persist)
            # where the weights would only say "differs"
            state = {}
            for attr, ref, what in (("exp_avg", ref_m, "m"), ("exp_avg_sq", ref_v, "v")):
                expected = torch.cat([ref, torch.zeros(pad)])[start:end]
                mine = _own_state(opt, attr, psi, world_size, rank)
                scale = float(expected.abs().max()) if expected.numel() else 0.0
                try:
                    assert_close(mine, expected, f"{what} (self.{attr}, this rank's shard) {after}",
                                 atol=1e-5 * scale + 1e-12, rtol=STATE_RTOL)
                except AssertionError as exc:
                    cause = _state_cause(f"{what} (self.{attr}, this rank's shard) {after}", attr, mine, expected,
                                         prev[attr], world_size)
                    raise AssertionError(f"{cause}\n  {exc}") from None
                state[attr] = expected
            prev = state
            now = flat_weights()
            mask = torch.ones(psi, dtype=torch.bool)
            mask[start:min(end, psi)] = False
            if step == 0 and bool(mask.any()) and torch.equal(now[mask], before[mask]):
                raise AssertionError(
                    f"{after} only this rank's own shard of the parameters (elements {start}..{min(end, psi) - 1}) "
                    "changed; the rest still holds the old weights: every rank must receive every updated shard "
                    "(an all-gather into the flat parameter buffer)")
            named = dict(model.named_parameters())
            for n in ref_params:
                try:
                    assert_close(named[n].detach(), ref_params[n], f"parameter {n} {after}")
                except AssertionError as exc:
                    t = _step_count_used(before[start:min(end, psi)], now[start:min(end, psi)], state, step,
                                         opt.param_groups[0] if opt.param_groups else {}, weight_decay)
                    cause = (f"parameter {n} {after}: m and v of your shard are right, but the update used the step "
                             f"count t = {t} in the bias correction, and AdamW's is {step + 1}: count the steps "
                             "(+1 per step() that updates the parameter) and pass that count to adamw_update_"
                             if t is not None else
                             f"parameter {n} {after} differs, though m and v of your shard are right: the gradient "
                             "and the state are, so look at the update itself (the step count t of the bias "
                             "correction, lr, weight decay)")
                    raise AssertionError(f"{cause}\n  {exc}") from None
    return psi


def _state_cause(what, attr, mine, expected, previous, world_size):
    """Why this rank's m or v differs from AdamW's, where its numbers say it (the first line of the reason)."""
    beta = HYPER["betas"][0 if attr == "exp_avg" else 1]
    power = 1 if attr == "exp_avg" else 2  # v squares the gradient
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-3, atol=1e-6 * float(b.abs().max()) + 1e-12))  # noqa: E731
    if world_size > 1 and close(mine, world_size ** power * expected):
        return (f"{what} is {world_size ** power} x AdamW's ({'N²' if power == 2 else 'N'}, N = {world_size}): "
                "the reduce-scatter summed the ranks' gradients; the loss is a mean over the whole "
                "batch, so average them (ReduceOp.AVG)")
    if not bool(mine.abs().max() > 0) and bool(expected.abs().max() > 0):
        return (f"{what} is still all zeros: your update changed a copy or a local name, not self.{attr} (`m = "
                f"beta * m + ...` rebinds a name and leaves the stored state behind). Update self.{attr} in place "
                "(mul_, add_, addcmul_, or adamw_update_ on a view of it)")
    if bool(previous.abs().max() > 0) and close(mine, expected - beta * previous):
        return (f"{what} holds only this step's gradient: m and v do not persist from step to step. Update "
                f"self.{attr} in place (mul_, add_, addcmul_, or adamw_update_ on a view of it); `m = beta * m + ...` "
                "or an update of a copy leaves the stored state behind")
    return (f"{what} differs from AdamW's (a wrong m or v can hide behind right weights for a while: Adam's step "
            "hardly depends on the gradient's scale. Is the reduce-scatter an average, ReduceOp.AVG? Do m and v "
            "persist from step to step, updated in place?)")


def _step_count_used(before, after, state, step, group, weight_decay, candidates=8):
    """The step count t that AdamW's update from `before`, with this step's (right) m and v, needs to
    give `after` on this rank's shard, if one other than step + 1 does; else None."""
    lr, eps = HYPER["lr"], HYPER["eps"]
    beta1, beta2 = HYPER["betas"]
    m, v = state["exp_avg"][:before.numel()].double(), state["exp_avg_sq"][:before.numel()].double()
    if not before.numel():
        return None
    for t in range(1, step + 1 + candidates):
        if t == step + 1:
            continue
        guess = before.double() * (1 - lr * weight_decay) - lr / (1 - beta1 ** t) * m / (
            v.sqrt() / (1 - beta2 ** t) ** 0.5 + eps)
        if bool(torch.allclose(after.double(), guess, rtol=1e-5, atol=1e-6)):
            return t
    return None


def check_numerics(cls, world_size=2, model="small-mlp", steps=4, weight_decay=0.01, timeout=60.0):
    """cls on world_size ranks, each on its own slice of the batch, matches torch.optim.AdamW on the
    whole batch in one process: every parameter after every step, and this rank's shard of m and v."""
    __tracebackhide__ = True
    _check_class(cls)
    reference = adamw_reference(model, steps, {**HYPER, "weight_decay": weight_decay}, batch_backward,
                                (model, GLOBAL_BATCH, STREAM), timeout=timeout)
    psi = run_on_ranks(_numerics_case, world_size, args=(cls, model, steps, weight_decay, reference),
                       timeout=timeout, what=cls.__name__)[0]
    passed(f"{cls.__name__} matches torch.optim.AdamW on {world_size} ranks ({model}, Ψ = {psi}, weight decay "
           f"{weight_decay:g}): every parameter and this rank's m, v shard after each of {steps} steps")


# ---------------------------------------------------------------------------------------
# memory: what the optimizer keeps alive per rank


def _attribute_tensors(opt):
    """[(how to find it, numel, storage key)] for every tensor the optimizer's attributes reach
    (one level into lists, tuples and dicts, and its `state`), first name per storage."""
    found, seen = [], set()

    def add(label, t):
        if isinstance(t, torch.Tensor) and not t.is_meta:
            key = (t.device.type, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                found.append((label, t.untyped_storage().nbytes() // max(t.element_size(), 1), key))

    for attr, value in vars(opt).items():
        if attr in ("param_groups", "defaults"):
            continue
        if attr == "state":
            for i, st in enumerate(value.values()):
                for k, t in (st.items() if isinstance(st, dict) else ()):
                    add(f"self.state[<parameter {i}>][{k!r}]", t)
            continue
        add(f"self.{attr}", value)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) \
            else ()
        for k, t in items:
            add(f"self.{attr}[{k!r}]", t)
    return found


def _memory_case(rank, world_size, cls, name, steps, weight_decay):
    # The worker was forked from a process that has run no tensor operation: no tensor is alive
    # yet. Freezing moves the ~300k objects alive now into the collector's permanent generation,
    # which gc.collect() and gc.get_objects() skip, so the scans below see only what this
    # check creates (a full scan would cost about a second per rank).
    gc.freeze()
    built = []
    try:
        with refusing(*NO_ZEROKIT_STAGE):
            model = build_model(name)
            psi = psi_of(model)
            # one forward and backward first: whatever torch creates lazily exists before we count
            batch_backward(model, 0, name, GLOBAL_BATCH, STREAM, rank, world_size)
            for p in model.parameters():
                p.grad = None
            initial = [p.detach().clone() for p in model.parameters()]

            def run_steps(model):
                opt = build_optimizer(cls, model.parameters(), weight_decay=weight_decay, **HYPER)
                built.append(opt)
                for step in range(steps):
                    _train_step(name, model, opt, step, rank, world_size)
                return opt

            held_bytes, held = optimizer_held_bytes(model, run_steps)
            assert_changed(model, initial)
            # what the held tensors are, where the optimizer's attributes name them
            model_storages = {(p.device.type, p.untyped_storage().data_ptr()) for p in model.parameters()}
            named = [(label, numel) for label, numel, key in _attribute_tensors(built[0]) if key not in model_storages]
            built.clear()
    finally:
        gc.unfreeze()
    return held_bytes, held, psi, -(-psi // world_size), named


def check_memory(cls, world_size=4, model="wide-mlp", steps=2, weight_decay=0.01, timeout=60.0):
    """Between steps each rank's optimizer holds m and v for its shard, 8 x ceil(Ψ/N) bytes (fp32),
    plus at most one more shard-sized buffer and a few scalars: not a full copy of anything."""
    __tracebackhide__ = True
    _check_class(cls)
    if world_size < 3:
        raise ValueError("use world_size >= 3: at N = 2 one full-size tensor weighs as much as two shards")
    results = run_on_ranks(_memory_case, world_size, args=(cls, model, steps, weight_decay),
                           timeout=timeout, what=cls.__name__)
    for rank, (held_bytes, held, psi, shard, named) in enumerate(results):
        expected = 8 * shard
        limit = expected + 4 * shard + SCALARS_ALLOWANCE
        if held_bytes > limit:
            raise CheckFailed(f"[rank {rank}] your optimizer keeps {held_bytes} B of tensors alive between steps; "
                              f"ZeRO-1 needs m and v for this rank's shard only: 2 x 4 B x ceil(Ψ/N) = 2 x 4 x "
                              f"{shard} = {expected} B (limit {limit} B). " + _what_is_held(held, named, psi, shard))
    held_bytes, _, psi, shard, _ = results[0]
    passed(f"optimizer state per rank on {world_size} ranks: {held_bytes} B = 8 x ceil(Ψ/N) = 8 x {shard} "
           f"(Ψ = {psi}); unsharded m and v would be {8 * psi} B")


def _what_is_held(held, named, psi, shard):
    """The diagnosis: which of the held tensors are too big, by the attribute that holds them."""
    mv = {label: numel for label, numel in named if label in ("self.exp_avg", "self.exp_avg_sq")}
    big = [(label, numel) for label, numel in named if numel > shard and label not in mv]
    full_mv = {label: numel for label, numel in mv.items() if numel > shard}
    if full_mv:
        numel = max(full_mv.values())
        size = "as large as the whole model" if numel >= psi else f"more than this rank's shard ({shard})"
        return (f"{' and '.join(full_mv)} {'have' if len(full_mv) > 1 else 'has'} {numel} elements, {size} "
                f"(Ψ = {psi}): a full copy of m and v on every rank is exactly what ZeRO-1 removes. Allocate m and "
                "v with the shard's size.")
    biggest = ", ".join(f"{numel} elements ({nbytes} B)" for nbytes, numel in held[:4])
    if big:
        what = "; ".join(f"{label}: {numel} elements" + (", as large as the whole model" if numel >= psi else "")
                         for label, numel in big[:3])
        shard_sized = " (m and v are shard-sized, as they should be)" if mv else ""
        return (f"Besides m and v{shard_sized}, your optimizer keeps {what} between steps: a buffer needed only "
                "inside step() (the flat gradient, say) should be a local variable, not an attribute.")
    full = [numel for _, numel in held if numel >= psi]
    why = (f"{len(full)} of them as large as the whole model (Ψ = {psi} elements), and not held by an attribute of "
           "the optimizer (a closure, a hook, a global?): a full copy on every rank is what ZeRO-1 removes"
           if full else "more than this rank's shard needs")
    return f"Largest: {biggest}; {why}."


# ---------------------------------------------------------------------------------------
# collectives: what one step sends


def _comm_case(rank, world_size, cls, name, steps, weight_decay):
    with refusing(*NO_ZEROKIT_STAGE):
        model = build_model(name)
        psi = psi_of(model)
        initial = [p.detach().clone() for p in model.parameters()]
        opt = build_optimizer(cls, model.parameters(), weight_decay=weight_decay, **HYPER)
        per_step = []
        for step in range(steps):
            batch_backward(model, step, name, GLOBAL_BATCH, STREAM, rank, world_size)
            with CommCounter() as comm:
                opt.step()
            opt.zero_grad()
            per_step.append([(c.op, c.numel) for c in comm.calls])
        assert_changed(model, initial)
    n = world_size
    for step, calls in enumerate(per_step):
        ops = {}
        for op, numel in calls:
            ops.setdefault(op, []).append(numel)
        when = f"in step {step + 1}, step() called {', '.join(f'{op} x{len(v)}' for op, v in ops.items()) or 'no collective'}"
        big_reduce = sum(ops.get("all_reduce", []))
        if big_reduce > 64:
            raise AssertionError(
                f"{when}: it all-reduced {big_reduce} elements (Ψ = {psi}). ZeRO-1 reduce-scatters the gradient, so "
                "each rank receives only the mean of its own shard: all-reduce-then-slice gets the same numbers "
                "but moves 2Ψ for the gradient + Ψ for the all-gather = 3Ψ per step, 1.5x data parallel's 2Ψ")
        for op, what in (("reduce_scatter", "the gradient"), ("all_gather", "the updated parameters")):
            sizes = ops.get(op, [])
            if not sizes:
                raise AssertionError(f"{when}: no {op.replace('_', '-')} of {what} (ZeRO-1: reduce-scatter the "
                                     "gradient, Adam on your shard, all-gather the parameters)")
            if not psi <= sum(sizes) <= psi + (n - 1) * len(sizes):
                raise AssertionError(f"{when}: its {op.replace('_', '-')} calls moved {sum(sizes)} elements; "
                                     f"expected Ψ = {psi} (+ at most {n - 1} of padding) once per step")
        other = {op: sum(v) for op, v in ops.items() if op not in ("reduce_scatter", "all_gather", "all_reduce")}
        if sum(other.values()) > 64:
            raise AssertionError(f"{when}: {other} elements besides the reduce-scatter and the all-gather; "
                                 "ZeRO-1 needs nothing else")
    return psi, per_step[-1]


def check_traffic(cls, world_size=2, model="small-mlp", steps=2, weight_decay=0.01, timeout=60.0):
    """Each step: one reduce-scatter of the gradient (Ψ) and one all-gather of the parameters (Ψ),
    2Ψ like data parallel, and no all-reduce of the gradient."""
    __tracebackhide__ = True
    _check_class(cls)
    psi, calls = run_on_ranks(_comm_case, world_size, args=(cls, model, steps, weight_decay),
                              timeout=timeout, what=cls.__name__)[0]
    moved = {op: sum(numel for o, numel in calls if o == op) for op in ("reduce_scatter", "all_gather", "all_reduce")}
    rs, ag, flags = moved["reduce_scatter"], moved["all_gather"], moved["all_reduce"]
    # what is added up is volume (elements moved in the ring model, zerokit.comm): a reduce-scatter or an
    # all-gather of n elements moves n, an all-reduce of n moves 2n; each call is named by its elements
    extra = (f"; besides, an all-reduce of {flags} flags (one per parameter: which got a gradient on any rank), "
             f"volume 2 x {flags} = {2 * flags}: {rs + ag + 2 * flags} in all" if flags else "")
    passed(f"per step on {world_size} ranks: a reduce-scatter of {rs} and an all-gather of {ag} elements, volume "
           f"{rs} + {ag} = {rs + ag} ≈ 2Ψ (Ψ = {psi}, plus the padding), no all-reduce of the gradient{extra}")


# ---------------------------------------------------------------------------------------
# parameters without a gradient: AdamW leaves them alone


def _stuck(before, after, expected):
    """The elements AdamW moved (by more than rounding could hide) that the student's step left exactly as
    they were: a skipped update, whatever the tolerance of the comparison."""
    return (after == before) & ((expected - before).abs() > 1e-7 + 1e-5 * before.abs())


def _unused_hint(name, step, history, world_size, before, after, expected, mean_grad, weight_decay):
    """The cause of a wrong parameter after `step`, where the presence of its gradient explains it.
    mean_grad: AdamW's gradient of this step (the mean over the ranks), None where no rank had one."""
    when = f"step {step + 1}"
    had = history[step][name]
    if not had:
        return (f"{when}: {name} had no gradient on any rank, so AdamW leaves it alone (no weight decay, m and v "
                "unchanged, no step counted), but your step changed it: skip every parameter that no rank has a "
                "gradient for")
    stuck = _stuck(before, after, expected).reshape(-1)
    zero = mean_grad is not None and bool(stuck.any()) and not bool(mean_grad.reshape(-1)[stuck].any())
    if len(had) == world_size and zero:
        where = stuck.nonzero().reshape(-1)
        return (f"{when}: {name} had a gradient on every rank (a tensor, not None), whose mean is exactly 0 in "
                f"{int((mean_grad == 0).sum())} of its {mean_grad.numel()} elements, and your step left "
                f"{where.numel()} of those (elements {int(where[0])}..{int(where[-1])}) exactly as they were, as "
                "if they had no gradient: a segment whose gradient is all zeros was skipped. Zero is a gradient: "
                "AdamW still updates those elements (weight decay multiplies them by 1 - lr x weight_decay = "
                f"{1 - HYPER['lr'] * weight_decay:g} each step, m and v decay, the step count advances). Skip "
                "only a parameter that no rank has a gradient for (the all-reduced flags), never a segment "
                "because its gradient is zero")
    if len(had) < world_size and bool(((after == before) & (expected != before)).any()):
        return (f"{when}: {name} had a gradient on rank(s) {', '.join(map(str, had))} of {world_size} only, and some "
                "of its elements were not updated: it must still be updated (the other ranks add zeros to the "
                "mean). Decide what to skip from every rank's gradients together (one tiny all-reduce of a flag "
                "per parameter), not from this rank's .grad")
    skipped = [t + 1 for t in range(step) if not history[t][name]]
    if skipped:
        count = step + 1 - len(skipped)
        return (f"{when}: {name} had no gradient in step {', '.join(map(str, skipped))}, so AdamW has counted "
                f"{count} steps for it, not {step + 1}: the bias correction 1 - β^t needs a step count per "
                "parameter")
    return f"{when}: {name} differs from torch.optim.AdamW's"


# The weights of parameters with a gradient are compared at a tolerance of about 1e-4: what this
# check is about moves a weight by a large part of a step (lr = 1e-2): a skipped update, a wrong
# step count in the bias correction (14% of a step). A gradient of the wrong scale moves it by
# ~1e-5 (Adam divides the scale out) and is check_numerics' business, as is m and v's scale.
UNUSED_ATOL, UNUSED_RTOL = 2e-4, 1e-3


def _unused_case(rank, world_size, cls, name, steps, weight_decay, reference):
    with refusing(*NO_ZEROKIT_STAGE):
        model = build_model(name)
        psi = psi_of(model)
        start, end = reference_shard_range(psi, world_size, rank)
        named = trainable(model)
        where, offset = {}, 0  # parameter name -> its elements in this rank's shard of m and v
        for n, p in named:
            lo, hi = max(offset, start), min(offset + p.numel(), end)
            if lo < hi:
                where[n] = (lo - start, hi - start)
            offset += p.numel()
        opt = build_optimizer(cls, model.parameters(), weight_decay=weight_decay, **HYPER)
        history = []  # per step: {parameter name: the ranks that had a gradient for it}
        for step in range(steps):
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            ranks_backward(model, step, name, GLOBAL_BATCH, STREAM, world_size, rank)
            mine = {n: p.grad is not None for n, p in named}
            everyone = gather_object(mine)
            history.append({n: [r for r in range(world_size) if everyone[r][n]] for n, _ in named})
            state_before = {attr: _own_state(opt, attr, psi, world_size, rank).clone() if step else None
                            for attr in ("exp_avg", "exp_avg_sq")}
            opt.step()
            opt.zero_grad()
            record = reference[step]
            for n, p in model.named_parameters():
                now, want = p.detach(), record["params"][n]
                if n in history[step] and not history[step][n]:
                    wrong = not torch.equal(now, before[n])  # AdamW leaves it exactly as it was
                else:  # an element left exactly as it was is a skipped update, however small AdamW's
                    wrong = not torch.allclose(now, want, atol=UNUSED_ATOL, rtol=UNUSED_RTOL) or \
                        bool(_stuck(before[n], now, want).any())
                if wrong:
                    cause = _unused_hint(n, step, history, world_size, before[n], now, want,
                                         record["grads"].get(n), weight_decay)
                    diff = float((now - want).abs().max())
                    raise AssertionError(f"{cause}\n  parameter {n} after step {step + 1}: max |difference| to "
                                         f"torch.optim.AdamW {diff:.3g}")
            for attr, what in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                if state_before[attr] is None:
                    continue
                now = _own_state(opt, attr, psi, world_size, rank)
                for n, (lo, hi) in where.items():
                    if not history[step][n] and not torch.equal(now[lo:hi], state_before[attr][lo:hi]):
                        raise AssertionError(
                            f"step {step + 1}: {n} had no gradient on any rank, so AdamW leaves its {what} as it "
                            f"was, but your step changed self.{attr} there: skip every parameter that no rank has "
                            "a gradient for, its moments too")
    return True


def _unused_cases(rank, world_size, cls, names, steps, weight_decay, references):
    for name, reference in zip(names, references):
        try:
            _unused_case(rank, world_size, cls, name, steps, weight_decay, reference)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    return True


def check_unused_parameters(cls, world_size=2, models=("edge", "branch", "sparse-embed"), weight_decay=0.1, steps=4,
                            timeout=60.0):
    """Parameters without a gradient, as torch.optim.AdamW treats them: one that no rank has a gradient
    for is left alone (no weight decay, m and v unchanged, no step counted); one that some ranks have
    a gradient for is updated with the mean. "edge" has a layer that is never used; on "branch" the
    ranks run a branch in turn: all of them, none, all, even ranks only; on "sparse-embed" a rank's
    whole segment of the embedding has a gradient of zeros, which is a gradient: with weight decay,
    an element left exactly as it was is a skipped update (an optimizer that skips by the values)."""
    __tracebackhide__ = True
    _check_class(cls)
    hyper = {**HYPER, "weight_decay": weight_decay}
    references = [adamw_reference(name, steps, hyper, ranks_backward, (name, GLOBAL_BATCH, STREAM, world_size),
                                  timeout=timeout)
                  for name in models]
    # one launch for every model: the ranks start once
    run_on_ranks(_unused_cases, world_size, args=(cls, list(models), steps, weight_decay, references),
                 timeout=timeout, what=f"{cls.__name__} on {', '.join(models)}")
    passed(f"{cls.__name__} treats parameters without a gradient as torch.optim.AdamW does on {world_size} ranks "
           f"({', '.join(models)}, weight decay {weight_decay:g}): weights and this rank's m, v shard after each of "
           f"{steps} steps")


# ---------------------------------------------------------------------------------------
# the stretch exercise: several param groups (checked when attempted, worth no points)

# edge's parameters in two groups: the second holds the never-used layer, with weight decay
GROUPS = ({"prefixes": ("embed", "block"), "lr": 1e-2, "weight_decay": 0.1},
          {"prefixes": None, "lr": 3e-3, "weight_decay": 0.05, "betas": (0.8, 0.99)})


def _grouped(model):
    """The model's parameters (frozen ones too) in GROUPS, as param-group dicts."""
    first = [p for n, p in model.named_parameters() if n.startswith(GROUPS[0]["prefixes"])]
    rest = [p for n, p in model.named_parameters() if not n.startswith(GROUPS[0]["prefixes"])]
    return [{"params": ps, **{k: v for k, v in g.items() if k != "prefixes"}} for ps, g in zip((first, rest), GROUPS)]


def _groups_reference_case(_rank, _world_size, name, steps):
    net = build_model(name)
    opt = torch.optim.AdamW(_grouped(net), foreach=False, **HYPER)
    out = []
    for step in range(steps):
        batch_backward(net, step, name, GLOBAL_BATCH, STREAM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return out


def _groups_case(rank, world_size, cls, name, steps, reference):
    with refusing(*NO_ZEROKIT_STAGE):
        model = build_model(name)
        opt = build_optimizer(cls, _grouped(model), **HYPER)
        group_of = {n: 0 if n.startswith(GROUPS[0]["prefixes"]) else 1 for n, _ in model.named_parameters()}
        for step in range(steps):
            _train_step(name, model, opt, step, rank, world_size)
            for n, p in model.named_parameters():
                g = GROUPS[group_of[n]]
                try:
                    assert_close(p.detach(), reference[step][n], f"parameter {n} after step {step + 1}")
                except AssertionError as exc:
                    raise AssertionError(
                        f"step {step + 1}: {n} (group {group_of[n]}: lr {g['lr']:g}, weight decay "
                        f"{g['weight_decay']:g}{', betas ' + str(g['betas']) if 'betas' in g else ''}) differs from "
                        f"torch.optim.AdamW with the same groups: each parameter is updated with its own group's "
                        f"settings\n  {exc}") from None
    return True


def check_param_groups(cls, world_size=2, model="edge", steps=3, timeout=60.0):
    """The stretch: two param groups with different lr, weight decay and betas (the second holding a
    never-used layer), every weight after every step as torch.optim.AdamW with the same groups."""
    __tracebackhide__ = True
    _check_class(cls)
    reference = run_on_ranks(_groups_reference_case, 1, args=(model, steps), timeout=timeout, forbid_adam=False,
                             what="the reference (torch.optim.AdamW with two groups)")[0]
    run_on_ranks(_groups_case, world_size, args=(cls, model, steps, reference), timeout=timeout,
                 what=f"{cls.__name__} with two param groups")
    passed(f"{cls.__name__} matches torch.optim.AdamW with two param groups on {world_size} ranks ({model}): "
           f"every parameter after each of {steps} steps")


def try_stretch(cls, name="MyZeRO1AdamGroups"):
    """The stretch's cell: check_param_groups(cls) if the student defined it, ✓ or the reason printed."""
    return run_stretch(check_param_groups, cls, name)


check_zero1_numerics = alias(check_numerics, "check_zero1_numerics")
check_zero1_memory = alias(check_memory, "check_zero1_memory")
check_zero1_collectives = alias(check_traffic, "check_zero1_collectives")
