"""Lesson 01's checks, validated on the solution and on deliberately broken Adams.

The solution is the code in solutions/01_adam (the notebook's solution cells, executed
here), so what is validated is what students are graded against. Every broken Adam below
is one classic bug; it must fail exactly the checks listed beside it, with a message that
names the problem, and pass the others: one bug costs its own points only.

| defect | fails | message |
|---|---|---|
| no bias correction | numerics | "WITHOUT bias correction" |
| L2 added to the gradient (torch.optim.Adam's weight_decay) | numerics | "torch.optim.Adam with weight_decay" |
| eps inside the square root | numerics | "eps belongs outside" |
| weight decay after the Adam step | numerics | "weight decay after the Adam step" |
| m rebound, never stored (`m = beta1 * m + ...`) | numerics | "still all zeros" |
| one step count per group, not per parameter | contract | "count steps per parameter" |
| lr read once in __init__ | contract | "two param groups" |
| zero_grad as `grad *= zeros_like(grad)` | zero_grad | "NaN × 0 = NaN" |
| calls torch.optim.AdamW in step() | numerics, contract | "torch.optim.AdamW" |
| calls torch.optim.adam._single_tensor_adam in step() | numerics, contract | "torch's Adam" |
| subclass of zerokit.Adam | numerics, contract, zero_grad | "subclasses zerokit.Adam" |
| wraps zerokit.Adam | numerics, contract | "used zerokit's Adam" |
| a right Adam through zerokit.multi_tensor's update | numerics, contract | "zerokit's multi-tensor Adam" |
| formula with K = 8 in mixed precision | memory | "bytes of optimizer_states" |
| formula from zerokit.theory_bytes | memory | "zerokit.theory_bytes" |
| total not the sum of the categories | memory | "not the sum" |
| the untouched student notebook | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest
import torch

import zerokit
from zerokit.grading import lesson01
from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly

pytestmark = pytest.mark.distributed


# the broken classes below are sent to the check's process by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def notebook_code(folder):
    """The exercise cells of lessons/ or solutions/ 01_adam, executed as one module."""
    return exercise_module("01_adam", folder, ["my_adam", "model_state_bytes"], prelude="import torch\n\n")


SOLUTION = notebook_code("solutions")
STUDENT = notebook_code("lessons")
Solution = SOLUTION.MyAdam



CHECKS = {
    "numerics": lambda cls: lesson01.check_numerics(cls, model="mlp", steps=25),  # the visible test: 100
    "contract": lambda cls: lesson01.check_contract(cls, model="mlp"),
    "zero_grad": lambda cls: lesson01.check_zero_grad(cls, model="edge"),
}


# ---------------------------------------------------------------------------------------
# the untouched notebook (the solution passes every visible and hidden test cell: nbmake
# runs solutions/01_adam end to end, and test_autograde grades it)


@pytest.mark.timeout(60)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(CHECKS, STUDENT.MyAdam)
    fails(lesson01.check_memory, STUDENT.model_state_bytes, match=UNFINISHED)


# ---------------------------------------------------------------------------------------
# broken Adams: AdamW written out once, with a switch per classic bug


class Broken(torch.optim.Optimizer):
    """AdamW, by hand, with the bugs named in BUGS switched on."""

    BUGS = frozenset()

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.init_lr = lr

    @torch.no_grad()
    def step(self, closure=None):
        bug = self.BUGS.__contains__
        for group in self.param_groups:
            lr = self.init_lr if bug("lr_from_init") else group["lr"]
            (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad + wd * p if bug("l2") else p.grad
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] = group["step"] if bug("step_per_group") else state["step"] + 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                if not bug("l2") and not bug("decay_after"):
                    p.mul_(1 - lr * wd)
                if bug("m_rebound"):
                    m = b1 * m + (1 - b1) * g
                else:
                    m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                c1, c2 = (1.0, 1.0) if bug("no_bias_correction") else (1 - b1**t, 1 - b2**t)
                denom = (v / c2 + eps).sqrt() if bug("eps_inside_sqrt") else (v / c2).sqrt() + eps
                p.addcdiv_(m / c1, denom, value=-lr)
                if bug("decay_after"):
                    p.mul_(1 - lr * wd)
                if bug("calls_adamw"):
                    torch.optim.AdamW([p], lr=0.0)
        return None

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if "zero_grad_by_multiplying" in self.BUGS:
                        p.grad *= torch.zeros_like(p.grad)
                    else:
                        p.grad = None


def broken(*bugs):
    return type("_".join(bugs), (Broken,), {"BUGS": frozenset(bugs)})


class CallsSingleTensorAdam(torch.optim.Optimizer):
    """AdamW by torch's own functional form, reached past the module attributes the harness replaces."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        from torch.optim.adam import _single_tensor_adam

        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
            state = [self.state[p] for p in params]
            (b1, b2) = group["betas"]
            _single_tensor_adam(params, [p.grad for p in params], [s["exp_avg"] for s in state],
                                [s["exp_avg_sq"] for s in state], [], [s["step"] for s in state],
                                grad_scale=None, found_inf=None, amsgrad=False, has_complex=False, beta1=b1,
                                beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                                maximize=False, capturable=False, differentiable=False,
                                decoupled_weight_decay=True)
        return None

    def zero_grad(self, set_to_none=True):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


class SubclassesZeroKit(zerokit.Adam):
    pass


class WrapsZeroKit(torch.optim.Optimizer):
    def __init__(self, params, **kw):
        params = list(params)
        super().__init__(params, kw)
        self.inner = zerokit.Adam(params, **kw)

    def step(self, closure=None):
        return self.inner.step(closure)


class CallsZeroKitMultiTensor(torch.optim.Optimizer):
    """Right in every respect, but the update is zerokit's multi-tensor one (what DistributedAdam runs on a GPU)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        from zerokit.multi_tensor import adamw_multi_tensor_

        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
            beta1, beta2 = group["betas"]
            adamw_multi_tensor_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr=group["lr"],
                                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])


DEFECTS = [  # (class, {check that must fail: message fragment}); every other check must pass
    (broken("no_bias_correction"), {"numerics": "WITHOUT bias correction"}),
    (broken("l2"), {"numerics": "torch.optim.Adam with weight_decay"}),
    (broken("eps_inside_sqrt"), {"numerics": "eps belongs outside"}),
    (broken("decay_after"), {"numerics": "weight decay after the Adam step"}),
    (broken("m_rebound"), {"numerics": "still all zeros"}),
    (broken("step_per_group"), {"contract": "count steps per parameter"}),
    (broken("lr_from_init"), {"contract": "two param groups"}),
    (broken("zero_grad_by_multiplying"), {"zero_grad": "NaN × 0 = NaN"}),
    (broken("calls_adamw"), {"numerics": "torch.optim.AdamW", "contract": "torch.optim.AdamW"}),
    (CallsSingleTensorAdam, {"numerics": "torch's Adam", "contract": "torch's Adam"}),
    (SubclassesZeroKit, {name: "subclasses zerokit.Adam" for name in CHECKS}),
    (WrapsZeroKit, {"numerics": "used zerokit's Adam", "contract": "used zerokit's Adam"}),
    (CallsZeroKitMultiTensor, {"numerics": "zerokit's multi-tensor Adam", "contract": "zerokit's multi-tensor Adam"}),
]


def test_the_switchboard_without_bugs_is_adamw(capsys):
    for check in CHECKS.values():
        check(Broken)
    assert capsys.readouterr().out.count("✓") == len(CHECKS)


@pytest.mark.timeout(120)
def test_each_defect_fails_exactly_its_checks(capsys):
    """One test for all of them: the checks' processes start once and the reference is shared."""
    for cls, expected in DEFECTS:
        fails_exactly(CHECKS, cls, expected, capsys)


@pytest.mark.timeout(60)
def test_hidden_configurations_catch_the_same_bugs():
    """The hidden tests' models and hyperparameters find them too."""
    fails(lesson01.check_numerics, broken("no_bias_correction"), model="transformer", steps=30, lr=3e-3,
          betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1, match="WITHOUT bias correction")
    fails(lesson01.check_numerics, broken("eps_inside_sqrt"), model="transformer", steps=30, lr=3e-3,
          betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1, match="eps belongs outside")
    fails(lesson01.check_numerics, broken("l2"), model="edge", steps=20, weight_decay=0.1,
          match="torch.optim.Adam with weight_decay")
    for model, hyper in (("transformer", dict(steps=30, lr=3e-3, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.1)),
                         ("edge", dict(steps=20, weight_decay=0.1))):
        fails(lesson01.check_numerics, broken("decay_after"), model=model, match="weight decay after the Adam step",
              **hyper)
    fails(lesson01.check_numerics, broken("m_rebound"), model="mlp", steps=10, weight_decay=0.0,
          match="still all zeros")
    fails(lesson01.check_contract, broken("lr_from_init"), model="transformer", lr=3e-3, betas=(0.8, 0.95),
          scenarios=("groups", "scheduler", "state_dict"), match="two param groups")
    fails(lesson01.check_zero_grad, broken("zero_grad_by_multiplying"), model="transformer", match="NaN × 0")
    fails(lesson01.check_contract, broken("step_per_group"), model="transformer", lr=3e-3, betas=(0.8, 0.95),
          scenarios=("groups", "scheduler", "state_dict", "sometimes"), match="count steps per parameter")


# ---------------------------------------------------------------------------------------
# the memory formula


def k_is_8_everywhere(psi, precision="fp32"):
    p = 4 if precision == "fp32" else 2
    out = {"parameters": p * psi, "gradients": p * psi, "optimizer_states": 8 * psi}
    return {**out, "total": sum(out.values())}


def calls_theory_bytes(psi, precision="fp32"):
    from zerokit.memory import theory_bytes

    return theory_bytes(psi, "ddp", 1, precision)


def total_not_the_sum(psi, precision="fp32"):
    return {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer_states": 8 * psi, "total": 12 * psi}


@pytest.mark.parametrize("fn, match", [
    (k_is_8_everywhere, "bytes of optimizer_states"),
    (calls_theory_bytes, "zerokit.theory_bytes"),
    (total_not_the_sum, "not the sum"),
])
def test_model_state_bytes_defects(fn, match):
    fails(lesson01.check_memory, fn, match=match)


# ---------------------------------------------------------------------------------------
# the optional exercise: a loss curve (no points; checked when attempted, never raises)


def _curve(make_optimizer, steps=60, *, after=False, accumulate=False, seed=0):
    import torch.nn.functional as F

    from zerokit.models import OddMLP, make_batch

    torch.manual_seed(seed)
    model = OddMLP()
    opt = make_optimizer(model.parameters())
    losses = []
    x, y = make_batch("mlp", 12, seed=0)
    for step in range(steps):
        loss = F.mse_loss(model(x), y)
        if not after:
            losses.append(loss.item())
        loss.backward()
        opt.step()
        if not accumulate:
            opt.zero_grad()
        if after:
            losses.append(F.mse_loss(model(x), y).item())
    return losses


def curve_right(make_optimizer, steps=60):
    return _curve(make_optimizer, steps)


def curve_after_step(make_optimizer, steps=60):
    return _curve(make_optimizer, steps, after=True)


def curve_accumulates(make_optimizer, steps=60):
    return _curve(make_optimizer, steps, accumulate=True)


def curve_other_seed(make_optimizer, steps=60):
    return _curve(make_optimizer, steps, seed=1)


def curve_stub(make_optimizer, steps=60):
    raise NotImplementedError()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn, said", [
    (curve_right, "✓"),
    (None, "skipped"),
    (curve_stub, "skipped"),
    (curve_after_step, "after"),
    (curve_accumulates, "zero_grad"),
    (curve_other_seed, "before the first step"),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_optional_loss_curve_is_checked_when_attempted_and_never_raises(fn, said, capsys):
    ok = lesson01.check_loss_curve(fn)
    out = capsys.readouterr().out
    assert said in out, out
    assert ok is (fn is curve_right)
    assert out.startswith("✓") == (fn is curve_right) and ("✗" in out) == (said not in ("✓", "skipped")), out
