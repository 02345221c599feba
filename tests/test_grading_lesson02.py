"""Lesson 02's checks, validated on the solution and on deliberately broken data parallel code.

The solution is the code in solutions/02_distributed_adam (the notebook's exercise cells,
executed here), so what is validated is what students are graded against. Each broken
version below is one classic bug; it must fail exactly the checks listed beside it, with a
message that names the problem, and pass the others: one bug costs its own points only.

| defect | fails | message |
|---|---|---|
| sum, not mean | average | "summed" |
| no all-reduce | average | "own micro-batch gradient" |
| zeros for a gradient that is None | average | "a missing gradient was turned into one" |
| all-reduce twice | average | "expected all-reduces of Ψ" |
| averaged twice (ReduceOp.AVG, then divided by N) | average | "averaged twice" |
| zerokit.ddp.average_gradients | average | "zerokit.ddp.average_gradients itself" |
| sums, and patches torch.Tensor.any | average | "replaced torch.Tensor.any" |
| step() never averages | numerics, traffic | "drifted apart", "no all-reduce" |
| all-reduce after the update | numerics | "but after the update" |
| no broadcast in __init__ | numerics | "right after" |
| only the trainable parameters broadcast | numerics | "left the frozen ones out" |
| broadcast of the weights every step | traffic | "every step is not needed" |
| calls torch.optim.AdamW | numerics, traffic | "torch.optim.AdamW" |
| sums inside step(), no function | numerics | "the mean over the ranks, not the sum" |
| AVG and divided by N inside step(), no function | numerics | "averaged twice" |
| m and v under other keys of self.state[p] | numerics | "self.state[p]['exp_avg']" |
| subclass of zerokit.DistributedAdam | every class check | "subclasses zerokit.DistributedAdam" |
| the untouched student notebook | every check | "NotImplementedError" |

And the isolation: a class whose step() calls a summing average_gradients passes the class
checks, because they swap in zerokit's function (exercise (a) already cost its points).
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit.adam import Adam
from zerokit.grading import lesson02
from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly

pytestmark = pytest.mark.distributed

PRELUDE = """
import torch
import torch.distributed as dist
from zerokit.adam import Adam
"""
LESSON = "02_distributed_adam"

# the broken versions below are sent to the ranks by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def notebook_code(folder, extra=""):
    """The exercise cells of lessons/ or solutions/ 02_distributed_adam, executed as one module."""
    return exercise_module(LESSON, folder, ["average_gradients", "distributed_adam_class"], PRELUDE, extra)


SOLUTION = notebook_code("solutions")
STUDENT = notebook_code("lessons")
Solution = SOLUTION.MyDistributedAdam
average = SOLUTION.average_gradients


CHECKS = {  # the notebook's visible tests
    "numerics": lambda cls: lesson02.check_numerics(cls, world_size=2, model="edge"),
    "traffic": lambda cls: lesson02.check_traffic(cls, world_size=2, model="small-mlp"),
}


# ---------------------------------------------------------------------------------------
# the untouched notebook (the solution passes every visible and hidden test cell: nbmake
# runs solutions/02_distributed_adam end to end, and test_autograde grades it)


@pytest.mark.timeout(60)
def test_untouched_student_notebook_fails_every_check():
    fails(lesson02.check_average_gradients, STUDENT.average_gradients, match=UNFINISHED)
    fails_every_check(CHECKS, STUDENT.MyDistributedAdam)


# ---------------------------------------------------------------------------------------
# exercise (a): average_gradients


def _grads(params):
    return [p.grad for p in params if p.grad is not None]


def _flat_all_reduce(grads):
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    return flat


def _copy_back(grads, flat):
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def sums(params):
    grads = _grads(params)
    _copy_back(grads, _flat_all_reduce(grads))


@torch.no_grad()
def reduces_a_copy(params):
    """All-reduces a buffer, then never copies the result back."""
    grads = _grads(params)
    _flat_all_reduce(grads).div_(dist.get_world_size())


@torch.no_grad()
def zeros_for_none(params):
    for p in params:
        if p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
    grads = _grads(params)
    _copy_back(grads, _flat_all_reduce(grads).div_(dist.get_world_size()))


@torch.no_grad()
def twice(params):
    """The mean from a flat all-reduce, and then per parameter again (sum / N, world-wide)."""
    grads = _grads(params)
    _copy_back(grads, _flat_all_reduce(grads).div_(dist.get_world_size()))
    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())


@torch.no_grad()
def averages_twice(params):
    """ReduceOp.AVG, and then divided by N as well: 1/N of the mean."""
    grads = _grads(params)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    _copy_back(grads, flat.div_(dist.get_world_size()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn, model, match", [
    (sums, "small-mlp", "summed"),
    (averages_twice, "small-mlp", "averaged twice"),
    (reduces_a_copy, "small-mlp", "own micro-batch gradient"),
    (zeros_for_none, "edge", "a missing gradient was turned into one"),
    (twice, "small-mlp", "expected all-reduces of Ψ"),
], ids=lambda v: getattr(v, "__name__", v))
def test_average_gradients_defects(fn, model, match):
    fails(lesson02.check_average_gradients, fn, world_size=2, model=model, match=match)


@pytest.mark.timeout(60)
def test_a_gradient_of_zeros_in_place_of_none_is_named_from_what_was_seen():
    """edge's `unused` layer (39 elements) gets no gradient on any rank; a function that gives it
    zeros is told which parameter, why it has none, and what it found in its place."""
    reason = fails(lesson02.check_average_gradients, zeros_for_none, world_size=2, model="edge",
                   match="a missing gradient was turned into one")
    assert ("parameter unused.weight has no gradient on any rank (the forward never uses it), but after your "
            "function its .grad is a tensor of 39 zeros") in reason, reason


@torch.no_grad()
def sums_and_patches_any(params):
    """Sums, and makes every `(...).any()` say False, so that assert_close sees no bad element."""
    torch.Tensor.any = lambda *a, **k: torch.zeros((), dtype=torch.bool)
    sums(params)


@pytest.mark.timeout(60)
def test_monkeypatching_what_a_check_relies_on_fails():
    fails(lesson02.check_average_gradients, sums_and_patches_any, match="replaced torch.Tensor.any")


def test_average_gradients_refuses_zerokits_own():
    fails(lesson02.check_average_gradients, zerokit.ddp.average_gradients, match="itself")


# ---------------------------------------------------------------------------------------
# exercise (b): one broken class per classic bug


class NeverAverages(Solution):
    @torch.no_grad()
    def step(self, closure=None):
        Adam.step(self)


class AveragesAfterStep(Solution):
    @torch.no_grad()
    def step(self, closure=None):
        Adam.step(self)
        average(self.all_params())


class NoBroadcast(Adam):
    """Averages right, but every replica keeps its own initialisation."""

    def all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        average(self.all_params())
        super().step()


class BroadcastsTrainableOnly(Solution):
    """Broadcasts only the parameters that train: every rank keeps its own frozen weights."""

    def __init__(self, params, **kw):
        Adam.__init__(self, params, **kw)
        with torch.no_grad():
            for p in self.all_params():
                if p.requires_grad:  # BUG: the frozen ones take part in the forward too
                    dist.broadcast(p.data, src=0)


class BroadcastsEveryStep(Solution):
    @torch.no_grad()
    def step(self, closure=None):
        super().step()
        for p in self.all_params():
            dist.broadcast(p.data, src=0)


class CallsTorchAdamW(Solution):
    @torch.no_grad()
    def step(self, closure=None):
        average(self.all_params())
        torch.optim.AdamW(self.all_params()).step()


class SumsInline(Solution):
    """Its own all-reduce in step(), summing: Adam's state sees N x the gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.all_params():
            if p.grad is not None:
                dist.all_reduce(p.grad)
        Adam.step(self)


class AveragesTwiceInline(Solution):
    """Its own all-reduce in step(), ReduceOp.AVG and then divided by N: Adam's state sees 1/N of the mean."""

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.all_params():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
                p.grad.div_(dist.get_world_size())
        Adam.step(self)


class StateUnderOtherKeys(Solution):
    """Right, but m and v in self.state[p]["m"] / ["v"]: the check cannot compare them."""

    @torch.no_grad()
    def step(self, closure=None):
        average(self.all_params())
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                    state["step"] += 1
                    zerokit.adam.adamw_update_(p, p.grad, state["m"], state["v"], state["step"], lr=group["lr"],
                                               beta1=b1, beta2=b2, eps=group["eps"],
                                               weight_decay=group["weight_decay"])


class SubclassesZeroKit(zerokit.DistributedAdam):
    pass


DEFECTS = {  # class -> {check that must fail: message fragment}; every other check must pass
    NeverAverages: {"numerics": "drifted apart", "traffic": "no all-reduce"},
    AveragesAfterStep: {"numerics": "but after the update"},
    NoBroadcast: {"numerics": "right after"},
    BroadcastsTrainableOnly: {"numerics": "frozen.weight, frozen.bias only"},
    BroadcastsEveryStep: {"traffic": "every step is not needed"},
    CallsTorchAdamW: {name: "torch.optim.AdamW" for name in CHECKS},
    SumsInline: {"numerics": "the mean over the ranks, not the sum"},
    AveragesTwiceInline: {"numerics": "averaged twice"},
    StateUnderOtherKeys: {"numerics": "self.state[p]['exp_avg']"},
    SubclassesZeroKit: {name: "subclasses zerokit.DistributedAdam" for name in CHECKS},
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", list(DEFECTS), ids=lambda c: c.__name__)
def test_each_defect_fails_exactly_its_checks(cls, capsys):
    fails_exactly(CHECKS, cls, DEFECTS[cls], capsys)


@pytest.mark.timeout(60)
def test_a_wrong_average_gradients_costs_only_exercise_a():
    """The class's step() calls the notebook's average_gradients by name; the class checks
    replace it by zerokit's, so a summing function is not charged a second time."""
    summing = notebook_code("solutions", extra="""

@torch.no_grad()
def average_gradients(params):
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # BUG: the sum
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
""")
    fails(lesson02.check_average_gradients, summing.average_gradients, match="summed")
    for check in CHECKS.values():
        check(summing.MyDistributedAdam)


@pytest.mark.timeout(60)
def test_hidden_configurations_catch_the_same_bugs():
    """N = 3 and the models the visible tests do not use find them too."""
    fails(lesson02.check_average_gradients, sums, world_size=3, model="transformer", match="summed")
    fails(lesson02.check_numerics, AveragesAfterStep, world_size=3, model="transformer", steps=3,
          match="but after the update")
    fails(lesson02.check_numerics, NoBroadcast, world_size=3, model="edge", match="right after")
    fails(lesson02.check_numerics, BroadcastsTrainableOnly, world_size=3, model="edge",
          match="in frozen.weight, frozen.bias only")
    fails(lesson02.check_traffic, BroadcastsEveryStep, world_size=3, model="edge",
          match="every step is not needed")


# ---------------------------------------------------------------------------------------
# what the passing checks print, and what the notebook's "Try it" shows


@pytest.mark.timeout(90)
def test_the_same_model_is_reported_with_the_same_psi(capsys):
    """edge has 745 trainable elements, 39 of them in a layer no forward uses: every check says
    Ψ = 745, and what its counters saw beside it."""
    lesson02.check_average_gradients(average, world_size=2, model="edge")
    lesson02.check_numerics(Solution, world_size=2, model="edge", steps=2)
    lesson02.check_traffic(Solution, world_size=2, model="edge")
    out = capsys.readouterr().out
    assert out.count("Ψ = 745") == 3, out
    assert "Ψ = 706" not in out, out


@pytest.mark.timeout(60)
def test_the_traffic_check_counts_the_gradient_and_says_so(capsys):
    """A class that averages as the exercise asks moves exactly Ψ = 1267 elements of small-mlp per step."""
    lesson02.check_traffic(Solution, world_size=2, model="small-mlp")
    out = capsys.readouterr().out
    assert "1267 elements" in out and "1271" not in out, out


@pytest.mark.timeout(90)
def test_the_try_it_shows_a_gradient_of_the_wrong_scale():
    """Adam hardly notices a gradient N times too large in the weights (1.3e-5 after 3 steps): the
    "Try it" cell must show it in m as well."""
    import json

    import zerokit
    from conftest import ROOT, source_module

    nb = json.loads((ROOT / "solutions" / LESSON / f"{LESSON}.ipynb").read_text())
    source = next("".join(c["source"]) for c in nb["cells"] if "def try_ddp(" in "".join(c["source"]))
    module = source_module("try_ddp", source.split("\nfor rank")[0],
                           PRELUDE + "import zerokit\nfrom zerokit.models import OddMLP, make_batch\n")
    shown = {}
    for name, cls in (("right", Solution), ("sums", SumsInline)):
        module.MyDistributedAdam = cls
        shown[name] = zerokit.launch(module.try_ddp, 2, args=(3,), launcher="forkserver", backend="gloo",
                                     timeout=60, echo=False)[0]
    # the cell returns (weights' difference, m's relative difference, replicas equal)
    assert len(shown["right"]) == 3, shown
    assert shown["right"][1] < 1e-3 and shown["sums"][1] > 0.5, shown
