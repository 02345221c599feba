r"""Checks for lesson 02 (data parallel Adam): the mean gradient, and replicas that stay equal.

    check_average_gradients(fn, world_size, model)  every rank's .grad after fn(params) is the gradient
                                                    of the whole batch (the mean, not the sum); a
                                                    parameter no rank used keeps .grad None; fn
                                                    all-reduces about Ψ elements and nothing else
    check_numerics(cls, world_size, model)          replicas start from rank 0's weights (frozen ones
                                                    too), stay bitwise equal, and match
                                                    torch.optim.AdamW on the whole batch after every
                                                    step (weights, and m, v)
    check_traffic(cls, world_size, model)           per step: all-reduces of Ψ elements in all (one
                                                    flat buffer or one per parameter), no broadcast
                                                    or all-gather of the parameters

One bug costs one check. The class checks run the student's class with a reference
`average_gradients` in place of the student's function of exercise (a) (the name is
swapped in the globals the class's methods see), so a wrong mean costs exercise (a)'s
points only; a class that averages inline, without the function, is judged as written.
The reference is the exercise's own contract (one flat all-reduce of the gradients that
exist, divided by N), so a right class moves exactly the gradient's elements per step.

Ψ is the number of trainable elements, as lesson 01 counts it, in every message; where some
parameters get no gradient (edge's `unused`), the messages say how many elements do.

The reference (torch.optim.AdamW, foreach=False, one process, the whole batch) runs in a
separate one-rank launch, since the checked ranks run with torch's Adam disabled.
"""

import inspect

import torch
import torch.distributed as dist

from .. import ddp as zerokit_ddp
from ..comm import CommCounter
from ..models import build_model
from .compare import assert_close, max_abs_diff
from .harness import CheckFailed, passed, run_on_ranks
from .kit import (ADAM_HYPER, adamw_reference, alias, batch_backward, build_optimizer, check_class, psi_of, refusing,
                  trainable)

__all__ = ["check_average_gradients", "check_numerics", "check_traffic"]

# the fixture matrix (kit.SITUATIONS): the hidden test that meets each situation, or why none can
_NO_UNITS = "n/a: data parallel Adam sees parameters and .grad after backward, never units or their outputs"
SITUATIONS = {
    "frozen": "check_numerics: edge",  # frozen weights differ per rank until the broadcast
    "tied": "check_numerics: edge",
    "unused": "check_average_gradients: edge",  # .grad None must stay None
    "n3": "check_numerics: world_size=3",
    "tuple-output": _NO_UNITS,
    "root-params": _NO_UNITS,
    "eval-no-grad": "n/a: the optimizer acts only in step(); a forward under torch.no_grad never reaches it (no hooks)",
    "out-of-order": "n/a: average_gradients runs after backward on every .grad at once; no hook sees gradients arrive",
    "zero-grad-shard": "n/a: no shards; every rank reduces whole gradients, and a gradient of zeros is averaged and "
                       "stepped like any other by lesson 01's Adam",
    "sits-out": "n/a: the per-parameter step counts are lesson 01's Adam, inherited unchanged; and the contract has a "
                "parameter without a gradient on no rank at all (a branch some ranks skip is zerokit.ddp's case)",
    "subgroup": "n/a: the exercise's signatures take no process group; every collective runs on the default group",
    "fp16-scale": "n/a: lesson 02 trains in fp32; the loss scale arrives with mixed precision in lesson 06",
    "zero3": "n/a: lesson 02 is data parallel; the ZeRO stages start in lesson 03",
    "peak-memory": "n/a: lesson 02 states no memory rule for the student's code: every rank holds all 16Ψ bytes, "
                   "measured in section 5, not graded",
}

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4: every rank gets its own, equal slice
STREAM = 202  # this lesson's data
HYPER = ADAM_HYPER
SMALL = 64  # elements of bookkeeping (counts, flags) a step may communicate besides the gradient

_WRITE_IT = "the exercise is to write them yourself"
# zerokit's own data parallel code may not do the student's work inside a check
NO_ZEROKIT_DDP = [(zerokit_ddp.DistributedAdam, "__init__", f"your code used zerokit's DistributedAdam: {_WRITE_IT}"),
                  (zerokit_ddp, "average_gradients", f"your code used zerokit's average_gradients: {_WRITE_IT}"),
                  (zerokit_ddp, "broadcast_parameters", f"your code used zerokit's broadcast_parameters: {_WRITE_IT}")]


def _used_numel(model):
    """Ψ as the gradient sees it: trainable parameters that get a gradient from the batch."""
    return sum(p.numel() for _, p in trainable(model) if p.grad is not None)


def _refuse_zerokit_function(fn):
    if fn is zerokit_ddp.average_gradients:
        raise CheckFailed("average_gradients is zerokit.ddp.average_gradients itself: the exercise is to write "
                          "it yourself")


# ---------------------------------------------------------------------------------------
# exercise (a): average_gradients


def _psi_words(psi, with_grad):
    """'Ψ = 1267', or 'Ψ = 745, of which 706 get a gradient' where some parameters get none."""
    return f"Ψ = {psi}" if with_grad == psi else f"Ψ = {psi}, of which {with_grad} get a gradient"


def _psi_elements(psi, with_grad):
    """'Ψ = 1267 elements', or 'Ψ's 706 elements that have a gradient (Ψ = 745)'."""
    return f"Ψ = {psi} elements" if with_grad == psi else f"Ψ's {with_grad} elements that have a gradient (Ψ = {psi})"


def _describe_wrong_mean(mine, expected, local, world_size):
    """Why a rank's averaged gradient is wrong, in one sentence, or ''."""
    ratio = float((mine.double() * expected.double()).sum() / (expected.double() ** 2).sum().clamp_min(1e-300))
    if expected.abs().max() > 0 and abs(ratio - world_size) < 1e-3 * world_size:
        return (f" It is {world_size} x the mean: the ranks' gradients were summed (all-reduce's default, "
                f"ReduceOp.SUM) but not divided by N = {world_size}. The loss is a mean over the whole batch, so "
                "its gradient is the mean of the ranks' gradients: divide by N, or use ReduceOp.AVG.")
    if expected.abs().max() > 0 and abs(ratio * world_size - 1) < 1e-3:
        return (f" It is 1/{world_size} of the mean: the ranks' gradients were averaged twice (divided by N = "
                f"{world_size} twice: ReduceOp.AVG already divides by N, so a division after it is one too many). "
                "The loss is a mean over the whole batch, so its gradient is the mean of the ranks' gradients: "
                "divide once, or use ReduceOp.AVG alone.")
    if local is not None and max_abs_diff(mine, local) <= 1e-7 * (1 + float(local.abs().max())):
        return (" It is still this rank's own micro-batch gradient: the mean never reached .grad (no "
                "all-reduce, or one whose result was not copied back: dist.all_reduce works in place, on the "
                "tensor you pass it).")
    return ""


def _average_case(rank, world_size, fn, name):
    with refusing(*NO_ZEROKIT_DDP):
        model = build_model(name)
        params = list(model.parameters())
        batch_backward(model, 0, name, GLOBAL_BATCH, STREAM)  # the whole batch on one process: the gradient
        expected = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        batch_backward(model, 0, name, GLOBAL_BATCH, STREAM, rank, world_size)  # this rank's micro-batch
        local = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        psi, with_grad = psi_of(model), _used_numel(model)
        with CommCounter() as comm:
            fn(params)
        for n, p in model.named_parameters():
            if expected[n] is None:
                if p.grad is not None:
                    why = "it is frozen, requires_grad=False" if not p.requires_grad else "the forward never uses it"
                    what = "zeros" if not bool(p.grad.any()) else "elements"
                    raise AssertionError(
                        f"parameter {n} has no gradient on any rank ({why}), but after your function its .grad is "
                        f"a tensor of {p.grad.numel()} {what}: a missing gradient was turned into one. "
                        "Leave it None, as one process training on the whole batch would: Adam skips a parameter "
                        "whose .grad is None, while a zero gradient still moves it (weight decay, and m and v "
                        "from earlier steps) and counts a step for it.")
                continue
            if p.grad is None:
                raise AssertionError(f"after your function parameter {n} has .grad None; expected the mean "
                                     "gradient (write it into p.grad)")
            try:
                assert_close(p.grad, expected[n], f"the averaged gradient of {n}", atol=1e-6, rtol=1e-4)
            except AssertionError as exc:
                raise AssertionError(f"{exc}.{_describe_wrong_mean(p.grad, expected[n], local[n], world_size)}") \
                    from None
    ops = {}
    for c in comm.calls:
        ops.setdefault(c.op, []).append(c.numel)
    reduced = sum(ops.get("all_reduce", []))
    n_params = len(trainable(model))
    said = ", ".join(f"{op} x{len(v)} ({sum(v)} elements)" for op, v in ops.items()) or "no collective"
    if not with_grad <= reduced <= psi + n_params + SMALL:
        raise AssertionError(
            f"your function called {said}; expected all-reduces of {_psi_elements(psi, with_grad)} in all (the "
            "gradients that exist: one flat buffer, or one call per parameter), each element sent once")
    other = {op: sum(v) for op, v in ops.items() if op != "all_reduce"}
    if sum(other.values()) > SMALL:
        raise AssertionError(f"your function called {said}: the mean gradient needs only an all-reduce")
    return psi, with_grad, ops


def check_average_gradients(fn, world_size=2, model="small-mlp", timeout=60.0):
    """fn(params) on world_size ranks, each holding the gradient of its own micro-batch, leaves on every
    rank the gradient of the whole batch (the mean of the ranks'), and all-reduces about Ψ elements."""
    __tracebackhide__ = True
    if not callable(fn):
        raise CheckFailed(f"expected your function average_gradients, got {type(fn).__name__}")
    _refuse_zerokit_function(fn)
    psi, with_grad, ops = run_on_ranks(_average_case, world_size, args=(fn, model), timeout=timeout,
                                       what="average_gradients")[0]
    calls = ", ".join(f"{op} x{len(v)}" for op, v in ops.items())
    passed(f"average_gradients gives every rank the whole batch's gradient on {world_size} ranks ({model}, "
           f"{_psi_words(psi, with_grad)}) with {calls} of {sum(ops['all_reduce'])} elements")


# ---------------------------------------------------------------------------------------
# the optimizer class: shared pieces


def _check_class(cls):
    check_class(cls, "your optimizer class",
                refuse=[(zerokit_ddp.DistributedAdam, "the exercise is to write data parallel Adam yourself "
                         "(subclass zerokit.adam.Adam, as the scaffold does)")],
                base_hint="keep the scaffold's base class")


@torch.no_grad()
def _reference_average(params):
    """Exercise (a) as its contract states it: every gradient that exists, end to end in one flat
    buffer, all-reduced once, divided by N, copied back; a .grad that is None stays None (in the
    lesson's models a parameter without a gradient has none on every rank). Unlike
    zerokit.ddp.average_gradients it sends no count per parameter, so a right class moves
    exactly the gradient's elements."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


_REFERENCE_AVERAGE = _reference_average


def _use_reference_average(cls):
    """Give the class the reference average_gradients wherever its methods would call the student's."""
    for klass in cls.__mro__:
        for value in vars(klass).values():
            fn = inspect.unwrap(value) if callable(value) else None
            glob = getattr(fn, "__globals__", None)
            if (glob is not None and callable(glob.get("average_gradients"))
                    and not str(glob.get("__name__", "")).startswith(("zerokit.", "torch."))):
                glob["average_gradients"] = _REFERENCE_AVERAGE


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _gather(flat):
    """Every rank's copy of `flat`, by rank."""
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return out


def _first_replica_difference(flat):
    """(rank, max |difference| to rank 0) of the first rank whose copy is not bitwise rank 0's, or None."""
    copies = _gather(flat)
    for r, other in enumerate(copies[1:], start=1):
        if not torch.equal(other, copies[0]):
            return r, max_abs_diff(other, copies[0])
    return None


def _replicas_differ(model):
    """(rank, max |difference| to rank 0, [parameter names that differ]) of the first rank whose
    weights are not bitwise rank 0's, or None."""
    named = list(model.named_parameters())
    copies = _gather(_flat(p for _, p in named))
    for r, other in enumerate(copies[1:], start=1):
        if not torch.equal(other, copies[0]):
            names, offset = [], 0
            for n, p in named:
                if not torch.equal(other[offset:offset + p.numel()], copies[0][offset:offset + p.numel()]):
                    names.append(n)
                offset += p.numel()
            return r, max_abs_diff(other, copies[0]), names
    return None


# ---------------------------------------------------------------------------------------
# numerics: replicas equal, and equal to torch.optim.AdamW on the whole batch


def _wrong_scale(mine, ref, what, world_size):
    """Why Adam's m or v differs, when the gradient it saw had the wrong scale; a general hint otherwise."""
    power = 2 if what == "v" else 1  # v averages the square of the gradient
    ratio = float((mine.double() * ref.double()).sum() / (ref.double() ** 2).sum().clamp_min(1e-300))
    for factor, words in ((world_size ** power, f"{world_size ** power} x AdamW's: Adam stepped with the sum of the "
                           "ranks' gradients where the mean over the ranks, not the sum, belongs (divide by N)"),
                          (world_size ** -power, f"1/{world_size ** power} of AdamW's: the gradient you stepped "
                           f"with was divided by N = {world_size} twice (averaged twice)")):
        if abs(ratio - factor) < 1e-3 * factor:
            return (f". Your {what} is {words}. Adam's weights hardly show a wrong scale (it is nearly "
                    "scale-invariant); its m and v do")
    return (". Adam's state sees the gradient you stepped with: is it the mean over the ranks, not the sum, "
            "and averaged once?")


def _numerics_case(rank, world_size, cls, name, steps, weight_decay, reference):
    with refusing(*NO_ZEROKIT_DDP):
        _use_reference_average(cls)
        # every rank builds its own random model: only rank 0's is the reference's, so the
        # replicas start equal only if the optimizer makes them so
        model = build_model(name, seed=0 if rank == 0 else 1000 + rank)
        names = [n for n, _ in model.named_parameters()]
        opt = build_optimizer(cls, model.parameters(), weight_decay=weight_decay, **HYPER)
        differs = _replicas_differ(model)
        if differs:
            r, diff, names = differs
            frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
            if set(names) <= frozen:
                raise AssertionError(
                    f"right after {cls.__name__}(...) rank {r} holds other weights than rank 0 in {', '.join(names)} "
                    f"only (max |difference| {diff:.3g}), and those are frozen (requires_grad=False): your __init__ "
                    "broadcast the trainable parameters and left the frozen ones out. Frozen parameters take part "
                    "in the forward: with its own frozen weights every rank computes another model's outputs and "
                    "gradients. Broadcast every parameter all_params() lists, frozen ones too")
            raise AssertionError(
                f"right after {cls.__name__}(...) rank {r} holds other weights than rank 0 (max |difference| "
                f"{diff:.3g}; in {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): every rank builds its "
                "model with its own random initialisation, so the optimizer must copy rank 0's parameters to every "
                "rank (dist.broadcast(p.data, src=0)) in __init__")
        for step in range(steps):
            batch_backward(model, step, name, GLOBAL_BATCH, STREAM, rank, world_size)
            opt.step()
            after = f"after step {step + 1}"
            differs = _first_replica_difference(_flat(model.parameters()))
            if differs:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                averaged = bool(grads) and _first_replica_difference(_flat(grads)) is None
                hint = ("the gradients are equal on every rank now, so they were averaged, but after the update: "
                        "average first, then step" if averaged else
                        "each rank applied the update of its own micro-batch's gradient: all-reduce the mean "
                        "gradient in step(), before the Adam update")
                raise AssertionError(f"{after} rank {differs[0]} holds other weights than rank 0 (max |difference| "
                                     f"{differs[1]:.3g}): the replicas drifted apart; {hint}")
            opt.zero_grad()
            record = reference[step]
            named = dict(model.named_parameters())
            state = getattr(opt, "state", {})
            for n in names:
                p = named[n]
                if n in record["exp_avg"]:
                    held = state.get(p) if isinstance(state, dict) else None
                    if not isinstance(held, dict) or not {"exp_avg", "exp_avg_sq"} <= held.keys():
                        # without them m and v cannot be compared, and a sum could hide in them
                        raise AssertionError(
                            f"{after}: self.state[p] of parameter {n} holds no m and v (keys: "
                            f"{sorted(held) if isinstance(held, dict) else 'none'}): keep Adam's m and v in "
                            "self.state[p]['exp_avg'] and self.state[p]['exp_avg_sq'], as lesson 01's Adam does")
                    for key, what in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                        ref = record[key][n]
                        scale = float(ref.abs().max())
                        try:
                            assert_close(state[p][key], ref, f"{what} (state['{key}']) of {n} {after}",
                                         atol=1e-5 * scale + 1e-12, rtol=1e-4)
                        except AssertionError as exc:
                            raise AssertionError(f"{exc}{_wrong_scale(state[p][key], ref, what, world_size)}") \
                                from None
                assert_close(p.detach(), record["params"][n], f"parameter {n} {after}")
    return sum(p.numel() for _, p in trainable(model))


def check_numerics(cls, world_size=2, model="small-mlp", steps=4, weight_decay=0.01, timeout=60.0):
    """cls on world_size ranks, each on its own slice of the batch: replicas start from rank 0's
    weights, stay bitwise equal, and match torch.optim.AdamW on the whole batch after every step."""
    __tracebackhide__ = True
    _check_class(cls)
    reference = adamw_reference(model, steps, {**HYPER, "weight_decay": weight_decay}, batch_backward,
                                (model, GLOBAL_BATCH, STREAM), timeout=timeout)
    psi = run_on_ranks(_numerics_case, world_size, args=(cls, model, steps, weight_decay, reference),
                       timeout=timeout, what=cls.__name__)[0]
    passed(f"{cls.__name__} on {world_size} ranks ({model}, Ψ = {psi}, weight decay {weight_decay:g}): replicas "
           f"equal on every rank and equal to torch.optim.AdamW on the whole batch after each of {steps} steps")


# ---------------------------------------------------------------------------------------
# collectives: what one step sends


def _comm_case(rank, world_size, cls, name, steps, weight_decay):
    with refusing(*NO_ZEROKIT_DDP):
        _use_reference_average(cls)
        model = build_model(name)
        initial = _flat(model.parameters())
        opt = build_optimizer(cls, model.parameters(), weight_decay=weight_decay, **HYPER)
        per_step = []
        for step in range(steps):
            batch_backward(model, step, name, GLOBAL_BATCH, STREAM, rank, world_size)
            psi, with_grad = psi_of(model), _used_numel(model)
            with CommCounter() as comm:
                opt.step()
            opt.zero_grad()
            per_step.append([(c.op, c.numel) for c in comm.calls])
        now = _flat(model.parameters())
        if not bool(torch.isfinite(now).all()):
            raise AssertionError("after your steps some parameters are NaN or inf")
        if torch.equal(now, initial):
            raise AssertionError("your step() left every parameter unchanged")
    n_params = len(trainable(model))
    for step, calls in enumerate(per_step):
        ops = {}
        for op, numel in calls:
            ops.setdefault(op, []).append(numel)
        when = (f"in step {step + 1}, step() called "
                f"{', '.join(f'{op} x{len(v)} ({sum(v)} elements)' for op, v in ops.items()) or 'no collective'}")
        for op in ("broadcast", "all_gather", "scatter"):
            if sum(ops.get(op, [])) > SMALL:
                raise AssertionError(
                    f"{when}: a {op.replace('_', '-')} of the parameters every step is not needed. Replicas that "
                    "start equal and apply the same update to the same mean gradient stay equal by themselves: "
                    "broadcast once, in __init__")
        reduced = sum(ops.get("all_reduce", []))
        if reduced == 0:
            raise AssertionError(f"{when}: no all-reduce of the gradient (data parallel's one collective per step)")
        if not with_grad <= reduced <= psi + n_params + SMALL:
            raise AssertionError(f"{when}: all-reduces of {reduced} elements in all; expected the gradient, "
                                 f"{_psi_elements(psi, with_grad)}, once (one flat buffer or one call per parameter)")
        other = {op: sum(v) for op, v in ops.items() if op != "all_reduce"}
        if sum(other.values()) > SMALL:
            raise AssertionError(f"{when}: data parallel needs one all-reduce of the gradient and nothing else")
    return psi, with_grad, per_step[-1]


def check_traffic(cls, world_size=2, model="small-mlp", steps=2, weight_decay=0.01, timeout=60.0):
    """Each step: all-reduces of the gradient, Ψ elements in all (volume 2Ψ), and no broadcast or
    all-gather of the parameters."""
    __tracebackhide__ = True
    _check_class(cls)
    psi, with_grad, calls = run_on_ranks(_comm_case, world_size, args=(cls, model, steps, weight_decay),
                                         timeout=timeout, what=cls.__name__)[0]
    reduced = sum(numel for op, numel in calls if op == "all_reduce")
    count = sum(1 for op, _ in calls if op == "all_reduce")
    extra = reduced - with_grad
    what = "the gradient" + (f" and {extra} elements of bookkeeping" if extra else "")
    passed(f"per step on {world_size} ranks ({model}, {_psi_words(psi, with_grad)}): {count} all-reduce call(s) of "
           f"{reduced} elements in all, {what} (volume 2 x {reduced} = {2 * reduced}); no broadcast of the parameters")


check_ddp_numerics = alias(check_numerics, "check_ddp_numerics")
check_ddp_collectives = alias(check_traffic, "check_ddp_collectives")
