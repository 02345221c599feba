"""Lesson 03's checks, validated on the solution and on deliberately broken ZeRO-1s.

The solution is the code in solutions/03_zero1 (the notebook's solution cells, executed
here), so what is validated is what students are graded against. Every broken version
below is one classic bug; each must fail exactly the checks listed beside it, with a
message that names the problem, and pass the others: one bug costs its own points only.

| defect | fails | message |
|---|---|---|
| shard size numel // N | shard_range | "drops the remainder" |
| remainder to the last rank | shard_range | "need equal shards" |
| one extra element per shard | shard_range | "smallest equal shards" |
| full-size m and v, right numbers | memory | "as large as the whole model" |
| all-reduce then slice | traffic | "all-reduced" |
| reduce-scatter SUM, not AVG | numerics | "m (self.exp_avg" |
| state copied, never persists | numerics | "m (self.exp_avg" |
| step count stuck at 1 | numerics | "after step 2" |
| no all-gather | numerics, traffic | "only this rank's own shard", "no all-gather" |
| data parallel in disguise | memory, traffic | "as large as the whole model", "all-reduced" |
| subclass of zerokit.ZeRO1Adam | every class check | "subclasses zerokit.ZeRO1Adam" |
| wraps zerokit.ZeRO1Adam | every class check | "used zerokit's ZeRO1Adam" |
| calls torch.optim.AdamW | numerics, memory, traffic | "torch.optim.AdamW" |
| the untouched student notebook | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit.adam import adamw_update_
from zerokit.grading import lesson03
from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly, source_module
from tests.submissions import lesson03 as examples

PRELUDE = """
import torch
import torch.distributed as dist
from zerokit.adam import adamw_update_
from zerokit.flat import FlatBucket
"""

# the broken classes below are sent to the ranks by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def notebook_code(folder, grade_ids):
    """The named cells of lessons/ or solutions/ 03_zero1, executed as one module."""
    return exercise_module("03_zero1", folder, grade_ids, PRELUDE)


SOLUTION = notebook_code("solutions", ["shard_range", "zero1_class"])
STUDENT = notebook_code("lessons", ["shard_range", "zero1_class"])
Solution = SOLUTION.MyZeRO1Adam


CHECKS = {
    "numerics": lambda cls: lesson03.check_numerics(cls, world_size=2, model="small-mlp"),
    "memory": lambda cls: lesson03.check_memory(cls, world_size=4, model="wide-mlp"),
    "traffic": lambda cls: lesson03.check_traffic(cls, world_size=2, model="small-mlp"),
}


# ---------------------------------------------------------------------------------------
# the untouched notebook (the solution passes every visible and hidden test cell: nbmake
# runs solutions/03_zero1 end to end, and test_autograde grades it)


@pytest.mark.timeout(60)
def test_untouched_student_notebook_fails_every_check():
    fails(lesson03.check_shard_range, STUDENT.shard_range, match=UNFINISHED)
    fails_every_check(CHECKS, STUDENT.MyZeRO1Adam)


# ---------------------------------------------------------------------------------------
# exercise (a): shard_range


def floor_shards(numel, world_size, rank):
    size = numel // world_size
    return rank * size, (rank + 1) * size


def remainder_to_last(numel, world_size, rank):
    size = numel // world_size
    return rank * size, numel if rank == world_size - 1 else (rank + 1) * size


def one_too_many(numel, world_size, rank):
    size = numel // world_size + 1
    return rank * size, (rank + 1) * size


def float_bounds(numel, world_size, rank):
    size = -(-numel // world_size)
    return rank * size * 1.0, (rank + 1) * size * 1.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fn, match", [
    (floor_shards, "drops the remainder"),
    (remainder_to_last, "need equal shards"),
    (one_too_many, "smallest equal shards"),
    (float_bounds, "must be Python ints"),
])
def test_shard_range_defects(fn, match):
    fails(lesson03.check_shard_range, fn, world_size=2, sizes=[8, 7, 1], match=match)


# ---------------------------------------------------------------------------------------
# the optimizer: one broken class per classic bug


# the example submissions' broken classes (tests/submissions/lesson03.py), as a notebook defines them
EXAMPLES = source_module("lesson03_examples", "\n\n".join(
    source.replace("class MyZeRO1Adam", f"class {name}")
    for name, source in (("FullState", examples.FULL_STATE), ("CallsTorchAdamW", examples.CALLS_ADAMW))), PRELUDE)
FullState = EXAMPLES.FullState  # right numbers, but m and v for the whole model on every rank
CallsTorchAdamW = EXAMPLES.CallsTorchAdamW  # hands its shard to torch.optim.AdamW


class AllReduceThenSlice(Solution):
    """Right numbers, sharded state, but the whole gradient is all-reduced."""

    @torch.no_grad()
    def step(self, closure=None):
        group, b = self.param_groups[0], self.bucket
        flat_grad = b.flatten([p.grad for p in b.params])
        dist.all_reduce(flat_grad)
        flat_grad /= self.world_size
        self.steps += 1
        adamw_update_(b.shard(self.flat_params), b.shard(flat_grad), self.exp_avg, self.exp_avg_sq, self.steps,
                      lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                      eps=group["eps"], weight_decay=group["weight_decay"])
        dist.all_gather_single(self.flat_params, b.shard(self.flat_params))


def _step_with(self, op=dist.ReduceOp.AVG, state=lambda t: t, step=None, gather=True):
    """The solution's step with one thing changed."""
    group, b = self.param_groups[0], self.bucket
    flat_grad = b.flatten([p.grad for p in b.params])
    grad_shard = torch.empty(b.shard_numel)
    dist.reduce_scatter_single(grad_shard, flat_grad, op=op)
    self.steps += 1
    adamw_update_(b.shard(self.flat_params), grad_shard, state(self.exp_avg), state(self.exp_avg_sq),
                  step or self.steps, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                  eps=group["eps"], weight_decay=group["weight_decay"])
    if gather:
        dist.all_gather_single(self.flat_params, b.shard(self.flat_params))


class SumNotMean(Solution):
    step = torch.no_grad()(lambda self, closure=None: _step_with(self, op=dist.ReduceOp.SUM))


class StateNeverPersists(Solution):
    step = torch.no_grad()(lambda self, closure=None: _step_with(self, state=torch.clone))


class StepCountStuck(Solution):
    step = torch.no_grad()(lambda self, closure=None: _step_with(self, step=1))


class NoAllGather(Solution):
    step = torch.no_grad()(lambda self, closure=None: _step_with(self, gather=False))


class DataParallelInDisguise(Solution):
    """Plain data parallel Adam behind ZeRO-1's names: full state, all-reduce, every rank updates all."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.exp_avg = torch.zeros(self.bucket.padded_numel)
        self.exp_avg_sq = torch.zeros(self.bucket.padded_numel)

    @torch.no_grad()
    def step(self, closure=None):
        group, b = self.param_groups[0], self.bucket
        flat_grad = b.flatten([p.grad for p in b.params])
        dist.all_reduce(flat_grad, op=dist.ReduceOp.AVG)
        self.steps += 1
        adamw_update_(self.flat_params, flat_grad, self.exp_avg, self.exp_avg_sq, self.steps,
                      lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                      eps=group["eps"], weight_decay=group["weight_decay"])


class SubclassesZeroKit(zerokit.ZeRO1Adam):
    pass


class WrapsZeroKit(torch.optim.Optimizer):
    def __init__(self, params, **kw):
        params = list(params)
        super().__init__(params, kw)
        self.inner = zerokit.ZeRO1Adam(params, **kw)

    def step(self, closure=None):
        return self.inner.step(closure)


DEFECTS = {  # class -> {check that must fail: message fragment}; every other check must pass
    FullState: {"memory": "as large as the whole model"},
    AllReduceThenSlice: {"traffic": "all-reduced"},
    SumNotMean: {"numerics": "m (self.exp_avg"},
    StateNeverPersists: {"numerics": "m (self.exp_avg"},
    StepCountStuck: {"numerics": "after step 2"},
    NoAllGather: {"numerics": "only this rank's own shard", "traffic": "no all-gather"},
    DataParallelInDisguise: {"memory": "as large as the whole model", "traffic": "all-reduced"},
    SubclassesZeroKit: {name: "subclasses zerokit.ZeRO1Adam" for name in CHECKS},
    WrapsZeroKit: {name: "used zerokit's ZeRO1Adam" for name in CHECKS},
    CallsTorchAdamW: {name: "torch.optim.AdamW" for name in CHECKS},
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls", list(DEFECTS), ids=lambda c: c.__name__)
def test_each_defect_fails_exactly_its_checks(cls, capsys):
    fails_exactly(CHECKS, cls, DEFECTS[cls], capsys)


@pytest.mark.timeout(30)
def test_hidden_configurations_catch_the_same_bugs():
    """N = 3 and the models the visible tests do not use find them too."""
    fails(lesson03.check_shard_range, floor_shards, world_size=3, sizes=[1, 2, 3, 10, 11, 1001], match="remainder")
    fails(lesson03.check_numerics, SumNotMean, world_size=3, model="transformer", match="m (self.exp_avg")
    fails(lesson03.check_numerics, StateNeverPersists, world_size=4, model="edge", weight_decay=0.0,
          match="m (self.exp_avg")
    fails(lesson03.check_memory, FullState, world_size=3, model="transformer", match="whole model")
    fails(lesson03.check_traffic, AllReduceThenSlice, world_size=3, model="edge", weight_decay=0.0,
          match="all-reduced")


def test_memory_check_refuses_two_ranks():
    with pytest.raises(ValueError, match="world_size >= 3"):
        lesson03.check_memory(Solution, world_size=2)
