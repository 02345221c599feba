r"""Checks for lesson 01 (Adam by hand): the update, the optimizer contract, zero_grad, memory.

    check_numerics(cls, model)       every parameter AND m, v, step after every one of many
                                     steps, against torch.optim.AdamW (a separate process)
    check_contract(cls, model)       what makes it a PyTorch optimizer: param groups, an LR
                                     scheduler, a state_dict() round trip, a parameter whose
                                     .grad is None left alone, its step counted on its own
    check_zero_grad(cls, model)      zero_grad clears NaN and inf (the `grad *= 0` bug)
    check_memory(fn, models)         the 2Ψ + 2Ψ + KΨ formula against the bytes
                                     zerokit.census measures on real models
    check_loss_curve(fn)             the optional exercise (no points): prints ✓ or why, never raises

One bug costs one check. The numerics clear gradients with the base class's zero_grad, so a
broken zero_grad only fails check_zero_grad. The contract compares the student's class with
*itself*, in a set-up where the feature is trivially right (two optimizers instead of two
groups, one long run instead of a save and reload, a separate optimizer for the parameter
that sometimes has no gradient), so a wrong update formula fails the numerics only.

The exercise re-implements zerokit.Adam and zerokit.theory_bytes; inside a check they
raise instead of working, and the harness turns torch.optim.Adam/AdamW into tripwires.
The reference trajectory comes from a separate launch in which torch.optim.AdamW works.
"""

import io

import torch

from .. import adam as zerokit_adam
from .. import memory as zerokit_memory
from .. import multi_tensor as zerokit_multi_tensor
from ..models import OddMLP, build_model, model_loss
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks
from .kit import ADAM_HYPER, adamw_reference, alias, batch_backward, check_class, global_batch, refusing, snapshot

__all__ = ["check_numerics", "check_contract", "check_zero_grad", "check_memory", "check_loss_curve"]

_ONE_PROCESS = "n/a: MyAdam runs in one process, on whole parameters: no rank, shard, group or bucket exists"
_NO_UNITS = "n/a: an optimizer sees parameters and gradients, never the modules' forward or their outputs"
# which of kit.SITUATIONS the hidden tests meet (tests/test_situations.py holds this to them)
SITUATIONS = {
    "frozen": "check_numerics: edge",
    "tied": "check_numerics: edge",
    "unused": "check_numerics: edge",
    "sits-out": "check_contract: sometimes",  # a parameter with a gradient every third step only
    "zero-grad-shard": _ONE_PROCESS,
    "subgroup": _ONE_PROCESS,
    "n3": _ONE_PROCESS,
    "out-of-order": _ONE_PROCESS,
    "zero3": _ONE_PROCESS,
    "tuple-output": _NO_UNITS,
    "root-params": _NO_UNITS,
    "eval-no-grad": _NO_UNITS,
    "fp16-scale": "n/a: lesson 01 trains in float32; the loss scale arrives with mixed precision in lesson 06",
    "peak-memory": "n/a: lesson 01's memory exercise is a formula (model_state_bytes), not code that allocates",
}

BATCH = 12
SEED = 1  # the model's initialisation, and its data stream (STREAM) as zerokit.reference numbers it
STREAM = 10_000 * SEED
HYPER = dict(ADAM_HYPER, weight_decay=0.01)
CATEGORIES = ("parameters", "gradients", "optimizer_states")

# zerokit's own answers to the exercises refuse to work inside a check (zerokit.Adam's step
# calls adamw_update_, so refusing the function refuses the class too)
NO_ZEROKIT_ADAM = [(zerokit_adam, "adamw_update_", "your code used zerokit's Adam (zerokit.Adam or "
                    "zerokit.adamw_update_): the exercise is to write the update yourself"),
                   (zerokit_multi_tensor, "adamw_multi_tensor_", "your code used zerokit's multi-tensor Adam "
                    "(zerokit.multi_tensor): the exercise is to write the update yourself")]
NO_ZEROKIT_THEORY = (zerokit_memory, "theory_bytes", "your code called zerokit.theory_bytes: the exercise is "
                     "to write the formula yourself")


# ---------------------------------------------------------------------------------------
# shared pieces


def _check_class(cls):
    check_class(cls, "your optimizer class",
                refuse=[(c, "the exercise is to write Adam yourself (subclass torch.optim.Optimizer, as the "
                         "scaffold does)") for c in (zerokit_adam.Adam, torch.optim.Adam, torch.optim.AdamW)],
                base_hint="keep the scaffold's base class (param groups, state_dict and LR schedulers come from it)")


def _hyper(lr, betas, eps, weight_decay):
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


def _step(model, opts, kind, step):
    """Forward and backward on the batch of `step`, then step every optimizer and clear the
    gradients with the base class's zero_grad (the student's own is check_zero_grad's business)."""
    batch_backward(model, step, kind, BATCH, STREAM)
    for opt in opts:
        opt.step()
        torch.optim.Optimizer.zero_grad(opt, set_to_none=True)


def _is_close(actual, expected, **tol):
    try:
        assert_close(actual, expected, "", **tol)
        return True
    except AssertionError:
        return False


# ---------------------------------------------------------------------------------------
# numerics: the student's class against torch.optim.AdamW


def _own_average(before, grad, beta, square):
    """What a moving average holds after this step if it is updated right from the student's own
    gradient (before: its value before the step, None on the first step)."""
    g = grad.double()
    g = g * g if square else g
    return g * (1 - beta) if before is None else before.double() * beta + g * (1 - beta)


def _state_problem(opt, model, record, after, own):
    """What is wrong with m, v and step in opt.state, compared with AdamW's record; None if nothing.

    own: {name: (m before, v before, gradient)} of this step, from the student's own run, to tell
    a moving average kept wrong from a right one of a gradient that already differed."""
    b1, b2 = own["betas"]
    for n, p in model.named_parameters():
        if n not in record["step"]:
            continue
        ref_m, ref_v, ref_step = record["exp_avg"][n], record["exp_avg_sq"][n], record["step"][n]
        s = opt.state.get(p) if isinstance(opt.state, dict) else None
        if not s:
            return (f"{after} opt.state[p] of parameter {n} is empty: keep m, v and the step count in "
                    "self.state[p] under the keys 'exp_avg', 'exp_avg_sq' and 'step', as torch.optim.AdamW does")
        missing = [k for k in ("exp_avg", "exp_avg_sq", "step") if k not in s]
        if missing:
            return f"{after} opt.state[p] of parameter {n} has keys {sorted(s)}; missing {missing}"
        step = int(s["step"]) if isinstance(s["step"], (int, float, torch.Tensor)) else s["step"]
        if step != ref_step:
            return (f"{after} opt.state[p]['step'] of parameter {n} is {step!r}, expected {ref_step}: count this "
                    "parameter's updates, 1, 2, 3, ... (the t of the bias correction 1 - beta**t)")
        for key, ref, what, beta, square in (("exp_avg", ref_m, "m", b1, False), ("exp_avg_sq", ref_v, "v", b2, True)):
            mine = s[key]
            if not isinstance(mine, torch.Tensor):
                return f"opt.state[p]['{key}'] of parameter {n} is a {type(mine).__name__}, not a tensor"
            if mine.shape == ref.shape and ref.abs().max() > 0 and not mine.detach().abs().max() > 0:
                return (f"{after} {what} of parameter {n} (opt.state[p]['{key}']) is still all zeros: `{what} = "
                        f"beta * {what} + ...` binds the local name {what} to a new tensor and the stored one never "
                        f"changes. Update it in place ({what}.mul_(beta).add_(...))")
            try:
                assert_close(mine, ref, f"{what} of parameter {n} (opt.state[p]['{key}']) {after}",
                             atol=1e-6 * float(ref.abs().max()) + 1e-12, rtol=1e-4)
            except AssertionError as exc:
                m0, v0, grad = own["state"].get(n, (None, None, None))
                kept_right = grad is not None and _is_close(
                    mine, _own_average(m0 if key == "exp_avg" else v0, grad, beta, square).float(),
                    atol=1e-7 * float(ref.abs().max()) + 1e-12, rtol=1e-5)
                if kept_right:  # the average is right; the gradient it averaged was not AdamW's
                    why = (f"your {what} is the right moving average of the gradients your model produced, but "
                           "those differ from AdamW's: after the step before, your weights were already slightly "
                           "off (by less than the tolerance on weights)")
                    if own["slip"]:
                        slip = own["slip"]
                        return f"{slip[0].upper()}{slip[1:]}. It first shows here: {exc} ({why})"
                    return f"{exc}: {why}. {_STEP_FORMULA}"
                return (f"{exc}: store the raw moving averages m_t and v_t (the bias correction only enters "
                        "the step, never the stored state)")
    return None


_STEP_FORMULA = ("Look at how your step turns m and v into the update: θ ← θ(1 - lr·λ), then "
                 "θ ← θ - lr·m̂/(sqrt(v̂) + eps)")


def _update_mistake(prev, p, state, hyper):
    """Which classic mistake turns the right m, v and t into this parameter value? None if none.

    The candidate closest to the parameter wins, the right update among them: a mistake is named
    only when it explains the value clearly better (by 4x) than AdamW's own update does, so a
    mistake that moves a weight by less than the tolerance (weight decay after the step moves it
    by lr²·λ·|step|) is still recognised, and a right update written another way is not."""
    lr, (b1, b2), eps, wd = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    try:
        t = int(state["step"])
        prev, m, v = prev.double(), state["exp_avg"].double(), state["exp_avg_sq"].double()
    except (KeyError, TypeError, AttributeError, ValueError, RuntimeError):
        return None
    if t < 1 or m.shape != prev.shape or v.shape != prev.shape:
        return None
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    decayed = prev * (1 - lr * wd)
    adam_step = lr * m_hat / (v_hat.sqrt() + eps)
    candidates = [
        (decayed - adam_step, None),  # AdamW itself
        (decayed - lr * m / (v.sqrt() + eps),
         "your step matches Adam WITHOUT bias correction: use m̂ = m / (1 - beta1**t) and v̂ = v / (1 - beta2**t) "
         "in the step (t = this parameter's step count, from 1)"),
        (decayed - lr * m_hat / (v_hat + eps).sqrt(),
         "your step matches sqrt(v̂ + eps): eps belongs outside the square root, sqrt(v̂) + eps"),
        (prev * (1 - wd) - adam_step,
         "your step matches a weight decay of θ(1 - λ): AdamW scales it by the learning rate, θ(1 - lr·λ)"),
        (prev - adam_step,
         "your step matches Adam without weight decay: AdamW first shrinks the weights, θ ← θ(1 - lr·λ)"),
        ((prev - adam_step) * (1 - lr * wd),
         "your step matches the weight decay after the Adam step, which shrinks the step too: AdamW decays the "
         "weights first, θ ← θ(1 - lr·λ), then subtracts lr·m̂/(sqrt(v̂) + eps)"),
    ]
    got = p.detach().double()
    if got.shape != prev.shape:
        return None
    distances = [float((got - value).abs().max()) if got.numel() else 0.0 for value, _ in candidates]
    best = min(range(len(candidates)), key=lambda i: (distances[i], i))
    if best == 0 or not distances[best] * 4 < distances[0]:
        return None
    value, hint = candidates[best]
    return hint if _is_close(p, value.float(), atol=1e-7, rtol=1e-5) else None


def _slip(model, opt, before, hyper):
    """The first classic mistake the update of this step shows on any parameter, or None."""
    state = opt.state if isinstance(opt.state, dict) else {}
    for n, p in model.named_parameters():
        s = state.get(p)
        if isinstance(s, dict) and n in before:
            mistake = _update_mistake(before[n], p, s, hyper)
            if mistake:
                return mistake
    return None


def _own_state(opt, model):
    """{name: (m, v)} copies of the student's state before a step (None where there is none yet)."""
    state = opt.state if isinstance(opt.state, dict) else {}
    out = {}
    for n, p in model.named_parameters():
        s = state.get(p)
        ok = isinstance(s, dict) and all(isinstance(s.get(k), torch.Tensor) for k in ("exp_avg", "exp_avg_sq"))
        out[n] = (s["exp_avg"].detach().clone(), s["exp_avg_sq"].detach().clone()) if ok else (None, None)
    return out


def _numerics_case(rank, world_size, cls, kind, steps, hyper, reference):
    with refusing(*NO_ZEROKIT_ADAM, everywhere=True):
        model = build_model(kind, SEED)
        opt = cls(model.parameters(), **hyper)
        slip = None  # the first mistake an update showed, even one too small to fail a comparison yet
        for step in range(steps):
            before = snapshot(model)
            state_before = _own_state(opt, model)
            batch_backward(model, step, kind, BATCH, STREAM)
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
            torch.optim.Optimizer.zero_grad(opt, set_to_none=True)  # the student's own is check_zero_grad's
            slip = slip or _slip(model, opt, before, hyper)
            after = f"after step {step + 1}"
            own = {"betas": hyper["betas"], "slip": slip,
                   "state": {n: (*state_before[n], g) for n, g in grads.items()}}
            problem = _state_problem(opt, model, reference["adamw"][step], after, own)
            for n, p in model.named_parameters():
                try:
                    assert_close(p, reference["adamw"][step]["params"][n], f"parameter {n} {after}")
                except AssertionError as exc:
                    hint = _hint(step, n, model, opt, before, problem, slip, hyper, reference)
                    raise AssertionError(f"{exc} — {hint}") from None  # one line: what nbgrader's feedback shows
            if problem:
                raise AssertionError(problem)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _hint(step, name, model, opt, before, problem, slip, hyper, reference):
    if step < len(reference["l2"]) and all(_is_close(p, reference["l2"][step]["params"][n])
                                           for n, p in model.named_parameters()):
        return ("your parameters match torch.optim.Adam with weight_decay, which adds λθ to the gradient (L2). "
                "AdamW decouples it: θ ← θ(1 - lr·λ), applied to the weights directly, then the Adam step")
    if slip:
        return slip
    if problem:
        return problem
    p = dict(model.named_parameters())[name]
    mistake = _update_mistake(before[name], p, opt.state[p], hyper)
    return mistake or ("m, v and step match torch.optim.AdamW's, so the mistake is in turning them into the step: "
                       "θ ← θ(1 - lr·λ), then θ ← θ - lr·m̂/(sqrt(v̂) + eps)")


def check_numerics(cls, model="mlp", steps=100, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                   timeout=60.0):
    """cls(params, lr=, betas=, eps=, weight_decay=) matches torch.optim.AdamW step by step: every
    parameter after every step, and m, v and the step count in opt.state[p]."""
    __tracebackhide__ = True
    _check_class(cls)
    hyper = _hyper(lr, betas, eps, weight_decay)
    # and torch.optim.Adam's L2 decay for two steps, to recognise that mistake
    data = (model, BATCH, STREAM)
    reference = {"adamw": adamw_reference(model, steps, hyper, batch_backward, data, seed=SEED, timeout=timeout),
                 "l2": adamw_reference(model, 2, hyper, batch_backward, data, seed=SEED, optimizer="adam",
                                       timeout=timeout)}
    psi = run_on_ranks(_numerics_case, 1, args=(cls, model, steps, hyper, reference), timeout=timeout,
                       what=cls.__name__)[0]
    passed(f"{cls.__name__} matches torch.optim.AdamW on {model} (Ψ = {psi}, lr {lr:g}, betas {tuple(betas)}, "
           f"eps {eps:g}, weight decay {weight_decay:g}): every parameter, m, v and step after each of {steps} steps")


# ---------------------------------------------------------------------------------------
# the optimizer contract: the student's class against itself, feature on and feature off


def _same(got, expected, step, setup, fix):
    for n in expected:
        try:
            assert_close(got[n], expected[n], f"parameter {n} after step {step + 1}")
        except AssertionError as exc:
            raise AssertionError(f"{setup} ({fix}): {exc}") from None


def _groups(cls, kind, hyper):
    def run(split):
        model = build_model(kind, SEED)
        matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        if split:
            opts = [cls(matrices, **{**hyper, "weight_decay": 0.1}),
                    cls(rest, **{**hyper, "lr": hyper["lr"] / 3, "weight_decay": 0.0})]
        else:
            opts = [cls([{"params": matrices, "weight_decay": 0.1},
                         {"params": rest, "lr": hyper["lr"] / 3, "weight_decay": 0.0}], **hyper)]
        out = []
        for step in range(4):
            _step(model, opts, kind, step)
            out.append(snapshot(model))
        return out

    for step, (got, expected) in enumerate(zip(run(split=False), run(split=True))):
        _same(got, expected, step, "with two param groups (weight matrices: weight decay 0.1; the rest: a third of "
              "the lr, no decay) your optimizer differs from two optimizers with one group each",
              "read lr, betas, eps and weight_decay from each group inside step(), not from __init__'s arguments")


def _scheduler(cls, kind, hyper):
    model = build_model(kind, SEED)
    opt = cls(model.parameters(), **hyper)
    factors = [1.0, 0.5, 0.0, 0.0, 1.0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: factors[k % len(factors)])
    for step, factor in enumerate(factors):
        before = snapshot(model)
        _step(model, [opt], kind, step)
        sched.step()
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        if factor == 0 and changed:
            raise AssertionError(f"an LR scheduler (LambdaLR) set the learning rate to 0 for step {step + 1}, yet "
                                 f"your step changed parameter {changed[0]}: a scheduler writes group['lr'], so read "
                                 "it in every step(), don't keep a copy from __init__")


def _state_dict(cls, kind, hyper):
    model = build_model(kind, SEED)
    opt = cls(model.parameters(), **hyper)
    straight = []
    for step in range(6):
        _step(model, [opt], kind, step)
        straight.append(snapshot(model))

    model = build_model(kind, SEED)
    opt = cls(model.parameters(), **hyper)
    for step in range(3):
        _step(model, [opt], kind, step)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    if not loaded["opt"].get("state"):
        raise AssertionError("after 3 steps your optimizer's state_dict() has an empty 'state': keep m, v and the "
                             "step count in self.state[p], where state_dict() and load_state_dict() find them")
    model = build_model(kind, SEED + 7)  # other weights: everything must come from the checkpoint
    model.load_state_dict(loaded["model"])
    opt = cls(model.parameters(), **hyper)
    opt.load_state_dict(loaded["opt"])
    for step in range(3, 6):
        _step(model, [opt], kind, step)
        _same(snapshot(model), straight[step], step, "after state_dict(), torch.save, torch.load and "
              "load_state_dict() into a fresh optimizer, training does not continue as it would have without the "
              "checkpoint", "everything the next step needs, m, v and each parameter's step count, must live in "
              "self.state[p]")


class SometimesNet(torch.nn.Module):
    """OddMLP times `gain`, a parameter used only on steps divisible by 3: on the others its
    .grad is None and AdamW leaves it alone entirely (no weight decay, no moments, no step)."""

    def __init__(self):
        super().__init__()
        self.mlp = OddMLP()
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, 7))

    def forward(self, x, step):
        y = self.mlp(x)
        return y * self.gain if step % 3 == 0 else y


def _sometimes(cls, kind, hyper):
    hyper = {**hyper, "weight_decay": 0.1}

    def run(split):
        torch.manual_seed(SEED)
        model = SometimesNet()
        if split:  # trivially right: gain has its own optimizer, stepped only when gain has a gradient
            opt, gain_opt = cls(model.mlp.parameters(), **hyper), cls([model.gain], **hyper)
        else:
            opt, gain_opt = cls(model.parameters(), **hyper), None
        out = []
        for step in range(7):
            before = model.gain.detach().clone()
            x, y = global_batch("mlp", step, BATCH, STREAM)
            torch.nn.functional.mse_loss(model(x, step), y).backward()
            for o in [opt] + ([gain_opt] if gain_opt and model.gain.grad is not None else []):
                o.step()
                torch.optim.Optimizer.zero_grad(o, set_to_none=True)
            if step % 3 and not torch.equal(model.gain, before):
                raise AssertionError(f"in step {step + 1} parameter gain had no gradient (.grad is None), yet your "
                                     "step changed it: skip a parameter without a gradient entirely (no weight "
                                     "decay, no moment update, no step count), as torch.optim.AdamW does")
            out.append(snapshot(model))
        return out

    for step, (got, expected) in enumerate(zip(run(split=False), run(split=True))):
        _same(got, expected, step, "with a parameter (gain) that gets a gradient only every third step, your "
              "optimizer differs from one where gain has an optimizer of its own", "count steps per parameter "
              "(self.state[p]['step'] is the t of the bias correction), not per call of step()")


SCENARIOS = {"groups": (_groups, "two param groups"), "scheduler": (_scheduler, "an LR scheduler"),
             "state_dict": (_state_dict, "a state_dict round trip"),
             "sometimes": (_sometimes, "a parameter without a gradient, and per-parameter step counts")}


def _contract_case(rank, world_size, cls, kind, hyper, scenarios):
    with refusing(*NO_ZEROKIT_ADAM, everywhere=True):
        for name in scenarios:
            try:
                SCENARIOS[name][0](cls, kind, hyper)
            except AssertionError:
                raise
            except Exception as exc:  # the student's code raised: say in which scenario
                exc.add_note(f"in the {name!r} scenario of the contract check")
                raise
    return True


def check_contract(cls, model="mlp", lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                        scenarios=tuple(SCENARIOS), timeout=60.0):
    """cls behaves as a torch.optim optimizer: param groups, an LR scheduler, a state_dict round
    trip, a parameter whose .grad is None skipped and per-parameter step counts."""
    __tracebackhide__ = True
    _check_class(cls)
    run_on_ranks(_contract_case, 1, args=(cls, model, _hyper(lr, betas, eps, weight_decay), list(scenarios)),
                 timeout=timeout, what=cls.__name__)
    passed(f"{cls.__name__} works as a torch.optim optimizer on {model}: "
           + ", ".join(SCENARIOS[s][1] for s in scenarios))


# ---------------------------------------------------------------------------------------
# zero_grad


def _zero_grad_case(rank, world_size, cls, kind):
    with refusing(*NO_ZEROKIT_ADAM, everywhere=True):
        model = build_model(kind, SEED)
        opt = cls(model.parameters(), **HYPER)
        batches = [global_batch(kind, s, BATCH, STREAM) for s in range(2)]
        fresh = build_model(kind, SEED)  # the gradient of batch 1 alone
        model_loss(kind, fresh(batches[1][0]), batches[1][1]).backward()
        expected = {n: p.grad for n, p in fresh.named_parameters()}

        for set_to_none in (False, True):
            model_loss(kind, model(batches[0][0]), batches[0][1]).backward()
            with torch.no_grad():  # a bad batch: an overflow left NaN and inf in the gradients
                for p in model.parameters():
                    if p.grad is not None and p.grad.numel() >= 2:
                        p.grad.view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
            call = f"zero_grad(set_to_none={set_to_none})"
            opt.zero_grad(set_to_none=set_to_none)
            for n, p in model.named_parameters():
                if p.grad is None:
                    continue
                if set_to_none:
                    raise AssertionError(f"after {call} {n}.grad is a tensor, not None: set_to_none=True (the "
                                         "default) sets p.grad = None")
                if not bool(torch.isfinite(p.grad).all()):
                    raise AssertionError(
                        f"after {call} the gradient of {n}, which held NaN and inf, still holds NaN: NaN × 0 = NaN "
                        "and inf × 0 = NaN, so multiplying by zero does not clear a gradient. Overwrite it "
                        "(p.grad.zero_()) or drop it (p.grad = None)")
                if bool(p.grad.abs().max() > 0):
                    raise AssertionError(f"after {call} the gradient of {n} is not zero (max |g| = "
                                         f"{float(p.grad.abs().max()):.3g}): zero_grad must clear every gradient")
            model_loss(kind, model(batches[1][0]), batches[1][1]).backward()
            for n, p in model.named_parameters():
                if expected[n] is not None:
                    assert_close(p.grad, expected[n], f"the gradient of {n} after {call} and one backward "
                                 "(it must be that batch's gradient alone)")
            torch.optim.Optimizer.zero_grad(opt, set_to_none=True)
    return True


def check_zero_grad(cls, model="edge", timeout=60.0):
    """After a backward that left NaN and inf in the gradients, zero_grad(set_to_none=False) and
    zero_grad() clear them, and the next backward gives that batch's gradient alone."""
    __tracebackhide__ = True
    _check_class(cls)
    run_on_ranks(_zero_grad_case, 1, args=(cls, model), timeout=timeout, what=f"{cls.__name__}.zero_grad")
    passed(f"{cls.__name__}.zero_grad clears gradients that held NaN and inf ({model}), with set_to_none False "
           "and True, and the next backward starts from zero")


# ---------------------------------------------------------------------------------------
# the memory formula


class HandMixedPrecision:
    """Mixed-precision Adam laid out by hand: a bf16 model, fp32 master weights, zerokit.Adam on
    the masters (fp32 m and v): 4 + 4 + 4 = 12 bytes of optimizer state per parameter."""

    def __init__(self, model, lr=1e-3):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().clone().float() for p in self.params]  # before the cast: no rounding
        model.to(torch.bfloat16)
        self.adam = zerokit_adam.Adam(self.masters, lr=lr)
        self.state = self.adam.state

    @torch.no_grad()
    def step(self):
        for p, master in zip(self.params, self.masters):
            master.grad = None if p.grad is None else p.grad.float()
        self.adam.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)
            master.grad = None

    def memory_categories(self):
        """zerokit.census files the fp32 masters under optimizer state."""
        return {"optimizer_states": list(self.masters)}


def measure_model_state(kind="mlp", precision="fp32"):
    """(Ψ, bytes per category) right after one training step (gradients alive), by zerokit.census."""
    model = build_model(kind, SEED)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = zerokit_adam.Adam(model.parameters(), lr=1e-3) if precision == "fp32" else HandMixedPrecision(model)
    x, y = global_batch(kind, 0, BATCH, STREAM)
    if precision == "mixed" and x.is_floating_point():
        x = x.to(torch.bfloat16)
    model_loss(kind, model(x).float(), y).backward()
    opt.step()
    measured = zerokit_memory.census(model, opt, scan=False)
    return psi, {c: measured[c] for c in CATEGORIES}


def _formula(fn, psi, precision):
    out = fn(psi, precision)
    call = f"model_state_bytes({psi}, {precision!r})"
    if not isinstance(out, dict) or any(k not in out for k in CATEGORIES + ("total",)):
        raise AssertionError(f"{call} returned {out!r}; expected a dict with keys {list(CATEGORIES) + ['total']}")
    if any(isinstance(out[k], bool) or not isinstance(out[k], (int, float)) for k in CATEGORIES + ("total",)):
        raise AssertionError(f"{call} returned {out!r}: expected numbers of bytes")
    if out["total"] != sum(out[k] for k in CATEGORIES):
        raise AssertionError(f"{call}: total {out['total']} is not the sum of the three categories "
                             f"({sum(out[k] for k in CATEGORIES)})")
    return out


_LAYOUTS = {"fp32": "fp32 weights (4) + fp32 gradients (4) + Adam's fp32 m and v (8)",
            "mixed": "bf16 weights (2) + bf16 gradients (2) + fp32 master weights, m and v (12)"}


def _bytes_case(rank, world_size, fn, kinds):
    rows = []
    with refusing(NO_ZEROKIT_THEORY, everywhere=True):
        for kind in kinds:
            for precision in ("fp32", "mixed"):
                psi, measured = measure_model_state(kind, precision)
                theirs = _formula(fn, psi, precision)
                for c in CATEGORIES:
                    if theirs[c] != measured[c]:
                        raise AssertionError(
                            f"model_state_bytes({psi}, {precision!r})[{c!r}] = {theirs[c]:g}, but zerokit.census "
                            f"measured {measured[c]} bytes of {c} on the {kind} model (Ψ = {psi}) after a step: "
                            f"{measured[c] / psi:g} bytes per parameter. Layout: {_LAYOUTS[precision]}")
                rows.append((kind, precision, psi, measured))
        for precision in ("fp32", "mixed"):
            total = _formula(fn, 7 * 10**9, precision)["total"]
            if total != 16 * 7 * 10**9:
                raise AssertionError(f"model_state_bytes(7e9, {precision!r})['total'] = {total:g}; a 7B-parameter "
                                     "model holds 16 bytes per parameter: 1.12e+11 bytes (112 GB)")
    return rows


def check_memory(fn, models=("mlp",), timeout=60.0):
    """fn(psi, precision) gives the model-state bytes per category, equal to what zerokit.census
    measures on real models after a step, for "fp32" and "mixed" (bf16 + fp32 masters)."""
    __tracebackhide__ = True
    if not callable(fn):
        raise CheckFailed(f"expected the function model_state_bytes, got {type(fn).__name__}")
    rows = run_on_ranks(_bytes_case, 1, args=(fn, list(models)), timeout=timeout, what="model_state_bytes")[0]
    desc = "; ".join(f"{kind} {precision}: {sum(m.values())} B = {sum(m.values()) // psi} x Ψ"
                     for kind, precision, psi, m in rows)
    passed(f"model_state_bytes matches the bytes zerokit.census measured ({desc}); a 7B model: 112 GB")


# ---------------------------------------------------------------------------------------
# the optional exercise: a loss curve (no points: checked when attempted, and never raises)

CURVE_HYPER = HYPER  # the loss curve trains at the numerics' set


def _reference_curves(steps, make):
    """The loss before each update, training OddMLP from torch.manual_seed(0) on the one batch
    make_batch("mlp", 12, seed=0), as the exercise asks; and the curves of two classic mistakes."""
    from ..models import make_batch

    out = {}
    for name in ("right", "after", "accumulate"):
        torch.manual_seed(0)
        model = OddMLP()
        opt = make(model.parameters())
        losses = []
        x, y = make_batch("mlp", 12, seed=0)
        for step in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if name != "accumulate":
                opt.zero_grad()
            with torch.no_grad():
                losses.append(float(torch.nn.functional.mse_loss(model(x), y)) if name == "after" else loss.item())
        out[name] = losses
    return out


def _curve_case(rank, world_size, fn, steps):
    def make(params):
        return torch.optim.AdamW(params, foreach=False, **CURVE_HYPER)

    theirs = fn(make, steps)
    reference = _reference_curves(steps, make)
    if not isinstance(theirs, (list, tuple)) or len(theirs) != steps:
        return (f"loss_curve(make_optimizer, {steps}) returned {type(theirs).__name__}"
                + (f" of length {len(theirs)}" if isinstance(theirs, (list, tuple)) else "")
                + f": expected a list of {steps} losses, one per step")
    try:
        got = torch.tensor([float(v) for v in theirs], dtype=torch.float64)
    except (TypeError, ValueError):
        return "loss_curve must return numbers (loss.item() of each step's loss)"

    def same(name):
        return bool(torch.allclose(got, torch.tensor(reference[name], dtype=torch.float64), rtol=1e-5, atol=1e-7))

    if same("right"):
        return None
    if same("after"):
        return ("your curve holds each step's loss after the optimizer's step: record the loss you call .backward() "
                "on, before opt.step()")
    if same("accumulate"):
        return ("your curve matches training whose gradients are never cleared: backward adds into .grad, so "
                "call opt.zero_grad() after each opt.step()")
    right = reference["right"]
    first = next(i for i in range(steps) if abs(float(got[i]) - right[i]) > 1e-5 * abs(right[i]) + 1e-7)
    if first == 0:
        return (f"the loss before the first step is {float(got[0]):.6g}, expected {right[0]:.6g}: build OddMLP() right "
                "after torch.manual_seed(0), and train it on make_batch(\"mlp\", 12, seed=0) with F.mse_loss")
    return (f"your losses agree with torch.optim.AdamW's for {first} steps, then differ: at step {first} "
            f"{float(got[first]):.6g}, expected {right[first]:.6g}")


def check_loss_curve(fn, steps=60, timeout=60.0):
    """The optional exercise: loss_curve(make_optimizer, steps) returns the loss before each of
    `steps` updates on one batch. Prints ✓, or ✗ and why, or that it was skipped; never raises (it is
    worth no points), and returns whether it passed."""
    if fn is None:
        print("optional exercise skipped (no loss_curve defined): no points either way")
        return False
    try:
        problem = run_on_ranks(_curve_case, 1, args=(fn, steps), timeout=timeout, forbid_adam=False,
                               what="loss_curve")[0]
    except CheckFailed as exc:
        if "NotImplementedError" in str(exc):
            print("optional exercise skipped (loss_curve is still the stub): no points either way")
            return False
        problem = str(exc).splitlines()[0]
    if problem:
        print(f"✗ optional exercise (no points): {problem}")
        return False
    passed(f"loss_curve reproduces the losses of torch.optim.AdamW training over {steps} steps")
    return True


check_adam_numerics = alias(check_numerics, "check_adam_numerics")
check_adam_contract = alias(check_contract, "check_adam_contract")
check_model_state_bytes = alias(check_memory, "check_model_state_bytes")
