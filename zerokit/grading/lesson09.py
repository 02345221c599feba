r"""Checks for lesson 09 (Muon on ZeRO-1): each matrix owned whole by one rank.

    check_numerics(cls, world_size, model, ...)  every weight after every step against one process running
                                                 torch.optim.Muon (the matrices) and torch.optim.AdamW (the
                                                 rest): bit for bit for 2 ranks on the same batch; each
                                                 matrix's update against Muon's from the same weights and the
                                                 same mean gradient (Muon ran, on the whole matrix, once per
                                                 step); the momentum a rank keeps
    check_state(cls, world_size, model)          the momentum kept once across the ranks: 4 B per element of
                                                 the matrices in all, not on every rank
    check_traffic(cls, world_size, model)        the volume of one step: 2Ψ, as ZeRO-1 AdamW
    check_balance(cls, world_size, shapes)       Newton-Schulz work per rank, measured (matrix-multiply flops
                                                 in step()): the slowest rank against the mean

Inside check_numerics every collective step() calls through torch.distributed is first announced to
every rank on a group of the check's own (_StepCollectives): where the ranks' next calls differ (a
matrix skipped from this rank's own .grad, no flags exchanged) every rank raises one reason, where gloo
would abort the process or wait forever; a work started with async_op=True must be waited for before
step() returns. A momentum of zeros beside its owner's right one is left to check_state (memory, not
numbers); a momentum shaped like a piece of the matrix is named as Newton-Schulz on a slice.

One bug costs one check. The numbers (numerics) cannot see who keeps the momentum or how much
each rank works; the state check cannot see the numbers; a layout that gives every rank every
matrix (all-reduce, everyone orthogonalises everything) has the right numbers, 2Ψ of volume and
perfect balance, and fails the state check only; owners balanced by element count fail balance
only. The non-2-D parameters go to zerokit.ZeRO1Adam beside the student's class, as
torch.optim.Muon goes beside torch.optim.AdamW: that part is given, and always right.

How the update is judged. Newton-Schulz runs in bfloat16, which rounds a difference of 1e-7 in
the mean gradient (three ranks sum in another order than one process) into as much as 2^-8 of
the update, and the trajectories drift apart step by step. So besides the one-process reference
(torch.optim.Muon in a launch of its own, the independent yardstick: bitwise where the
arithmetic allows, loose otherwise), each rank steps torch.optim.Muon from the *student's*
weights before the step with the mean gradient the check computed itself: that update must
match the student's within 10% of its norm at every step (measured: the solution 0, a mean
gradient off in its last bits 1.5%, Newton-Schulz in float32 7%, and 12% on a rank-deficient
gradient, where bfloat16's rounding decides the missing directions), which a Muon that did not
run (86% away; an SGD step of 1e-4 hides inside any tolerance on the weights) or ran on slices
of a matrix (25% to 85%) cannot. Where a matrix's gradient is rank-deficient, bfloat16 lifts
its zero singular values out of rounding noise and the update depends on the last bits; the
check measures that per matrix (the same step from a mean perturbed by 2^-20) and widens the
tolerance to three times it.
"""

import gc
import math

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .. import muon as zerokit_muon
from ..comm import CommCounter
from ..flat import FlatBucket
from ..models import build_model
from ..zero1 import ZeRO1Adam
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks
from .kit import (assert_changed, build_optimizer, check_class, gather_object, optimizer_held_bytes, ranks_backward,
                  refusing, snapshot)

__all__ = ["check_numerics", "check_state", "check_traffic", "check_balance"]

_OPTIMIZER_ONLY = "n/a: the exercise is an optimizer; it sees parameters and their .grad, never units or their outputs"
SITUATIONS = {
    "zero-grad-shard": "check_numerics: sparse-embed",  # embedding rows no batch looks up: zeros, not None
    "frozen": "check_numerics: edge",  # a frozen matrix handed to Muon: never updated, no momentum
    "tied": "check_numerics: edge",  # the embedding is the head: one matrix, two uses
    "unused": "check_numerics: edge",  # a matrix no rank ever has a gradient for: left alone, no decay
    "sits-out": "check_numerics: branch",  # the branch sits out step 2 on every rank, step 4 on odd ranks
    "n3": "check_numerics: world_size=3",
    "tuple-output": _OPTIMIZER_ONLY,
    "root-params": _OPTIMIZER_ONLY,
    "eval-no-grad": "n/a: MyZeRO1Muon acts only in step(); a forward under torch.no_grad never reaches it (no hooks)",
    "out-of-order": "n/a: step() reads every .grad after backward; no hook sees gradients arrive",
    "subgroup": "n/a: the scaffold's MyZeRO1Muon takes no process group; every collective runs on the default group",
    "fp16-scale": "n/a: lesson 09 trains in fp32 (Newton-Schulz's bfloat16 is inside muon_update_, no loss scale)",
    "zero3": "n/a: the exercise is Muon on ZeRO-1; where ZeRO-3 must gather a matrix's gradient is in the text",
    "peak-memory": "n/a: the lesson's memory rule is the momentum kept between steps (4 B per element, once across "
                   "the ranks: check_state); inside step() every rank holds the full gradient anyway, as in ZeRO-1",
}

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4, and a rank's slice at N = 3 by 4 micro-batches
STREAM = 909  # this lesson's data
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)  # torch.optim.Muon's defaults but lr (tests/test_muon.py)
ADAMW = dict(lr=3e-3, weight_decay=0.01)
# From the same weights and the same mean gradient (up to its summation order), the update of a
# matrix must match Muon's within this fraction of its Frobenius norm (measured: module docstring).
UPDATE_RTOL = 0.10
ROUNDING = 2.0 ** -20  # a mean gradient summed in another order differs by about this much, relatively
REFERENCE_ATOL = 2e-3  # against one process after a few steps, where the trajectories drift (tests/test_muon.py)
STATE_ALLOWANCE = 1024  # bytes of small bookkeeping tensors per rank (flags, owner tables)
BALANCE_SLACK = 1.15  # the slowest rank may do this much more than the best assignment's slowest

_USED = ("your optimizer used zerokit's ZeRO1Muon / assign_owners: the exercise is to choose the owners and "
         "write the step yourself (zerokit.muon.muon_update_ and newton_schulz_cost are yours to use)")
NO_ZEROKIT_MUON = [(zerokit_muon.ZeRO1Muon, "__init__", _USED)]
NO_ZEROKIT_OWNERS = [(zerokit_muon, "assign_owners", _USED)]  # refused everywhere: also where imported by name
_TorchMuon = torch.optim.Muon  # taken when the checks are imported, before any student code runs


# ---------------------------------------------------------------------------------------
# shared pieces


def _check_class(cls):
    check_class(cls, "your optimizer class (MyZeRO1Muon)",
                refuse=[(zerokit_muon.ZeRO1Muon, "the exercise is to write the owners and the step yourself "
                         "(subclass torch.optim.Optimizer, as the scaffold does)")])


def _matrices(model):
    """(name, parameter) of every 2-D parameter, frozen ones too (torch.optim.Muon takes them and skips
    what has no gradient), and the other parameters."""
    named = list(model.named_parameters())
    return [(n, p) for n, p in named if p.dim() == 2], [p for _, p in named if p.dim() != 2]


def _momentum(opt, p):
    """This rank's momentum of p where the optimizer keeps it as torch.optim.Muon does, else None."""
    state = opt.state.get(p) if isinstance(getattr(opt, "state", None), dict) else None
    buf = state.get("momentum_buffer") if isinstance(state, dict) else None
    return buf.detach() if isinstance(buf, torch.Tensor) else None


def _lr_ratio(shape):
    rows, cols = shape
    return math.sqrt(max(1, rows / cols))


def _orthogonal_part(delta, before):
    """The update O that Muon's step θ ← θ(1 - γλ) - γ·ratio·O would have applied to give `delta`."""
    lr, wd = MUON["lr"], MUON["weight_decay"]
    return -(delta + lr * wd * before) / (lr * _lr_ratio(tuple(delta.shape)))


def _singular_range(t):
    s = torch.linalg.svdvals(t.double())
    return float(s.min()), float(s.max())


def _straddlers(named, world_size):
    """Names of the matrices a flat shard boundary cuts, when the matrices (the trainable ones, or all
    of them) are laid end to end and cut in world_size shards: where an optimizer on flat shards
    would orthogonalise pieces."""
    names = {id(p): n for n, p in named}
    out = set()
    for params in ([p for _, p in named if p.requires_grad], [p for _, p in named]):
        if not params:
            continue
        pieces = [0] * len(params)
        for r in range(world_size):
            for s in FlatBucket(params, world_size, r).segments:
                pieces[s.index] += 1
        out |= {names[id(p)] for p, k in zip(params, pieces) if k > 1}
    return out


# ---------------------------------------------------------------------------------------
# the collectives of step(): the same on every rank, each waited for


_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "gather", "scatter", "barrier",
                "all_to_all", "all_to_all_single")


def _describe_call(op, args, kwargs, names):
    """(what every rank must agree on: the op, the shape and dtype of its tensor, its peer rank;
    what the student reads: "reduce of blocks.0.fc.weight's gradient (88 x 22) to rank 1")."""
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    peer = kwargs.get("dst", kwargs.get("src"))
    if peer is None and op in ("reduce", "broadcast") and len(args) > 1 and isinstance(args[1], int):
        peer = args[1]
    token = (op, tuple(tensor.shape) if tensor is not None else None, str(getattr(tensor, "dtype", "")), peer)
    what = ""
    if tensor is not None:
        name = names.get(tensor.untyped_storage().data_ptr())
        what = (f" of {name}" if name else "") + f" ({' x '.join(map(str, tensor.shape)) or 'a scalar'})"
    if peer is not None:
        what += f" {'to' if op == 'reduce' else 'from'} rank {peer}"
    return token, op + what


class _StepCollectives:
    """While step() runs, each collective it calls through torch.distributed is first announced to
    every rank on a group of the check's own (all_gather_object), and so is the end of step(): the
    ranks compare what they are about to do, and where they differ every rank raises the same
    reason instead of a collective that mismatches (gloo aborts the process) or waits forever. Works
    started with async_op=True are noted, and must be waited for before step() returns."""

    def __init__(self, group, names):
        self.group, self.names, self.calls, self.unwaited = group, names, [], []
        self.saved = {}

    def _agree(self, token, what):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (token, what), group=self.group)
        if len({t for t, _ in everyone}) > 1:
            raise _Mismatch([w for _, w in everyone], len(self.calls))
        self.calls.append(what)

    def _wrap(self, op, original):
        def collective(*args, **kwargs):
            self._agree(*_describe_call(op, args, kwargs, self.names))
            work = original(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                return _NotedWork(work, self.unwaited, self.calls[-1])
            return work
        return collective

    def __enter__(self):
        for op in _COLLECTIVES:
            if hasattr(dist, op):
                self.saved[op] = getattr(dist, op)
                setattr(dist, op, self._wrap(op, self.saved[op]))
        return self

    def __exit__(self, kind, exc, tb):
        for op, original in self.saved.items():
            setattr(dist, op, original)
        if kind is None:
            self._agree("end", "the end of step()")


class _Mismatch(AssertionError):
    def __init__(self, everyone, index):
        self.everyone, self.index = everyone, index
        super().__init__(f"collective {index + 1} of step() differs between the ranks: "
                         + "; ".join(f"rank {r}: {c}" for r, c in enumerate(everyone)))


class _NotedWork:
    """A collective's work, noted until its wait() is called."""

    def __init__(self, work, unwaited, what):
        self._work, self._unwaited, self.what = work, unwaited, what  # what: the collective, in words
        unwaited.append(self)

    def wait(self, *args, **kwargs):
        if self in self._unwaited:
            self._unwaited.remove(self)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _step_watched(opt, step, group, names, everyone_has):
    """opt.step() with its collectives compared across ranks and its asynchronous works accounted for.
    `names`: {storage pointer: what it is}; `everyone_has`: by rank, the matrices it has a .grad for."""
    watch = _StepCollectives(group, names)
    try:
        with watch:
            opt.step()
    except _Mismatch as exc:
        uneven = sorted({n for h in everyone_has for n in h} - set.intersection(*map(set, everyone_has)))
        why = ""
        if uneven:
            n = uneven[0]
            lacking = [r for r, h in enumerate(everyone_has) if n not in h]
            having = [r for r, h in enumerate(everyone_has) if n in h]
            why = (f" In this step rank{'s' if len(lacking) > 1 else ''} {', '.join(map(str, lacking))} "
                   f"ha{'ve' if len(lacking) > 1 else 's'} no gradient for {n}, which rank "
                   f"{', '.join(map(str, having))} ha{'ve' if len(having) > 1 else 's'}"
                   + (f" (and {len(uneven) - 1} other matrices alike)" if len(uneven) > 1 else "")
                   + ": a skip decided from this rank's own .grad leaves the others waiting in that matrix's "
                   "collectives. Every rank takes part in the collectives of each matrix some rank has a gradient "
                   "for (with zeros where it has none); which ones those are, the ranks learn from one flag per "
                   "matrix, all-reduced")
        raise AssertionError(f"step {step + 1}: {exc}.{why or ' Every rank must call the same collectives in the same order'}") from None
    if watch.unwaited:
        what = watch.unwaited[0].what
        raise AssertionError(
            f"step {step + 1}: step() returned while {len(watch.unwaited)} of its collectives started with "
            f"async_op=True had not been waited for (the first: {what}): until work.wait() returns, the result may "
            "not have arrived (a reduce's sum on the owner, a broadcast's matrix on the other ranks) and reading "
            "it reads whatever is there. Wait for each work before using its tensor")


# ---------------------------------------------------------------------------------------
# numerics: the weights and the momentum against torch.optim.Muon


def _reference_case(_rank, _one, names, steps, world_size):
    """One process: torch.optim.Muon on the matrices, torch.optim.AdamW on the rest, the whole batch of
    each step (on "branch" the mean of what world_size ranks compute). What it holds after each step."""
    out = []
    for name in names:
        net = build_model(name)
        matrices, rest = _matrices(net)
        muon = _TorchMuon([p for _, p in matrices], **MUON)
        adam = torch.optim.AdamW([p for p in rest if p.requires_grad], foreach=False, **ADAMW)
        records = []
        for step in range(steps):
            ranks_backward(net, step, name, GLOBAL_BATCH, STREAM, world_size)
            for opt in (muon, adam):
                opt.step()
                opt.zero_grad(set_to_none=True)
            records.append({"params": snapshot(net),
                            "momentum": {n: muon.state[p]["momentum_buffer"].clone() for n, p in matrices
                                         if "momentum_buffer" in muon.state.get(p, {})}})
        out.append(records)
    return out


def _mean_gradients(named, world_size):
    """{name: the mean gradient over the ranks, or None where no rank has one}: the check's own
    collectives, before the student's step (which may reduce the .grad tensors in place)."""
    flags = torch.tensor([p.grad is not None for _, p in named], dtype=torch.uint8)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    out = {}
    for (n, p), has in zip(named, flags.tolist()):
        if not has:
            out[n] = None
            continue
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out[n] = g.div_(world_size)
    return out


def _update_problem(n, step, before, after, expected, bitwise, twin):
    """Why the update of matrix n is wrong, as (what, why), or None. `expected`: Muon's step from `before`;
    `twin`: the same from a mean gradient perturbed by rounding (how much of the update rounding moves)."""
    if bitwise and torch.equal(after, expected):
        return None
    delta, want = after - before, expected - before
    scale = max(float(want.norm()), 1e-30)
    off = float((delta - want).norm()) / scale
    tolerance = max(UPDATE_RTOL, 3 * float((twin - expected).norm()) / scale)
    if not bitwise and off <= tolerance:
        return None
    when = f"step {step + 1}: {n} {tuple(before.shape)}"
    if not bool(delta.any()):
        return (f"{when} did not move, though some rank had a gradient for it",
                "every matrix with a gradient gets Muon's update in every step (its owner computes it and every rank "
                "receives the result)")
    if bitwise and off <= UPDATE_RTOL:
        return (f"{when} is {off:.1e} of its update away from torch.optim.Muon's, not bit for bit",
                "with 2 ranks on the same batch the mean of two equal gradients is exact, and the owner running "
                "torch's operations in torch's order (zerokit.muon.muon_update_) gives torch's bits. A different "
                "order of operations, or a Newton-Schulz written another way, rounds differently")
    mine, theirs = _singular_range(_orthogonal_part(delta, before)), _singular_range(_orthogonal_part(want, before))
    what = (f"{when}: your update is {off:.0%} away from torch.optim.Muon's step from the same weights and the same "
            f"mean gradient (the singular values of your update run from {mine[0]:.2g} to {mine[1]:.2g}, Muon's from "
            f"{theirs[0]:.2g} to {theirs[1]:.2g})")
    if mine[1] < 0.2 * theirs[0] or mine[1] > 5 * theirs[1]:
        return what, ("it is not orthogonalised: Muon did not run on this matrix. Every 2-D parameter's update is "
                      "Newton-Schulz of its momentum (muon_update_)")
    if mine[0] < 0.1 * theirs[0] and 0.5 * theirs[1] < mine[1] < 2 * theirs[1]:
        return what, ("orthogonalised, but where the gradient has (almost) no direction your update has none and "
                      "torch's does: torch's Newton-Schulz runs in bfloat16, whose rounding fills those directions. "
                      "Is yours in float32, or written another way? muon_update_ is torch's")
    return what, ("is it the mean gradient of the whole batch (every rank's gradient, summed and divided by N), this "
                  "matrix's momentum, its own learning-rate ratio and weight decay?")


def _momentum_problem(n, step, mine, want, bitwise, world_size):
    """Why this rank's momentum of matrix n is wrong, or None. `want`: Muon's (None: it keeps none)."""
    if want is None:  # torch keeps none: a matrix that never had a gradient
        if bool(mine.any()):
            return (f"step {step + 1}: {n} never had a gradient on any rank, so torch.optim.Muon keeps no momentum "
                    "for it, but yours is not zero")
        return None
    if tuple(mine.shape) != tuple(want.shape):
        part = 0 < mine.numel() < want.numel()
        return (f"step {step + 1}: self.state[p]['momentum_buffer'] of {n} has shape {tuple(mine.shape)}; Muon's "
                f"momentum is one matrix shaped like the parameter, {tuple(want.shape)}"
                + (": this rank keeps a momentum for a piece of the matrix, so its update orthogonalises that "
                   "piece alone, and Newton-Schulz of a slice is not a slice of Newton-Schulz (section 2). One "
                   "owner per matrix keeps its whole momentum and orthogonalises the whole update" if part else ""))
    if bitwise and torch.equal(mine, want):
        return None
    if not bitwise:
        scale = float(want.abs().max())
        ok = torch.allclose(mine.double(), want.double(), rtol=1e-4, atol=1e-5 * scale + 1e-12)
        if ok:
            return None
    what = f"step {step + 1}: the momentum of {n} (self.state[p]['momentum_buffer'] on this rank)"

    def close(a, b):
        return bool(torch.allclose(a.double(), b.double(), rtol=1e-3, atol=1e-6 * float(b.abs().max()) + 1e-12))

    beta = MUON["momentum"]
    if world_size > 1 and close(mine, world_size * want):
        return (f"{what} is {world_size} x torch.optim.Muon's: the gradients were summed, not averaged. The loss is "
                f"a mean over the whole batch, so the owner divides the sum by N = {world_size}. (The weights cannot "
                "show it: Newton-Schulz normalises its input, so a gradient N times too large gives the same step; "
                "the momentum, and anything else that reads the gradient's scale, can)")
    if close(mine, want / (1 - beta)):
        return (f"{what} is 1/(1 - μ) = {1 / (1 - beta):g} x torch.optim.Muon's: torch keeps an exponential "
                "average, B ← μB + (1 - μ)g (a lerp), not B ← μB + g. The weights cannot show it (Newton-Schulz "
                "normalises), the state can: zerokit.muon.muon_update_ is torch's arithmetic")
    if not bool(mine.any()):
        return (f"{what} is all zeros: your update changed a copy or a local name, not the stored momentum. Update "
                "self.state[p]['momentum_buffer'] in place (muon_update_ does)")
    if bitwise and close(mine, want):
        return (f"{what} is close to torch.optim.Muon's but not bit for bit: with 2 ranks on the same batch the "
                "mean is exact, and torch's arithmetic (zerokit.muon.muon_update_) gives torch's bits")
    diff = float((mine - want).abs().max())
    return (f"{what} differs from torch.optim.Muon's by up to {diff:.3g} (its largest entry is "
            f"{float(want.abs().max()):.3g})")


def _numerics_one(rank, world_size, cls, name, steps, same_data, accumulation, reference):
    bitwise = same_data and accumulation == 1
    model = build_model(name)
    named, rest = _matrices(model)
    opt = build_optimizer(cls, [p for _, p in named], **MUON)
    trainable_rest = [p for p in rest if p.requires_grad]
    adam = ZeRO1Adam(trainable_rest, **ADAMW) if trainable_rest else None
    # the yardstick of each step: torch.optim.Muon from the student's weights and the check's mean gradient
    shadows = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
    oracle = _TorchMuon(shadows, **MUON)
    # and how far rounding alone moves that update: the same step from a mean gradient perturbed in its
    # last bits (another summation order). Newton-Schulz in bfloat16 lifts a rank-deficient matrix's
    # zero singular values out of rounding noise, so there the update depends on the last bits.
    twins = [torch.nn.Parameter(p.detach().clone()) for _, p in named]
    twin = _TorchMuon(twins, **MUON)
    noise = torch.Generator().manual_seed(rank)
    group = dist.new_group(list(range(world_size)))  # the check's own: step()'s collectives announced on it
    for step in range(steps):
        before = {n: p.detach().clone() for n, p in named}
        ranks_backward(model, step, name, GLOBAL_BATCH, STREAM, world_size, rank, accumulation, same_data)
        moved = [n for n, p in named if not torch.equal(p.detach(), before[n])]
        if moved:
            raise AssertionError(
                f"step {step + 1}: {', '.join(moved[:3])} changed during backward, before step() was called"
                + (f" ({accumulation} backward passes per step)" if accumulation > 1 else "") + ": an update in a "
                "gradient hook runs Muon once per backward, so once per micro-batch under gradient accumulation. "
                "Update once per optimizer step, in step(), from the accumulated gradient")
        mean = _mean_gradients(named, world_size)
        names = {p.untyped_storage().data_ptr(): n for n, p in named}
        names.update({p.grad.untyped_storage().data_ptr(): f"{n}'s gradient" for n, p in named if p.grad is not None})
        _step_watched(opt, step, group, names, gather_object([n for n, p in named if p.grad is not None]))
        opt.zero_grad()
        if adam is not None:
            adam.step()
            adam.zero_grad()
        with torch.no_grad():
            for (n, _), s, t in zip(named, shadows, twins):
                s.copy_(before[n])
                s.grad = mean[n]
                t.copy_(before[n])
                t.grad = None if mean[n] is None else mean[n] * (1 + ROUNDING * torch.randn(t.shape, generator=noise))
                if "momentum_buffer" in oracle.state.get(s, {}):
                    twin.state[t]["momentum_buffer"] = oracle.state[s]["momentum_buffer"].clone()
        oracle.step()
        twin.step()
        for (n, p) in named:
            if mean[n] is None and not torch.equal(p.detach(), before[n]):
                raise AssertionError(
                    f"step {step + 1}: {n} had no gradient on any rank, so torch.optim.Muon leaves it alone (no "
                    "weight decay, momentum unchanged), but your step changed it: skip a matrix that no rank has a "
                    "gradient for (the ranks agree on it: one flag per matrix, all-reduced), and only such a matrix")
        # the momentum first: it names a cause (a sum for a mean, another average) the weights cannot show
        held, problems, zeros = [], {}, set()
        for (n, p), s in zip(named, shadows):
            mine = _momentum(opt, p)
            if mine is None:
                continue
            held.append(n)
            want = oracle.state.get(s, {}).get("momentum_buffer")
            problems[n] = _momentum_problem(n, step, mine, want, bitwise, world_size)
            if not problems[n] and bitwise and want is not None and not torch.equal(mine, reference[step]["momentum"][n]):
                problems[n] = (f"step {step + 1}: the momentum of {n} differs from one process's torch.optim.Muon: "
                               "not bit for bit")
            if not bool(mine.any()):
                zeros.add(n)
        everyone = gather_object((held, [n for n in held if not problems[n]]))
        for n, problem in problems.items():
            # a momentum of zeros beside the owner's right one: created on a rank that does not update it,
            # which costs memory (check_state's finding), not numbers
            elsewhere = any(n in right for r, (_, right) in enumerate(everyone) if r != rank)
            if problem and not (n in zeros and elsewhere):
                raise AssertionError(problem)
        wrong = {n: _update_problem(n, step, before[n], p.detach(), s.detach(), bitwise, t.detach())
                 for (n, p), s, t in zip(named, shadows, twins) if mean[n] is not None}
        wrong = {n: why for n, why in wrong.items() if why}
        if wrong:
            what, why = next(iter(wrong.values()))
            live = {n for n, _ in named if mean[n] is not None}
            if set(wrong) == _straddlers(named, world_size) & live:
                why = (f"the matrices that differ ({', '.join(wrong)}) are those a flat shard boundary cuts at "
                       f"N = {world_size}: orthogonalising each rank's piece of a matrix is not orthogonalising the "
                       "matrix. Give each matrix one owner that receives its whole mean gradient")
            elif len(wrong) > 1:
                why += f" ({len(wrong) - 1} other matrices differ too)"
            raise AssertionError(f"{what}: {why}")
        nowhere = [n for n, _ in named if n in reference[step]["momentum"] and not any(n in h for h, _ in everyone)]
        if nowhere:
            raise AssertionError(
                f"step {step + 1}: no rank keeps the momentum of {', '.join(nowhere[:3])} in "
                "self.state[p]['momentum_buffer']: the owner of each matrix keeps it there (torch.optim.Muon's "
                "place for it), where state_dict() and these checks find it")
        # the independent yardstick: one process, torch.optim.Muon and torch.optim.AdamW
        for n, p in model.named_parameters():
            want = reference[step]["params"][n]
            if bitwise:
                if not torch.equal(p.detach(), want):
                    diff = float((p.detach() - want).abs().max())
                    raise AssertionError(f"step {step + 1}: {n} differs from one process running torch.optim.Muon "
                                         f"by up to {diff:.3g}: with 2 ranks on the same batch it must be bit for bit")
            else:
                assert_close(p.detach(), want, f"step {step + 1}: {n} against one process running torch.optim.Muon",
                             atol=REFERENCE_ATOL, rtol=0.0)
    return True


def _numerics_case(rank, world_size, cls, names, steps, same_data, accumulation, references):
    with refusing(*NO_ZEROKIT_MUON), refusing(*NO_ZEROKIT_OWNERS, everywhere=True):
        for name, reference in zip(names, references):
            try:
                _numerics_one(rank, world_size, cls, name, steps, same_data, accumulation, reference)
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}" if len(names) > 1 else str(exc)) from None
    return True


def check_numerics(cls, world_size=2, model="transformer", steps=3, same_data=False, accumulation=1, timeout=60.0):
    """cls (the 2-D parameters) beside zerokit.ZeRO1Adam (the rest) on world_size ranks matches one process
    running torch.optim.Muon and torch.optim.AdamW on the whole batch, after every step: bit for bit where
    every rank sees the whole batch (same_data, 2 ranks: the mean of equal gradients is exact), within
    tolerance where each rank has its own slice (in `accumulation` micro-batches per step). At every step
    each matrix's update must be Muon's from the same weights and mean gradient, and the momentum a rank
    keeps (self.state[p]["momentum_buffer"]) Muon's. `model` may name several zoo models (one launch)."""
    __tracebackhide__ = True
    _check_class(cls)
    names = [model] if isinstance(model, str) else list(model)
    if same_data and world_size != 2:
        raise ValueError("same_data is the bitwise case: 2 ranks (the mean of three equal gradients rounds)")
    references = run_on_ranks(_reference_case, 1, args=(names, steps, world_size), timeout=timeout,
                              forbid_adam=False,
                              what="the reference (torch.optim.Muon and torch.optim.AdamW, one process)")[0]
    run_on_ranks(_numerics_case, world_size, args=(cls, names, steps, same_data, accumulation, references),
                 timeout=timeout, what=cls.__name__)
    how = ("every rank on the whole batch: bit for bit" if same_data else
           f"each rank on its own slice{f' in {accumulation} micro-batches' if accumulation > 1 else ''}: each "
           f"update within {UPDATE_RTOL:.0%} of Muon's from the same weights")
    passed(f"{cls.__name__} beside zerokit.ZeRO1Adam matches torch.optim.Muon + AdamW on {world_size} ranks "
           f"({', '.join(names)}; {how}): every weight, and each matrix's momentum where a rank updates it, after "
           f"each of {steps} steps; step()'s collectives the same on every rank, any asynchronous one waited for")


# ---------------------------------------------------------------------------------------
# state: the momentum, once across the ranks


def _state_case(rank, world_size, cls, name, steps):
    # The worker was forked from a process that has run no tensor operation; freezing moves what is
    # alive now out of the collector's view, so the scans below see only what this check creates.
    gc.freeze()
    built = []
    try:
        with refusing(*NO_ZEROKIT_MUON), refusing(*NO_ZEROKIT_OWNERS, everywhere=True):
            model = build_model(name)
            named, _ = _matrices(model)
            # whatever torch creates lazily exists before we count
            ranks_backward(model, 0, name, GLOBAL_BATCH, STREAM, world_size, rank)
            model.zero_grad(set_to_none=True)
            initial = [p.detach().clone() for p in model.parameters()]

            def run_steps(model):
                opt = build_optimizer(cls, [p for _, p in named], **MUON)
                built.append(opt)
                for step in range(steps):
                    ranks_backward(model, step, name, GLOBAL_BATCH, STREAM, world_size, rank)
                    opt.step()
                    model.zero_grad(set_to_none=True)
                return opt

            held_bytes, held = optimizer_held_bytes(model, run_steps)
            assert_changed(model, initial)
            holders = [n for n, p in named if _momentum(built[0], p) is not None]
            idle = [n for n in holders if not bool(_momentum(built[0], dict(named)[n]).any())]  # created, never updated
            live = {n: p.numel() for n, p in named if p.requires_grad}
            built.clear()
    finally:
        gc.unfreeze()
    return held_bytes, held[:4], holders, live, idle


def check_state(cls, world_size=2, model="transformer", steps=2, timeout=60.0):
    """Between steps the ranks together keep Muon's momentum once: 4 B per element of the matrices in all
    (each rank the momentum of the matrices it owns), plus a few bookkeeping scalars per rank; not a copy
    of every matrix's momentum on every rank."""
    __tracebackhide__ = True
    _check_class(cls)
    results = run_on_ranks(_state_case, world_size, args=(cls, model, steps), timeout=timeout, what=cls.__name__)
    live = results[0][3]
    psi = sum(live.values())
    total = sum(r[0] for r in results)
    limit = 4 * psi + world_size * STATE_ALLOWANCE
    per_rank = ", ".join(f"rank {r}: {b} B" for r, (b, *_) in enumerate(results))
    if total > limit:
        holders = [r[2] for r in results]
        everywhere = [n for n in live if sum(n in h for h in holders) > 1]
        if everywhere:
            counts = {n: sum(n in h for h in holders) for n in everywhere}
            most = max(counts.values())
            some = f"{', '.join(everywhere[:3])}{' and others' if len(everywhere) > 3 else ''}"
            idle = all(sum(n in r[4] for r in results) == counts[n] - 1 for n in everywhere)
            why = (f"The momentum of {some} is kept on {most} ranks (self.state), " + (
                "on all but one as zeros that never change: created on every rank, updated by the owner only. "
                "Only a matrix's owner creates and keeps its momentum" if idle else
                "every rank keeping every matrix's momentum (and, to keep it right, orthogonalising every matrix "
                "itself): data parallel's memory, 4 B x Ψ per rank. Only a matrix's owner needs its momentum: the "
                "other ranks receive the updated matrix"))
        else:
            largest = ", ".join(f"{numel} elements ({nbytes} B)" for nbytes, numel in results[0][1])
            why = (f"Rank 0's largest held tensors: {largest}. A buffer needed only inside step() (a gradient, "
                   "an update) should be a local variable, not an attribute")
        raise CheckFailed(f"the ranks together keep {total} B of tensors alive between steps ({per_rank}); Muon's "
                          f"momentum is 4 B per element of the {len(live)} matrices, Ψ = {psi}: 4Ψ = {4 * psi} B once "
                          f"across the ranks (limit {limit} B). {why}")
    passed(f"the momentum is kept once across {world_size} ranks ({per_rank}; 4Ψ = {4 * psi} B in all, Ψ = {psi} "
           f"elements of {len(live)} matrices); data parallel Muon would keep {4 * psi} B on every rank")


# ---------------------------------------------------------------------------------------
# traffic: what one step moves


def _traffic_case(rank, world_size, cls, name, steps):
    with refusing(*NO_ZEROKIT_MUON), refusing(*NO_ZEROKIT_OWNERS, everywhere=True):
        model = build_model(name)
        named, _ = _matrices(model)
        initial = [p.detach().clone() for _, p in named]
        opt = build_optimizer(cls, [p for _, p in named], **MUON)
        per_step = []
        for step in range(steps):
            with CommCounter() as comm:  # backward too: a step may send what hooks prepared during it
                ranks_backward(model, step, name, GLOBAL_BATCH, STREAM, world_size, rank)
                opt.step()
            model.zero_grad(set_to_none=True)
            per_step.append([(c.op, c.numel, c.volume) for c in comm.calls])
        if all(torch.equal(p.detach(), q) for (_, p), q in zip(named, initial)):
            raise AssertionError("your step() left every matrix unchanged")
    return per_step, sum(p.numel() for _, p in named if p.requires_grad), len(named)


def check_traffic(cls, world_size=2, model="transformer", steps=2, timeout=60.0):
    """The volume of one training step (backward and step()), in the paper's convention (an all-reduce of
    n elements counts 2n): 2Ψ for the Ψ elements of the matrices, as ZeRO-1 AdamW's reduce-scatter +
    all-gather, plus a few flags."""
    __tracebackhide__ = True
    _check_class(cls)
    per_step, psi, count = run_on_ranks(_traffic_case, world_size, args=(cls, model, steps), timeout=timeout,
                                        what=cls.__name__)[0]
    budget = 2 * psi + 4 * count + 64  # the flags: one per matrix, all-reduced (2 x) with room to spare
    for step, calls in enumerate(per_step):
        ops = {}
        for op, numel, volume in calls:
            ops.setdefault(op, [0, 0, 0])
            ops[op][0] += 1
            ops[op][1] += numel
            ops[op][2] += volume
        volume = sum(v for _, _, v in ops.values())
        listed = ", ".join(f"{op} x{k} ({numel} elements, volume {v})" for op, (k, numel, v) in ops.items())
        if volume > budget:
            reduced = ops.get("all_reduce", [0, 0, 0])[1]
            why = (f" Its all-reduce of {reduced} elements counts 2 x {reduced}: every rank receives every mean "
                   "gradient, though only a matrix's owner uses it. A reduce to the owner moves Ψ, the broadcast "
                   "of the result Ψ more" if reduced > psi // 2 else
                   " Each matrix's gradient needs to reach its owner once (Ψ in all), and each updated matrix every "
                   "rank once (Ψ)")
            raise CheckFailed(f"step {step + 1}: step() moved a volume of {volume} elements ({listed}); the target "
                                 f"is 2Ψ = {2 * psi} for Ψ = {psi} elements of {count} matrices, as ZeRO-1 AdamW's "
                                 f"reduce-scatter and all-gather.{why}")
    kinds = {}
    for op, _, v in per_step[-1]:
        kinds[op] = kinds.get(op, 0) + v
    passed(f"per step on {world_size} ranks: volume {sum(kinds.values())} elements "
           f"({', '.join(f'{op} {v}' for op, v in kinds.items())}) ≈ 2Ψ = {2 * psi} (Ψ = {psi} elements of "
           f"{count} matrices), as ZeRO-1 AdamW")


# ---------------------------------------------------------------------------------------
# balance: the Newton-Schulz work of each rank, measured


class _MatmulFlops(TorchDispatchMode):
    """Counts the flops (2 per multiply-add) of every matrix product inside the block, as they reach
    torch's dispatcher (`@`, torch.mm, torch.addmm, matmul and einsum all end up there). Lighter
    than torch.utils.flop_counter, which imports a symbolic-shape library on first use."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def _flops(fn):
    with _MatmulFlops() as counter:
        fn()
    return counter.flops


def _balance_case(rank, world_size, cls, shapes):
    # what Newton-Schulz costs each matrix (zerokit's, torch's arithmetic), for the best assignment's loads;
    # here and not in the notebook: the first dispatch mode a process enters imports ~800 modules, and the
    # forkserver that forked this rank has paid for that already
    costs = [_flops(lambda s=s: zerokit_muon.newton_schulz(torch.ones(s))) for s in shapes] if rank == 0 else None
    with refusing(*NO_ZEROKIT_MUON), refusing(*NO_ZEROKIT_OWNERS, everywhere=True):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
        before = [p.detach().clone() for p in params]
        opt = build_optimizer(cls, params, **MUON)
        gen = torch.Generator().manual_seed(1 + rank)  # each rank its own gradient, through backward (hooks run)
        grads = [torch.randn(p.shape, generator=gen) for p in params]

        def train_step():
            sum((p * g).sum() for p, g in zip(params, grads)).backward()
            opt.step()

        flops = _flops(train_step)
        unchanged = sum(torch.equal(p.detach(), b) for p, b in zip(params, before))
        if unchanged:
            raise AssertionError(f"your step() left {unchanged} of the {len(params)} matrices unchanged")
        holders = [i for i, p in enumerate(params) if _momentum(opt, p) is not None]
        pieces = [i for i in holders if _momentum(opt, params[i]).numel() < params[i].numel()]
    return flops, holders, costs, pieces


def _best_assignment(costs, world_size):
    """The loads of a good assignment: the costliest first, each to the least loaded rank."""
    load = [0] * world_size
    for c in sorted(costs, reverse=True):
        load[load.index(min(load))] += c
    return load


def check_balance(cls, world_size=2, shapes=((32, 32),) + ((2, 512),) * 16, timeout=60.0):
    """One step of cls on world_size ranks over matrices of the given shapes, the flops of the matrix
    products in each rank's step() counted (Newton-Schulz is the only matrix product there): the
    slowest rank's against the mean of the ranks', within 15% of what the best assignment allows."""
    __tracebackhide__ = True
    _check_class(cls)
    shapes = [tuple(s) for s in shapes]
    results = run_on_ranks(_balance_case, world_size, args=(cls, shapes), timeout=timeout, what=cls.__name__)
    flops = [f for f, _, _, _ in results]
    mean = sum(flops) / world_size
    if mean == 0:
        raise CheckFailed("no rank multiplied a matrix in step(): no Newton-Schulz ran (muon_update_ runs it)")
    best = _best_assignment(results[0][2], world_size)
    best_ratio = max(best) / (sum(best) / world_size)
    ratio = max(flops) / mean
    per_rank = ", ".join(f"rank {r}: {f / 1e6:.2f} M" for r, f in enumerate(flops))
    if ratio > BALANCE_SLACK * best_ratio:
        slow = flops.index(max(flops))
        owned = [[shapes[i] for i in h] for _, h, _, _ in results]
        elements = [sum(a * b for a, b in o) for o in owned]
        hint = ""
        if all(len(pieces) == len(shapes) for _, _, _, pieces in results):
            hint = (" Every rank keeps a momentum for a piece of every matrix and orthogonalises that piece (Newton-Schulz "
                    "of a slice): each rank's work follows the elements it holds, not what whole matrices cost. Give "
                    "each matrix one owner, chosen by Newton-Schulz cost (zerokit.muon.newton_schulz_cost)")
        elif not any(owned):
            hint = (" No rank keeps a momentum per matrix (self.state): on flat shards each rank's work follows the "
                    "elements it holds, not what whole matrices cost. Give each matrix one owner, chosen by "
                    "Newton-Schulz cost (zerokit.muon.newton_schulz_cost)")
        elif max(elements) / (sum(elements) / world_size) < ratio - 0.1:
            hint = (f" Your ranks own {', '.join(map(str, elements))} elements, within "
                    f"{max(elements) / (sum(elements) / world_size):.2f} x of the mean: balanced by element count. A "
                    "matrix m x n (m ≤ n) costs Newton-Schulz 2m²n + m³ per iteration (zerokit.muon.newton_schulz_cost), "
                    "a square one far more per element than a thin one: balance that cost")
        raise CheckFailed(f"rank {slow}'s step() did {ratio:.2f} x the mean Newton-Schulz work of the ranks "
                          f"(flops per rank: {per_rank}; {len(shapes)} matrices of shapes "
                          f"{sorted(set(shapes), key=shapes.index)}); the costliest-first assignment gives "
                          f"{best_ratio:.2f} x, and the step takes as long as its slowest rank.{hint}")
    costs = results[0][2]
    floor = max(costs) / (sum(costs) / world_size)  # the costliest matrix alone, against the mean
    why = (f"; no split into whole matrices does better: the costliest is {max(costs) / sum(costs):.0%} of all "
           f"the work" if floor > 1.0 and floor >= best_ratio - 1e-9 else "")
    passed(f"Newton-Schulz work per rank on {world_size} ranks ({len(shapes)} matrices): {per_rank} flops; the "
           f"slowest {ratio:.2f} x the mean (the costliest-first assignment: {best_ratio:.2f} x{why})")
