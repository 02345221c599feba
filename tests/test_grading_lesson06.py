"""Lesson 06's checks, validated on the solution and on deliberately broken scalers and optimizers.

The solution is the code in solutions/06_mixed_precision (its solution cells, executed here).
Each broken version is one classic bug; it must fail exactly the checks listed beside it,
with a message naming the problem, and pass the others: one bug costs its own points only.

| defect | fails | message |
|---|---|---|
| unscale multiplies by the scale | unscale | "times the scale" |
| unscale divides in fp16, then converts | unscale | "divided in float16" |
| unscale divides fp32 gradients in place (example) | unscale | "you were given changed" |
| update() says step on an overflow | overflow | "returned True (step) on every rank" |
| overflow checked locally (no all-reduce) | overflow | "agreed across ranks" |
| no backoff on an overflow | schedule | "backoff_factor" |
| the scale never grows | schedule | "grow by growth_factor" |
| masters kept in 16 bits | numerics | "must be fp32" |
| update applied to the 16-bit parameters | numerics | "did not change" |
| master copied after the cast to 16 bits | numerics | "hold the weights rounded to" |
| frozen parameters left in fp32 | numerics | "frozen ones too" |
| Adam fed p.grad, still times the loss scale S | numerics | "S = 256 times AdamW's" |
| the gradient unscaled twice (g / S²) | numerics | "divided by the loss scale twice" |
| optimizer steps on an overflow step | overflow step | "nothing may change" |
| skips, but counts the skipped step (each parameter's t) | overflow step | "step 2 was skipped ... advanced on it" |
| skips, self.steps right, but the bias correction counts every call | overflow step | "must leave no trace" |
| one step count for every parameter (hidden: branch sits out a step) | numerics | "needs each parameter's own count" |
| the untouched student notebook | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from zerokit.adam import adamw_update_
from zerokit.grading import lesson06
from conftest import exercise_module, fails, fails_every_check, fails_exactly

pytestmark = pytest.mark.distributed

LESSON = "06_mixed_precision"
PRELUDE = """
import torch
import torch.distributed as dist
from zerokit.adam import adamw_update_
"""

# the broken classes below are sent to the ranks by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def notebook_code(folder, grade_ids):
    return exercise_module(LESSON, folder, grade_ids, PRELUDE)


SOLUTION = notebook_code("solutions", ["loss_scaler", "master_adam"])
STUDENT = notebook_code("lessons", ["loss_scaler", "master_adam"])
Scaler, Optimizer = SOLUTION.MyLossScaler, SOLUTION.MyMixedPrecisionAdam

SCALER_CHECKS = {
    "unscale": lambda cls: lesson06.check_unscale(cls, world_size=2),
    "overflow": lambda cls: lesson06.check_overflow_agreed(cls, world_size=2),
    "schedule": lambda cls: lesson06.check_scale_schedule(cls, world_size=2),
}
def _numerics_visible(cls):
    lesson06.check_numerics(cls, world_size=2, model="mlp", dtype="bf16")
    lesson06.check_numerics(cls, world_size=2, model="edge", dtype="bf16")  # frozen, tied, unused parameters


OPTIMIZER_CHECKS = {
    "numerics": _numerics_visible,
    "overflow_step": lambda cls: lesson06.check_overflow_step(cls, world_size=2, model="mlp"),
}


# the solution passes every visible and hidden test cell: nbmake runs solutions/06_mixed_precision
# end to end, and test_autograde grades it


@pytest.mark.timeout(60)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(SCALER_CHECKS, STUDENT.MyLossScaler)
    fails_every_check(OPTIMIZER_CHECKS, STUDENT.MyMixedPrecisionAdam)


# ---------------------------------------------------------------------------------------
# exercise (a): broken scalers


class MultipliesByScale(Scaler):
    @torch.no_grad()
    def unscale(self, grads):
        out = super().unscale(grads)
        return [g.mul_(self.scale**2) for g in out]  # BUG: g·S·S where g·S/S belongs


class DividesInHalf(Scaler):
    @torch.no_grad()
    def unscale(self, grads):
        out = super().unscale(grads)
        return [(g / self.scale).float() for g in grads]  # BUG: rounded in the 16-bit type


class UnscalesInPlace(Scaler):
    @torch.no_grad()
    def unscale(self, grads):
        out = super().unscale(grads)
        # BUG: t.float() of an fp32 t is t itself; dividing it in place divides the caller's gradient
        return [g.div_(self.scale) if g.dtype == torch.float32 else o for g, o in zip(grads, out)]


class StepsOnOverflow(Scaler):
    def update(self):
        super().update()
        return True  # BUG: backs off, but lets the optimizer step


class LocalOverflow(Scaler):
    @torch.no_grad()
    def unscale(self, grads):
        out = [g.float() / self.scale for g in grads]
        self.found_inf = any(not bool(torch.isfinite(g).all()) for g in out)  # BUG: this rank's verdict only
        return out


class NoBackoff(Scaler):
    def update(self):
        if self.found_inf:
            self.clean_steps = 0
            return False  # BUG: skips, but keeps the scale that overflowed
        return super().update()


class NeverGrows(Scaler):
    def update(self):
        if self.found_inf:
            self.scale *= self.backoff_factor
            return False
        return True  # BUG: no growth


# ---------------------------------------------------------------------------------------
# exercise (b): broken optimizers


class HalfMasters(Optimizer):
    def __init__(self, params, dtype=torch.bfloat16, **kw):
        super().__init__(params, dtype=dtype, **kw)
        self.masters = [p.detach().clone() for p in self.params]  # BUG: 16-bit copies (m and v fp32)


def _step(self, on_half=False, ignore_skip=False, count_skipped=False, scaled=False, twice=False, one_count=False):
    group = self.param_groups[0]
    with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
    for i in with_grad:
        dist.all_reduce(self.params[i].grad, op=dist.ReduceOp.AVG)
    grads = self.scaler.unscale([self.params[i].grad for i in with_grad])
    if scaled:
        grads = [self.params[i].grad.float() for i in with_grad]  # BUG: still times S
    if twice:
        grads = [g / self.scaler.scale for g in grads]  # BUG: unscale() already divided by S
    if count_skipped:
        for i in with_grad:
            self.steps[i] += 1  # BUG: counted before the verdict, so a skipped step still advances t
    if not self.scaler.update() and not ignore_skip:
        return None
    if one_count:
        self.count = getattr(self, "count", 0) + 1  # BUG: one count for every parameter
    for i, grad in zip(with_grad, grads):
        if not count_skipped:
            self.steps[i] += 1
        target = self.params[i].data if on_half else self.masters[i]
        t = self.count if one_count else self.steps[i]
        adamw_update_(target, grad, self.exp_avgs[i], self.exp_avg_sqs[i], t, lr=group["lr"],
                      beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                      weight_decay=group["weight_decay"])
        if not on_half:
            self.params[i].copy_(self.masters[i])
    return None


class MastersAfterCast(Optimizer):
    def __init__(self, params, dtype=torch.bfloat16, **kw):
        super().__init__(params, dtype=dtype, **kw)
        self.masters = [p.detach().float() for p in self.params]  # BUG: copied after the cast, the rounded weights


class FrozenLeftFp32(Optimizer):
    def __init__(self, params, dtype=torch.bfloat16, **kw):
        params = list(params)
        super().__init__(params, dtype=dtype, **kw)
        for p in params:
            if not p.requires_grad:
                p.data = p.data.float()  # BUG: only the trainable parameters were made 16-bit


class UpdatesHalfParams(Optimizer):
    step = torch.no_grad()(lambda self, closure=None: _step(self, on_half=True))  # BUG: no master in the loop


class StepsAnyway(Optimizer):
    step = torch.no_grad()(lambda self, closure=None: _step(self, ignore_skip=True))  # BUG: ignores the verdict


class CountsSkippedSteps(Optimizer):
    # BUG: the skipped step leaves nothing changed at that step, but t advanced: every later step is off
    step = torch.no_grad()(lambda self, closure=None: _step(self, count_skipped=True))


class OneCountForAll(Optimizer):
    # BUG: one step count for every parameter: a parameter that sat out a step (BranchNet's branch) gets the
    # bias correction of a t one too large
    step = torch.no_grad()(lambda self, closure=None: _step(self, one_count=True))


class FeedsScaledGradient(Optimizer):
    # BUG: Adam gets p.grad, the gradient of loss·S: m and v off by S and S², the weights nearly right
    step = torch.no_grad()(lambda self, closure=None: _step(self, scaled=True))


class UnscalesTwice(Optimizer):
    # BUG: the scaffold's unscale already divided by S; dividing again feeds Adam g / S
    step = torch.no_grad()(lambda self, closure=None: _step(self, twice=True))


class SkipCountedElsewhere(Optimizer):
    """Skips, and counts right in self.steps, but keeps its own count of the steps it took in another
    attribute that advances on the skipped step and drives the bias correction: only the twin sees it."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1  # BUG: every call counts, the skipped one too
        group = self.param_groups[0]
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in with_grad:
            dist.all_reduce(self.params[i].grad, op=dist.ReduceOp.AVG)
        grads = self.scaler.unscale([self.params[i].grad for i in with_grad])
        if not self.scaler.update():
            return None
        for i, grad in zip(with_grad, grads):
            self.steps[i] += 1
            adamw_update_(self.masters[i], grad, self.exp_avgs[i], self.exp_avg_sqs[i], self.calls, lr=group["lr"],
                          beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                          weight_decay=group["weight_decay"])
            self.params[i].copy_(self.masters[i])
        return None


DEFECTS = {  # class -> {check that must fail: message fragment}; the exercise's other checks must pass
    MultipliesByScale: {"unscale": "times the scale"},
    DividesInHalf: {"unscale": "divided in float16"},
    UnscalesInPlace: {"unscale": "you were given changed"},
    StepsOnOverflow: {"overflow": "returned True (step) on every rank"},
    LocalOverflow: {"overflow": "agreed across ranks"},
    NoBackoff: {"schedule": "backoff_factor"},
    NeverGrows: {"schedule": "grow by growth_factor"},
    HalfMasters: {"numerics": "must be fp32"},
    UpdatesHalfParams: {"numerics": "did not change"},
    MastersAfterCast: {"numerics": "hold the weights rounded to"},
    FrozenLeftFp32: {"numerics": "frozen ones too"},
    FeedsScaledGradient: {"numerics": "is S = 256 times AdamW's: Adam was fed the gradient still multiplied"},
    UnscalesTwice: {"numerics": "divided by the loss scale twice"},
    StepsAnyway: {"overflow_step": "nothing may change"},
    CountsSkippedSteps: {"overflow_step": "step 2 was skipped (rank 1's gradient of"},
    SkipCountedElsewhere: {"overflow_step": "must leave no trace"},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", list(DEFECTS), ids=lambda c: c.__name__)
def test_each_defect_fails_exactly_its_checks(cls, capsys):
    fails_exactly(SCALER_CHECKS if issubclass(cls, Scaler) else OPTIMIZER_CHECKS, cls, DEFECTS[cls], capsys)


@pytest.mark.timeout(60)
def test_one_count_for_every_parameter_is_caught_where_a_layer_sits_out(capsys):
    """With every parameter stepping every step (mlp; edge, whose unused layer never steps) one count
    is right; on branch, which sits out step 2, the branch's t is 2 after step 3, not 3. The hidden
    test runs branch beside edge in one launch; the reason names the step that was sat out."""
    _numerics_visible(OneCountForAll)
    lesson06.check_numerics(Optimizer, world_size=3, model=("edge", "branch"), dtype="fp16", steps=3)
    assert "(edge, Ψ = 745, branch, Ψ = 566)" in capsys.readouterr().out
    reason = fails(lesson06.check_numerics, OneCountForAll, world_size=3, model=("edge", "branch"), dtype="fp16",
                   steps=3, match="needs each parameter's own count")
    assert "branch.weight had no gradient in step 2, so AdamW has counted 2 steps for it, not 3" in reason, reason


@pytest.mark.timeout(60)
def test_hidden_configurations_catch_the_same_bugs():
    """N = 3 and 4, another bad rank, the transformer in fp16."""
    fails(lesson06.check_overflow_agreed, LocalOverflow, world_size=3, bad_rank=0, match="agreed across ranks")
    fails(lesson06.check_unscale, MultipliesByScale, world_size=3, match="times the scale")
    fails(lesson06.check_numerics, HalfMasters, world_size=3, model="transformer", dtype="fp16", steps=3,
          match="must be fp32")
    fails(lesson06.check_numerics, FrozenLeftFp32, world_size=3, model="edge", dtype="fp16", steps=3,
          match="frozen ones too")
    fails(lesson06.check_numerics, MastersAfterCast, world_size=3, model="transformer", dtype="fp16", steps=3,
          match="hold the weights rounded to")
    fails(lesson06.check_overflow_step, StepsAnyway, world_size=3, model="transformer", inject_at=2,
          match="nothing may change")
    fails(lesson06.check_overflow_step, CountsSkippedSteps, world_size=3, model="transformer", inject_at=2,
          match="step 3 was skipped")
    fails(lesson06.check_numerics, FeedsScaledGradient, world_size=3, model="transformer", dtype="fp16", steps=3,
          match="is S = 1024 times AdamW's")
    fails(lesson06.check_numerics, UnscalesTwice, world_size=3, model=("edge", "branch"), dtype="fp16", steps=3,
          match="divided by the loss scale twice")
    fails(lesson06.check_numerics, OneCountForAll, world_size=3, model=("edge", "branch"), dtype="fp16", steps=3,
          match="branch: step 3: the master weights of branch.weight (self.masters[2]) differ from AdamW's")
