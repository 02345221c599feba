r"""Checks for lesson 06 (mixed precision): the dynamic loss scaler and the master-weight update.

The student writes two things: `MyLossScaler` (unscale the gradients and detect an overflow,
agreed on every rank; back off, skip and grow) and `MyMixedPrecisionAdam` (data parallel
AdamW with 16-bit weights and gradients, fp32 master weights, m and v). One question per check:

    check_unscale(cls)            unscale() returns fp32 g / S: divided (not multiplied), in fp32, in
                                  new tensors (the gradients it was given unchanged, fp32 ones too)
    check_overflow_agreed(cls)    an inf or nan in ONE rank's gradients (each rank holds different
                                  ones, as with ZeRO's shards) makes update() say "skip" on EVERY
                                  rank, and leaves every rank with the same scale
    check_scale_schedule(cls)     backoff by backoff_factor on an overflow, growth by growth_factor
                                  after growth_interval clean steps in a row, the count restarting
    check_numerics(opt_cls)       (one model, or several in one launch; "branch" sits out a step, so
                                  the per-parameter step counts differ)
                                  right after __init__: every parameter 16-bit, frozen ones too, and
                                  the masters the fp32 weights as built (not the rounded ones); then
                                  the fp32 masters, m and v after every step against
                                  torch.optim.AdamW in fp32 fed the same (unscaled, mean) gradient,
                                  at a loss scale S != 1 in bf16 too (2**8; fp16 2**10), so that
                                  Adam fed g·S (p.grad, still scaled) or g/S (unscaled twice) is
                                  told so, from m's ratio to AdamW's; the model's weights 16-bit
                                  and equal to the masters rounded
    check_overflow_step(opt_cls)  an inf in one rank's gradient at one step: nothing changes on any
                                  rank in that step, nor the step count(s) `self.steps` (a count
                                  advanced on the skipped step is named as such), the scale halves,
                                  the other steps do update, and every step after the skipped one
                                  is what the same optimizer computes when that step never happened
                                  (no step count, m or v advanced by the skip)

The optimizer checks hand the optimizer zerokit's own scaler (`ReferenceScaler`, the same
interface as the exercise), so a wrong scaler costs the scaler's points only.

The reference. torch.optim.AdamW (foreach=False) runs inside each rank on fp32 copies of the
initial weights, fed exactly the gradient the student's step sees: the check reproduces the
scaffold's all-reduce on copies of the 16-bit gradients and divides by the loss scale.
The harness's tripwires on torch's Adam are lifted (harness.torch_adam_allowed) only while
the reference steps.

The aftermath of a skipped step. A skip is a special path, and what follows it must be
compared too: an optimizer that counts the skipped step (t advances, so the bias correction
of every later step is off), or moves anything else, is right on the skipped step itself.
check_overflow_step therefore trains a twin first: the same class, model, data and scaler,
without the poisoned step at all (AdamW that skipped it, as the student wrote AdamW), and
compares every step after the skip with it. Against the student's own update rule, not
torch's: a wrong update is check_numerics' point, and costs its points only; here any
difference is the skip's doing. The twin's scale backs off at the skipped step as the run's
does, so an optimizer that feeds Adam g·S (check_numerics' point) is the same in both runs.
"""

import torch
import torch.distributed as dist
from torch.optim import AdamW as _TorchAdamW

from .. import ddp as zerokit_ddp
from .. import zero1 as zerokit_zero1
from ..mixed_precision import LossScaler, as_dtype
from ..models import build_model, model_loss
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks, torch_adam_allowed
from .kit import ADAM_HYPER, alias, check_class, gather_object, rank_batch

__all__ = ["ReferenceScaler", "check_unscale", "check_overflow_agreed", "check_scale_schedule",
           "check_numerics", "check_overflow_step"]

# the fixture matrix (kit.SITUATIONS): the hidden test that meets each situation, or why none can
_NO_UNITS = "n/a: the mixed precision optimizer sees parameters and .grad in step(), never units or their outputs"
SITUATIONS = {
    "fp16-scale": "check_numerics: fp16",  # S = 2**10 (and 2**8 in bf16): Adam fed g·S or g/S is named
    "frozen": "check_numerics: edge",  # frozen parameters must turn 16-bit too
    "tied": "check_numerics: edge",
    "unused": "check_numerics: edge",  # m and v stay zeros, no step counted
    "sits-out": "check_numerics: branch",  # the branch sits out step 2: its step count falls behind
    "n3": "check_numerics: world_size=3",
    "tuple-output": _NO_UNITS,
    "root-params": _NO_UNITS,
    "eval-no-grad": "n/a: the optimizer acts only in step(); a forward under torch.no_grad never reaches it (no hooks)",
    "out-of-order": "n/a: the scaffold all-reduces every gradient in step(), after backward; no hook sees them arrive",
    "zero-grad-shard": "n/a: no shards: the scaffold's all-reduce gives every rank the whole mean gradient, and which "
                       "parameters step is the scaffold's with_grad (.grad not None), not a test on the values",
    "subgroup": "n/a: the scaffold's MyMixedPrecisionAdam takes no process group; its collectives run on the default "
                "group (and the scaler's flag all-reduce too)",
    "zero3": "n/a: lesson 06's optimizer is data parallel in 16 bits; it touches no ZeRO stage",
    "peak-memory": "n/a: lesson 06's 16 bytes per parameter are the formats' arithmetic, measured in section 8 and not "
                   "graded; the numerics check holds the dtypes that fix them (fp32 masters, m, v; 16-bit parameters)",
}

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4
# lr 1e-3: an update is a fraction of a unit in the last place of a bf16 weight (2**-9 in
# [0.25, 0.5)), so applied to 16-bit weights it is lost or rounded to a whole unit
HYPER = dict(ADAM_HYPER, lr=1e-3, weight_decay=0.01)


# ---------------------------------------------------------------------------------------
# zerokit's scaler behind the exercise's interface


class ReferenceScaler:
    """The exercise's interface around zerokit.mixed_precision.LossScaler."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self._scaler = LossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
        self.found_inf = False
        self.updates = 0

    @property
    def scale(self):
        return self._scaler.scale

    def scale_loss(self, loss):
        return loss * self.scale

    @torch.no_grad()
    def unscale(self, grads):
        out = [g.float() / self.scale for g in grads]
        flag = torch.tensor([float(any(not bool(torch.isfinite(g).all()) for g in out))],
                            device=out[0].device if out else "cpu")
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.found_inf = bool(flag.item())
        return out

    def update(self):
        self.updates += 1
        self._scaler.update(self.found_inf)
        return not self.found_inf

    def back_off(self):
        """The scale backs off as after an overflow, for a step that never happened: no update
        counted, found_inf left as it is (a twin run skipping a step keeps the run's scale)."""
        self._scaler.update(True)


# ---------------------------------------------------------------------------------------
# exercise (a): the scaler


def _check_scaler_class(cls):
    if not isinstance(cls, type):
        raise CheckFailed(f"expected your scaler class, got {type(cls).__name__}")
    for name in ("scale_loss", "unscale", "update"):
        if not callable(getattr(cls, name, None)):
            raise CheckFailed(f"{cls.__name__} has no method {name}(): keep the scaffold's methods")


def _unscale_case(rank, world_size, cls):
    g = torch.Generator().manual_seed(60 + rank)
    for scale, dtype in ((2.0**10, torch.float16), (2.0**16, torch.float16), (2.0**8, torch.bfloat16),
                         (4.0, torch.float32)):
        scaler = cls(init_scale=scale)
        # scaled gradients as backward leaves them: g * S in the 16-bit type; the last one, 1 + 1023/1024
        # (11 significant bits), divided by 2**16 is 2047 * 2**-26, in fp16's subnormal binade [2**-16, 2**-15),
        # whose numbers are multiples of 2**-24 (9 significant bits): fp16 division rounds it to 2**-15
        grads = [(torch.randn(37, generator=g) * scale / 8).to(dtype),
                 (torch.randn(3, 5, generator=g) * scale / 64).to(dtype),
                 torch.full((2,), 1 + 1023 / 1024, dtype=dtype)]
        before = [t.clone() for t in grads]
        out = scaler.unscale(grads)
        call = f"unscale() with scale S = {scale:g} on {str(dtype).replace('torch.', '')} gradients"
        if not isinstance(out, (list, tuple)) or len(out) != len(grads):
            raise AssertionError(f"{call} returned {type(out).__name__}"
                                 f"{f' of length {len(out)}' if hasattr(out, '__len__') else ''}; "
                                 f"expected a list of {len(grads)} tensors, one per gradient")
        for i, (o, src) in enumerate(zip(out, before)):
            if not isinstance(o, torch.Tensor):
                raise AssertionError(f"{call}: element {i} is a {type(o).__name__}, not a tensor")
            if o.dtype != torch.float32:
                raise AssertionError(f"{call}: gradient {i} came back as {o.dtype}; unscale must return fp32 "
                                     "gradients (the optimizer's arithmetic is fp32; g / S may be too small "
                                     "for the 16-bit type)")
            expected = src.float() / scale
            if o.shape == expected.shape and bool(expected.abs().max() > 0):
                if torch.allclose(o, src.float() * scale, rtol=1e-3) or torch.allclose(o, src.float(), rtol=1e-3):
                    ratio = "times the scale" if scale != 1 and torch.allclose(o, src.float() * scale, rtol=1e-3) \
                        else "unchanged"
                    raise AssertionError(
                        f"{call}: gradient {i} came back {ratio} (g·S = {float(src.float().reshape(-1)[0]):.4g} "
                        f"-> {float(o.reshape(-1)[0]):.4g}); divide by the scale: backward computed the gradient "
                        f"of loss·S, so the true gradient is grad / S = {float(expected.reshape(-1)[0]):.4g}"
                        + (". Multiplying makes it S² too large" if ratio == "times the scale" else ""))
                rounded = (src / scale).float()
                if not torch.equal(rounded, expected) and torch.equal(o, rounded):
                    raise AssertionError(
                        f"{call}: gradient {i} was divided in {str(dtype).replace('torch.', '')} and rounded "
                        f"(1.9990234375 / {scale:g} came back {float(o.reshape(-1)[-1]):.8g}, exactly "
                        f"{float(expected.reshape(-1)[-1]):.8g} in fp32): convert to fp32 first, then divide")
            assert_close(o, expected, f"{call}: gradient {i}")
        for i, (given, src) in enumerate(zip(grads, before)):
            if not torch.equal(given, src):
                same = any(o is given for o in out)
                raise AssertionError(
                    f"{call}: the gradient {i} you were given changed (g·S = {float(src.float().reshape(-1)[0]):.4g} "
                    f"before the call, {float(given.float().reshape(-1)[0]):.4g} after"
                    + (", and the list you returned holds that very tensor" if same else "")
                    + "): unscale returns new fp32 tensors and leaves its inputs as they were. For an fp32 "
                    "gradient t.float() is t itself, not a copy, so an in-place division (div_, /=) divides the "
                    "caller's gradient; divide with /, which makes a new tensor")
        verdict = scaler.update()
        if verdict is None or not verdict:
            raise AssertionError(f"{call}: every gradient is finite, yet update() returned {verdict!r}; "
                                 "it must return True (step)")
    gather_object(True)  # a collective of the check's own: no rank returns while another is still starting up
    return True


def check_unscale(cls, world_size=2, timeout=60.0):
    """unscale(grads) returns fp32 copies divided by the scale, for fp16, bf16 and fp32 gradients, and
    leaves the gradients it was given as they were."""
    __tracebackhide__ = True
    _check_scaler_class(cls)
    run_on_ranks(_unscale_case, world_size, args=(cls,), timeout=timeout, what=f"{cls.__name__}.unscale")
    passed(f"{cls.__name__}.unscale returns fp32 gradients divided by S (S = 2**2 ... 2**16; fp16, bf16, fp32) "
           f"on {world_size} ranks, and leaves the gradients it was given unchanged")


def _overflow_case(rank, world_size, cls, bad_rank):
    g = torch.Generator().manual_seed(600 + rank)
    scaler = cls(init_scale=2.0**12, growth_interval=1000)
    verdicts = []
    # each rank its own gradients, as with ZeRO (every rank sees only its shard of the reduced gradient)
    scenarios = [("no inf or nan anywhere", None), (f"an inf in rank {bad_rank}'s gradient only", float("inf")),
                 (f"a nan in rank {bad_rank}'s gradient only", float("nan")), ("no inf or nan anywhere", None)]
    for what, poison in scenarios:
        grads = [(torch.randn(29, generator=g) * 100).to(torch.float16), torch.randn(7, generator=g).to(torch.float16)]
        if poison is not None and rank == bad_rank:
            grads[1][3] = poison
        scaler.unscale(grads)
        step = scaler.update()
        verdicts.append((what, poison is not None, repr(step) if step is None else bool(step), float(scaler.scale)))
    everyone = gather_object(verdicts)
    for k, (what, overflow, _, _) in enumerate(verdicts):
        steps = [v[k][2] for v in everyone]
        scales = [v[k][3] for v in everyone]
        if any(not isinstance(s, bool) for s in steps):
            raise AssertionError(f"update() returned None (on ranks 0, 1, ...: {steps}); it must return True "
                                 "(step) or False (skip)")
        if overflow:
            stepping = [r for r, s in enumerate(steps) if s]
            if stepping and len(stepping) < world_size:
                raise AssertionError(
                    f"with {what} (call {k + 1}), update() said skip on rank(s) "
                    f"{[r for r, s in enumerate(steps) if not s]} but step on rank(s) {stepping}: the overflow "
                    "check must be agreed across ranks. Each rank sees only its own gradients (with ZeRO, its "
                    "shard): one rank would skip while the others step, the replicas drift apart (or hang in "
                    "the next collective). All-reduce a found-inf flag with ReduceOp.MAX in unscale()")
            if stepping:
                raise AssertionError(
                    f"with {what} (call {k + 1}), update() returned True (step) on every rank: an overflow step "
                    "must be skipped (update() returns False), or the inf/nan reaches the weights")
        elif not all(steps):
            raise AssertionError(f"with {what} (call {k + 1}), update() returned {steps} on ranks 0..{world_size - 1}; "
                                 "it must return True (step) when no rank saw an inf or nan")
        if len(set(scales)) != 1:
            raise AssertionError(f"after {what} (call {k + 1}) the loss scale differs between ranks: {scales}; "
                                 "every rank must take the same (agreed) decision")
    return True


def check_overflow_agreed(cls, world_size=2, bad_rank=None, timeout=60.0):
    """An inf or nan in one rank's gradients only: update() returns False (skip) on every rank."""
    __tracebackhide__ = True
    _check_scaler_class(cls)
    bad_rank = world_size - 1 if bad_rank is None else bad_rank
    run_on_ranks(_overflow_case, world_size, args=(cls, bad_rank), timeout=timeout,
                 what=f"{cls.__name__}'s overflow check")
    passed(f"an inf, then a nan, in rank {bad_rank}'s gradient only: {cls.__name__}.update() skipped on all "
           f"{world_size} ranks, and stepped on all of them when no rank overflowed")


def _schedule_case(rank, world_size, cls, schedules):
    out = []
    for config, pattern in schedules:
        scaler = cls(**config)
        if not isinstance(getattr(scaler, "scale", None), (int, float)) or scaler.scale != config["init_scale"]:
            raise AssertionError(f"{type(scaler).__name__}(init_scale={config['init_scale']:g}).scale is "
                                 f"{getattr(scaler, 'scale', None)!r}; expected {config['init_scale']:g}")
        got = []
        for overflow in pattern:
            grad = torch.ones(5, dtype=torch.float16)
            if overflow:
                grad[2] = float("inf")
            scaler.unscale([grad])
            scaler.update()
            got.append(float(scaler.scale))
        out.append(got)
    gather_object(True)  # a collective of the check's own: no rank returns while another is still starting up
    return out


def _expected_schedule(config, pattern):
    scale, clean, out = config["init_scale"], 0, []
    for overflow in pattern:
        if overflow:
            scale, clean = scale * config["backoff_factor"], 0
        else:
            clean += 1
            if clean == config["growth_interval"]:
                scale, clean = scale * config["growth_factor"], 0
        out.append(scale)
    return out


SCHEDULES = [
    (dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
     [0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]),
    (dict(init_scale=2.0**10, growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
     [1, 0, 0, 0, 0, 1, 0, 1, 0, 0]),
]


def check_scale_schedule(cls, world_size=2, schedules=None, timeout=60.0):
    """The scale over a sequence of clean and overflow steps: x backoff_factor at each overflow, x growth_factor
    after growth_interval clean steps in a row, the count of clean steps restarting after either."""
    __tracebackhide__ = True
    _check_scaler_class(cls)
    schedules = schedules or SCHEDULES
    results = run_on_ranks(_schedule_case, world_size, args=(cls, schedules), timeout=timeout,
                           what=f"{cls.__name__}'s loss scale")[0]
    for (config, pattern), got in zip(schedules, results):
        want = _expected_schedule(config, pattern)
        if got == want:
            continue
        k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        before = want[k - 1] if k else config["init_scale"]
        steps = "".join("X" if o else "." for o in pattern[:k + 1])
        setup = ", ".join(f"{name}={value:g}" for name, value in config.items())
        if pattern[k]:
            why = (f"an overflow must multiply the scale by backoff_factor ({config['backoff_factor']:g}): "
                   f"{before:g} -> {want[k]:g}")
        elif want[k] != before:
            why = (f"after growth_interval = {config['growth_interval']} clean steps in a row the scale must "
                   f"grow by growth_factor ({config['growth_factor']:g}): {before:g} -> {want[k]:g}")
        else:
            why = (f"no change was due: the scale grows only after {config['growth_interval']} clean steps in a "
                   "row, counted again from 0 after an overflow and after each growth")
        raise CheckFailed(f"{cls.__name__}({setup}): after steps {steps} (X = overflow, . = clean) the scale is "
                          f"{got[k]:g}, expected {want[k]:g}: {why}.\n  whole sequence: expected {want}, got {got}")
    passed(f"{cls.__name__}: backoff on every overflow, growth after growth_interval clean steps, "
           f"{sum(len(p) for _, p in schedules)} steps of {len(schedules)} schedules on {world_size} ranks")


# ---------------------------------------------------------------------------------------
# exercise (b): the master-weight update


def _check_optimizer_class(cls):
    check_class(cls, "your optimizer class",
                refuse=[(c, "the exercise is to write the master-weight update yourself (keep the scaffold's base "
                         "class)") for c in (zerokit_ddp.DistributedAdam, zerokit_zero1.ZeRO1Adam)])


def _state(opt, attr, i, name):
    seq = getattr(opt, attr, None)
    if not isinstance(seq, (list, tuple)):
        raise AssertionError(f"self.{attr} is {type(seq).__name__}; keep the scaffold's layout: a list with one "
                             f"fp32 tensor per trainable parameter, in the order of self.params")
    if i >= len(seq):
        raise AssertionError(f"self.{attr} has {len(seq)} entries, the model {i + 1}+ trainable parameters")
    t = seq[i]
    if not isinstance(t, torch.Tensor):
        raise AssertionError(f"self.{attr}[{i}] ({name}) is a {type(t).__name__}, not a tensor")
    if t.dtype != torch.float32:
        raise AssertionError(
            f"self.{attr}[{i}] ({name}) is {t.dtype}: the master weights and Adam's m and v must be fp32. An "
            "update η·m̂/√v̂ of ~1e-3 is a fraction of a unit in the last place of a bf16 weight (2**-9 = 0.002 "
            "between 0.25 and 0.5): 16-bit masters lose or distort most updates")
    return t


def _scaler_for(dtype):
    """The scaler the optimizer checks hand the optimizer: a loss scale S != 1 in every format (fp16
    needs one; for bf16 S = 2**8 is exact and changes nothing), so that Adam fed g·S or g/S (the
    gradient still scaled, or unscaled twice) differs from AdamW fed g, by a factor the reason can name."""
    fp16 = dtype == torch.float16
    return ReferenceScaler(init_scale=2.0**10 if fp16 else 2.0**8, growth_factor=2.0 if fp16 else 1.0,
                           growth_interval=1000)


def _step_counts(opt):
    """A copy of the optimizer's step count(s) `self.steps` (an int, or one per parameter), or None."""
    steps = getattr(opt, "steps", None)
    if isinstance(steps, (int, float)) and not isinstance(steps, bool):
        return steps
    if isinstance(steps, (list, tuple)) and all(isinstance(t, (int, float)) for t in steps):
        return list(steps)
    return None


def _scaled_by(got, want, scale):
    """'S' if `got` is `want` times the loss scale, '1/S' if it is `want` divided by it, else None:
    the factor a gradient still scaled (or unscaled twice) leaves on Adam's m."""
    if scale == 1 or not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return None
    g, w = got.detach().double().reshape(-1), want.detach().double().reshape(-1)
    norm = float((w * w).sum())
    if norm == 0 or not bool(torch.isfinite(g).all()):
        return None
    ratio = float((g * w).sum()) / norm
    for name, factor in (("S", scale), ("1/S", 1 / scale)):
        if abs(ratio / factor - 1) < 1e-2 and float(((g - factor * w) ** 2).sum()) < 1e-4 * factor**2 * norm:
            return name
    return None


def _wrong_gradient(opt, named, reference, ref_params, scale, when):
    """The reason when Adam was fed the gradient times S or over S (m measured against AdamW's), or None."""
    for i, ((n, _), rp) in enumerate(zip(named, ref_params)):
        seq = getattr(opt, "exp_avgs", None)
        ref_m = reference.state[rp].get("exp_avg") if rp in reference.state else None
        if ref_m is None or not isinstance(seq, (list, tuple)) or i >= len(seq):
            continue
        factor = _scaled_by(seq[i], ref_m, scale)
        if factor == "S":
            return (f"{when}: m of {n} (self.exp_avgs[{i}]) is S = {scale:g} times AdamW's: Adam was fed the "
                    "gradient still multiplied by the loss scale. Backward computed the gradient of loss·S; feed "
                    "adamw_update_ the fp32 gradients that self.scaler.unscale(...) returned (`grads` in the "
                    "scaffold, g / S), not p.grad. (Adam's update m̂/(√v̂ + ε) notices a constant factor on the "
                    "gradient only through ε, so the weights look almost right while m and v are off by S and S²)")
        if factor == "1/S":
            return (f"{when}: m of {n} (self.exp_avgs[{i}]) is 1/S = 1/{scale:g} of AdamW's: the gradient was "
                    "divided by the loss scale twice. The scaffold's self.scaler.unscale(...) already returns "
                    "g·S / S = g (`grads`); do not unscale it again, nor divide by self.scaler.scale")
    return None


def _branch_used(step):
    """Whether BranchNet ("branch") runs its branch in `step`, on every rank alike: it sits out the
    second step of every three, so its parameters' step counts fall behind the others'."""
    return step % 3 != 1


def _forward(model, name, x, step):
    return model(x, use_branch=_branch_used(step)) if name == "branch" else model(x)


def _sat_out(opt, named, ref_params, history, step, when):
    """The reason when a parameter that had no gradient in an earlier step is off after this one,
    and the bias correction with one count for every parameter explains it; else None."""
    for i, ((n, _), rp) in enumerate(zip(named, ref_params)):
        missed = [t + 1 for t in range(step) if n not in history[t]]
        if not missed or n not in history[step]:
            continue
        masters = getattr(opt, "masters", None)
        master = masters[i] if isinstance(masters, (list, tuple)) and i < len(masters) else None
        if isinstance(master, torch.Tensor) and master.shape == rp.shape and \
                not torch.allclose(master, rp.detach(), rtol=1e-5, atol=1e-6):
            count = step + 1 - len(missed)
            diff = float((master.double() - rp.detach().double()).abs().max())
            return (f"{when}: the master weights of {n} (self.masters[{i}]) differ from AdamW's (max |difference| "
                    f"{diff:.3g}), and {n} had no gradient in step {', '.join(map(str, missed))}, so AdamW has "
                    f"counted {count} steps for it, not {step + 1}: the bias correction 1 - β**t needs each "
                    "parameter's own count, self.steps[i], advanced only in the steps that parameter has a gradient")
    return None


def _train_case(rank, world_size, cls, name, dtype, steps, inject_at):
    dtype = as_dtype(dtype)
    compare = inject_at is None  # numerics; otherwise the skipped step and its aftermath (the twin)
    model = build_model(name)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    ref_params = [p.detach().clone().requires_grad_(True) for p in params]  # fp32, as built
    reference = _TorchAdamW(ref_params, foreach=False, **HYPER)
    scaler = _scaler_for(dtype)
    opt = cls(model.parameters(), dtype=dtype, scaler=scaler, **HYPER)
    if getattr(opt, "scaler", None) is not scaler:
        raise AssertionError("the optimizer did not keep the scaler it was given (self.scaler = scaler, as in the "
                             "scaffold)")
    if compare:
        _check_built(opt, model, named, ref_params, dtype)
    twin = None if compare else _twin(rank, world_size, cls, name, dtype, steps, inject_at)
    history = []  # per step: the names of the parameters with a gradient
    for step in range(steps):
        x, y = rank_batch(name, step, GLOBAL_BATCH, rank, world_size)
        if x.is_floating_point():
            x = x.to(params[0].dtype)
        loss = model_loss(name, _forward(model, name, x, step).float(), y)
        opt.scale_loss(loss).backward()
        poisoned = step == inject_at and rank == world_size - 1
        if poisoned:
            params[0].grad.view(-1)[0] = float("inf")
        # the gradient the scaffold's step computes: the same all-reduce, on copies
        reduced = [None if p.grad is None else p.grad.detach().clone() for p in params]
        for r in reduced:
            if r is not None:
                dist.all_reduce(r, op=dist.ReduceOp.AVG)
        history.append({n for (n, _), r in zip(named, reduced) if r is not None})
        scale = scaler.scale
        before = [p.detach().clone() for p in params]
        if compare:
            masters_before = [_state(opt, "masters", i, n).clone() for i, (n, _) in enumerate(named)]
        else:
            state_before = _held_state(opt)
            counts_before = _step_counts(opt)
        updates = scaler.updates
        opt.step()
        opt.zero_grad()
        when = f"step {step + 1}"
        if scaler.updates != updates + 1:
            raise AssertionError(f"{when}: step() called self.scaler.update() {scaler.updates - updates} times; "
                                 "call it exactly once per step (after unscale), and skip the update when it "
                                 "returns False")
        overflow = not all(bool(torch.isfinite(r).all()) for r in reduced if r is not None)
        if not compare:
            changed = [n for (n, p), b in zip(named, before) if not torch.equal(p.detach(), b)]
            if overflow:
                who = f"rank {world_size - 1}'s gradient of {named[0][0]} held an inf"
                moved = [f"parameter {n}" for n in changed[:2]] + [
                    f"self.{attr}[{i}]" for attr, i, t in state_before
                    if not torch.equal(getattr(opt, attr)[i], t)][:2]
                if moved:
                    raise AssertionError(
                        f"{when}: {who}, yet your optimizer changed {', '.join(moved)} on rank {rank}: on an "
                        "overflow step nothing may change (weights, masters, m, v, the step count): return from "
                        "step() when self.scaler.update() returns False")
                counts = _step_counts(opt)
                if counts_before is not None and counts != counts_before:
                    raise AssertionError(
                        f"{when} was skipped ({who}), yet your step count self.steps advanced on it on rank "
                        f"{rank}: {_show(counts_before)} -> {_show(counts)}. A skipped step is not a step: count "
                        "it only after self.scaler.update() returned True, or the bias correction "
                        "m̂ = m / (1 - β1**t) of every later step uses a t one too large")
                if scaler.scale != scale * 0.5:
                    raise AssertionError(f"{when}: an overflow, and the scale went {scale:g} -> {scaler.scale:g}")
            elif not changed:
                raise AssertionError(f"{when}: no inf or nan on any rank, yet no parameter changed on rank {rank}: "
                                     "step when self.scaler.update() returns True")
            elif step > inject_at:
                _same_as_twin(opt, named, twin[step], step, inject_at)
            continue
        if overflow:
            raise AssertionError(f"{when}: the gradient overflowed without an injected inf (the check's data should "
                                 "not do that); is the loss scaled once, by opt.scale_loss?")
        for rp, r in zip(ref_params, reduced):
            rp.grad = None if r is None else r.float() / scale
        with torch_adam_allowed():  # no student code runs inside
            reference.step()
        try:
            _compare_step(opt, named, ref_params, reference, masters_before, dtype, step, when)
        except AssertionError as exc:
            raise AssertionError(_wrong_gradient(opt, named, reference, ref_params, scale, when)
                                 or _sat_out(opt, named, ref_params, history, step, when) or str(exc)) from None
    return sum(p.numel() for p in params)


def _compare_step(opt, named, ref_params, reference, masters_before, dtype, step, when):
    """After a step: the masters, m and v against AdamW's, and each 16-bit weight its master rounded."""
    for i, ((n, p), rp) in enumerate(zip(named, ref_params)):
        master = _state(opt, "masters", i, n)
        if i == 0 and step == 0 and torch.equal(master, masters_before[i]):
            raise AssertionError(
                f"{when}: the master weights of {n} (self.masters[{i}]) did not change: apply the AdamW "
                "update to the fp32 masters (adamw_update_(self.masters[i], grad, ...)), then copy each "
                "master into its 16-bit parameter")
        assert_close(master, rp.detach(), f"the master weights of {n} (self.masters[{i}]) after {when}")
        for attr, key, what in (("exp_avgs", "exp_avg", "m"), ("exp_avg_sqs", "exp_avg_sq", "v")):
            ref_state = reference.state[rp].get(key, torch.zeros_like(rp))  # zeros: never had a gradient
            assert_close(_state(opt, attr, i, n), ref_state, f"{what} of {n} (self.{attr}[{i}]) after {when}",
                         atol=1e-5 * float(ref_state.abs().max()) + 1e-12, rtol=1e-4)
        if p.dtype != dtype or not torch.equal(p.detach(), master.to(dtype)):
            raise AssertionError(
                f"{when}: parameter {n} is not its master weights rounded to {dtype} (max |difference| "
                f"{float((p.detach().double() - master.double()).abs().max()):.3g}): after updating the fp32 "
                "master, copy it into the 16-bit parameter (p.copy_(master)); the model computes with those")


def _check_built(opt, model, named, initial, dtype):
    """Right after __init__: every parameter, frozen ones too, is 16-bit, and each master holds the
    fp32 weights as built (`initial`), not the weights already rounded to 16 bits."""
    for n, p in model.named_parameters():
        if p.dtype != dtype:
            frozen = ("; it is frozen (requires_grad=False), and frozen ones too must be 16-bit: the model "
                      "computes in one type, and an fp32 layer among 16-bit ones fails on their outputs"
                      if not p.requires_grad else "")
            raise AssertionError(f"parameter {n} is {p.dtype} after the optimizer was built; the model computes in "
                                 f"{dtype}: make every parameter of the param groups 16-bit (p.data = "
                                 f"p.data.to(dtype)) after taking the fp32 master copies{frozen}")
    for i, ((n, _), want) in enumerate(zip(named, initial)):
        master = _state(opt, "masters", i, n)
        rounded = want.detach().to(dtype).float()
        if not torch.equal(master, want.detach()) and not torch.equal(rounded, want.detach()) \
                and master.shape == rounded.shape and torch.equal(master, rounded):
            raise AssertionError(
                f"right after the optimizer was built, the master weights of {n} (self.masters[{i}]) hold the "
                f"weights rounded to {dtype}, not the fp32 weights the model was built with: the master copy was "
                "taken after the cast to 16 bits. Take it first (p.detach().float().clone()), then make the "
                "parameter 16-bit: a master is the one place the bits the 16-bit type rounds away survive")


def _show(counts):
    if isinstance(counts, list) and len(counts) > 6:
        return "[" + ", ".join(f"{c:g}" for c in counts[:6]) + ", ...]"
    return str(counts)


def _twin(rank, world_size, cls, name, dtype, steps, skipped):
    """What the student's optimizer holds after each step when step `skipped` never happens:
    [(parameters, _held_state) or None for the skipped step]. The twin's scale backs off where the
    run's does (the scaler is not what this check judges), so that a factor S the optimizer gets
    wrong (check_numerics' point) is the same in both runs."""
    model = build_model(name)
    params = [p for p in model.parameters() if p.requires_grad]
    scaler = _scaler_for(dtype)
    opt = cls(model.parameters(), dtype=dtype, scaler=scaler, **HYPER)
    out = []
    for step in range(steps):
        if step == skipped:  # not a skipped step: no step at all, as if that batch never came
            scaler.back_off()  # ... but the scale backs off as the run's did
            out.append(None)
            continue
        x, y = rank_batch(name, step, GLOBAL_BATCH, rank, world_size)
        if x.is_floating_point():
            x = x.to(params[0].dtype)
        opt.scale_loss(model_loss(name, _forward(model, name, x, step).float(), y)).backward()
        opt.step()
        opt.zero_grad()
        out.append(([p.detach().clone() for p in params], _held_state(opt)))
    return out


def _same_as_twin(opt, named, record, step, skipped):
    """After step `step` (> skipped), the weights, masters, m and v are what the twin (trained without
    the skipped step) holds after the same step."""
    twin_params, twin_state = record
    when = f"after step {step + 1} (step {skipped + 1} was skipped: an inf in its gradient)"
    why = (f": a skipped step must leave no trace, and your optimizer differs from the same optimizer trained "
           f"without step {skipped + 1} at all. Return from step() before changing anything when "
           "self.scaler.update() returns False: not the weights, masters, m or v, and not the step count t "
           "(m̂ = m / (1 - β1**t) of every later step depends on it)")
    try:
        for (n, p), expected in zip(named, twin_params):
            assert_close(p.detach(), expected, f"parameter {n} {when}")
        for attr, i, expected in twin_state:
            seq = getattr(opt, attr, None)
            got = seq[i] if isinstance(seq, (list, tuple)) and i < len(seq) else None
            assert_close(got, expected, f"self.{attr}[{i}] {when}",
                         atol=1e-5 * float(expected.abs().max()) + 1e-12, rtol=1e-4)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{why}") from None


def _held_state(opt):
    """(attr, index, copy) of every tensor in the optimizer's state lists, whatever their dtype."""
    out = []
    for attr in ("masters", "exp_avgs", "exp_avg_sqs"):
        seq = getattr(opt, attr, None)
        if isinstance(seq, (list, tuple)):
            out += [(attr, i, t.detach().clone()) for i, t in enumerate(seq) if isinstance(t, torch.Tensor)]
    return out


def _train_cases(rank, world_size, cls, names, dtype, steps, inject_at):
    psis = []
    for name in names:
        try:
            psis.append(_train_case(rank, world_size, cls, name, dtype, steps, inject_at))
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}" if len(names) > 1 else str(exc)) from None
    return psis


def check_numerics(cls, world_size=2, model="mlp", dtype="bf16", steps=4, timeout=60.0):
    """On world_size ranks: once built, every parameter (frozen ones too) is 16-bit and the masters hold the fp32
    weights as built; fp32 masters, m and v after every step match torch.optim.AdamW in fp32 fed the same mean,
    unscaled gradient (zeros for m and v of a parameter that never had one); the model's weights are the masters
    rounded to 16 bits. `model`: a zoo name, or several run in one launch; on "branch" the branch sits out every
    third step (from the second), so the step counts differ per parameter."""
    __tracebackhide__ = True
    _check_optimizer_class(cls)
    names = (model,) if isinstance(model, str) else tuple(model)
    psis = run_on_ranks(_train_cases, world_size, args=(cls, names, dtype, steps, None), timeout=timeout,
                        what=cls.__name__)[0]
    models = ", ".join(f"{n}, Ψ = {psi}" for n, psi in zip(names, psis))
    passed(f"{cls.__name__} in {dtype} on {world_size} ranks ({models}): every parameter {dtype} once "
           f"built (frozen ones too), the masters the weights as built; fp32 masters, m and v match torch.optim.AdamW "
           f"after each of {steps} steps; the 16-bit weights are the rounded masters")


def check_overflow_step(cls, world_size=2, model="mlp", dtype="fp16", steps=4, inject_at=1, timeout=60.0):
    """An inf in the last rank's gradient at step inject_at + 1: no weight, master, m or v changes on any rank
    in that step, update() is called once (the scale halves), the other steps do update, and each step after
    the skipped one leaves what the same optimizer holds when trained without that step."""
    __tracebackhide__ = True
    _check_optimizer_class(cls)
    psi = run_on_ranks(_train_case, world_size, args=(cls, model, dtype, steps, inject_at), timeout=timeout,
                       what=cls.__name__)[0]
    passed(f"{cls.__name__} on {world_size} ranks ({model}, Ψ = {psi}, {dtype}): an inf on rank {world_size - 1} "
           f"at step {inject_at + 1} skipped that step everywhere and halved the scale; the other {steps - 1} steps "
           "updated, those after it as if the skipped step never happened")


check_master_update = alias(check_numerics, "check_master_update")
