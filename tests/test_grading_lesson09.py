"""Lesson 09's checks, validated on the solution and on deliberately broken Muons on ZeRO-1.

The solution is the code in solutions/09_muon (the notebook's solution cell, executed here),
so what is validated is what students are graded against. Each broken version is one bug a
sharded Muon has had; each must fail the checks listed beside it, with a message that names
the problem, and pass the others.

| defect | fails | message |
|---|---|---|
| flat shards, each rank orthogonalises its piece (example) | numerics, balance | "flat shard boundary", "one owner" |
| owners balanced by element count (example) | balance | "balanced by element count" |
| all-reduce, every rank keeps every momentum (example) | state | "is kept on 2 ranks" |
| the sum of the gradients, not the mean (example) | numerics | "summed, not averaged" |
| all-reduce to everyone, then the owner updates and broadcasts | traffic | "all-reduce of" |
| a matrix no rank has a gradient for decayed anyway | numerics (edge) | "leaves it alone" |
| the owner steps with the momentum, no Newton-Schulz (Muon off) | numerics | "Muon did not run" |
| the textbook's momentum, B = μB + g | numerics | "1/(1 - μ)" |
| Newton-Schulz in float32, another order | numerics (bitwise) | "not bit for bit" |
| the update in a gradient hook, once per backward | numerics (accumulation) | "changed during backward" |
| subclass of zerokit.ZeRO1Muon; zerokit's assign_owners | every class check; numerics | "subclasses", "assign_owners" |
| the untouched student notebook | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import zerokit
from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly, source_module
from tests.submissions import _solution_sources
from tests.submissions import lesson09 as examples
from zerokit.grading import lesson09

pytestmark = pytest.mark.distributed

PRELUDE = """
import torch
import torch.distributed as dist
from zerokit.flat import FlatBucket
from zerokit.muon import muon_update_, newton_schulz, newton_schulz_cost
"""

# the broken classes below are sent to the ranks by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOLUTION = exercise_module("09_muon", "solutions", ["muon_class"], PRELUDE)
STUDENT = exercise_module("09_muon", "lessons", ["muon_class"], PRELUDE)
Solution = SOLUTION.MyZeRO1Muon

def _numerics_visible(cls):
    lesson09.check_numerics(cls, world_size=2, model="transformer", same_data=True)
    lesson09.check_numerics(cls, world_size=2, model="branch", steps=4)  # step 4: a gradient on rank 0 only


CHECKS = {
    "numerics": _numerics_visible,
    "state": lambda cls: lesson09.check_state(cls, world_size=2, model="transformer"),
    "traffic": lambda cls: lesson09.check_traffic(cls, world_size=2, model="transformer"),
    "balance": lambda cls: lesson09.check_balance(cls, world_size=2),
}


def _example(name, edit):
    """An example student's class (tests/submissions/lesson09.py), as the notebook would define it."""
    source = edit if isinstance(edit, str) else edit(SOLUTION_SOURCE)
    return source_module(f"lesson09_{name}", source, PRELUDE).MyZeRO1Muon


SOLUTION_SOURCE = _solution_sources("09_muon")["muon_class"]  # the solution cell, markers removed


@pytest.mark.timeout(120)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(CHECKS, STUDENT.MyZeRO1Muon, match=UNFINISHED)


# ---------------------------------------------------------------------------------------
# the example students: each fails its checks and passes the others


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name, edit, expected", [
    ("sliced", examples.SLICED_SHARDS, {"numerics": "a flat shard boundary cuts",
                                        "balance": "Give each matrix one owner"}),
    ("element_balanced", examples.ELEMENT_BALANCED, {"balance": "balanced by element count"}),
    ("momentum_everywhere", examples.MOMENTUM_EVERYWHERE, {"state": "is kept on 2 ranks"}),
    ("sums", examples.SUMS_GRADIENTS, {"numerics": "summed, not averaged"}),
    ("skips_own_grad", examples.SKIPS_OWN_GRAD, {"numerics": "a skip decided from this rank's own .grad"}),
    ("momentum_created", examples.MOMENTUM_CREATED_EVERYWHERE, {"state": "on all but one as zeros"}),
    ("unwaited_reduce", examples.UNWAITED_REDUCE, {"numerics": "had not been waited for"}),
    ("rows_per_rank", examples.ROWS_PER_RANK, {"numerics": "Newton-Schulz of a slice"}),
])
def test_example_defects_fail_exactly_their_checks(name, edit, expected, capsys):
    fails_exactly(CHECKS, _example(name, edit), expected, capsys)


@pytest.mark.timeout(120)
def test_the_hidden_situations_catch_them_too():
    """N = 3 on each rank's own data, four micro-batches: the flat shards cut other matrices, the sum is 3 x;
    13 matrices of two shapes on 3 ranks: owners by elements are off."""
    fails(lesson09.check_numerics, _example("sliced3", examples.SLICED_SHARDS), world_size=3,
          model=("transformer", "edge"), accumulation=4, match="a flat shard boundary cuts at N = 3")
    fails(lesson09.check_numerics, _example("sums3", examples.SUMS_GRADIENTS), world_size=3, model="edge",
          accumulation=4, match="3 x torch.optim.Muon's")
    fails(lesson09.check_balance, _example("elements3", examples.ELEMENT_BALANCED), world_size=3,
          shapes=((32, 32),) * 2 + ((4, 256),) * 11, match="balanced by element count")


# ---------------------------------------------------------------------------------------
# more bugs, each against the check meant to catch it


def _live(self):
    present = torch.tensor([p.grad is not None for p in self.params], dtype=torch.uint8)
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    return [(p, o) for p, o, has in zip(self.params, self.owners, present.tolist()) if has]


def _owner_step(self, mean, update, live=None, reduce=True):
    """The solution's step with the owner's arithmetic `update(self, p, mean_grad)` and the mean
    `mean(sum, n)`; reduce=False: every gradient all-reduced to every rank instead."""
    live = _live(self) if live is None else live
    grads = {p: p.grad if p.grad is not None else torch.zeros_like(p) for p, _ in live}
    for p, owner in live:
        if reduce:
            dist.reduce(grads[p], dst=owner)
        else:
            dist.all_reduce(grads[p])
    for p, owner in live:
        if owner == self.rank:
            update(self, p, mean(grads[p], self.world_size))
    for p, owner in live:
        dist.broadcast(p.data, src=owner)


def _muon(self, p, grad):
    g = self.param_groups[0]
    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    zerokit.muon.muon_update_(p, grad, buf, lr=g["lr"], weight_decay=g["weight_decay"], momentum=g["momentum"],
                              nesterov=g["nesterov"])


def _sgd(self, p, grad):
    g = self.param_groups[0]
    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    buf.lerp_(grad, 1 - g["momentum"])
    p.mul_(1 - g["lr"] * g["weight_decay"])
    p.add_(grad.lerp(buf, g["momentum"]), alpha=-g["lr"])  # BUG: no orthogonalisation


def _textbook(self, p, grad):
    g = self.param_groups[0]
    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    buf.mul_(g["momentum"]).add_(grad)  # BUG: torch keeps the exponential average (a lerp)
    p.mul_(1 - g["lr"] * g["weight_decay"])
    p.add_(zerokit.muon.newton_schulz(grad.add(buf, alpha=g["momentum"])),
           alpha=-g["lr"] * max(1, p.shape[0] / p.shape[1]) ** 0.5)


def _float32(self, p, grad):
    g = self.param_groups[0]
    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    buf.lerp_(grad, 1 - g["momentum"])
    x = grad.lerp(buf, g["momentum"])
    x = x.T if p.shape[0] > p.shape[1] else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.775 * a + 2.0315 * a @ a) @ x  # BUG: float32, in another order than torch's
    x = x.T if p.shape[0] > p.shape[1] else x
    p.mul_(1 - g["lr"] * g["weight_decay"])
    p.add_(x, alpha=-g["lr"] * max(1, p.shape[0] / p.shape[1]) ** 0.5)


def _mean(total, n):
    return total.div_(n)


class AllReduceToOwner(Solution):
    """Every gradient all-reduced (2Ψ), then the owner updates and broadcasts (Ψ): 3Ψ."""

    step = torch.no_grad()(lambda self, closure=None: _owner_step(self, _mean, _muon, reduce=False))


class DecaysUnused(Solution):
    """No flags: a matrix no rank has a gradient for is updated from zeros (weight decay)."""

    step = torch.no_grad()(lambda self, closure=None: _owner_step(self, _mean, _muon,
                                                                  live=list(zip(self.params, self.owners))))


class SGDInstead(Solution):
    step = torch.no_grad()(lambda self, closure=None: _owner_step(self, _mean, _sgd))


class TextbookMomentum(Solution):
    step = torch.no_grad()(lambda self, closure=None: _owner_step(self, _mean, _textbook))


class Float32NewtonSchulz(Solution):
    step = torch.no_grad()(lambda self, closure=None: _owner_step(self, _mean, _float32))


class UpdatesInHook(Solution):
    """The whole update in a post-accumulate-grad hook: once per backward, not once per step."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.pending = 0
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._arrived)

    def _arrived(self, param):
        self.pending += 1
        if self.pending == sum(p.requires_grad for p in self.params):  # the last gradient of this backward
            self.pending = 0
            Solution.step(self)  # BUG: per micro-batch

    def step(self, closure=None):
        pass


class SubclassesZeRO1Muon(zerokit.ZeRO1Muon):
    pass


class ZerokitOwners(Solution):
    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.owners = zerokit.muon.assign_owners([p.shape for p in self.params], self.world_size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls, check, kw, match", [
    (AllReduceToOwner, lesson09.check_traffic, dict(world_size=2), "all-reduce of"),
    (DecaysUnused, lesson09.check_numerics, dict(world_size=3, model="edge"), "leaves it alone"),
    (SGDInstead, lesson09.check_numerics, dict(world_size=3, model="transformer"), "Muon did not run"),
    (TextbookMomentum, lesson09.check_numerics, dict(world_size=2, same_data=True), "1/(1 - μ)"),
    (Float32NewtonSchulz, lesson09.check_numerics, dict(world_size=2, same_data=True), "not bit for bit"),
    (UpdatesInHook, lesson09.check_numerics, dict(world_size=3, accumulation=4), "changed during backward"),
    (SubclassesZeRO1Muon, lesson09.check_state, dict(world_size=2), "subclasses zerokit.ZeRO1Muon"),
    (ZerokitOwners, lesson09.check_numerics, dict(world_size=2), "assign_owners"),
])
def test_each_bug_fails_its_check_with_a_reason_that_names_it(cls, check, kw, match):
    fails(check, cls, match=match, **kw)


@pytest.mark.timeout(120)
def test_the_other_checks_pass_what_they_do_not_judge(capsys):
    """Traffic and balance are blind to the numbers, numerics to the traffic: one bug costs one check."""
    for cls, check in ((SGDInstead, "traffic"), (TextbookMomentum, "balance"), (AllReduceToOwner, "numerics")):
        CHECKS[check](cls)
    assert capsys.readouterr().out.count("✓") == 4  # the numerics check is two (transformer, branch)
