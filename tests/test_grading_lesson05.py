"""Lesson 05's grader, validated: the notebook's own solution passes every check (the
hidden configurations here; the visible ones below, beside each bug), the untouched student notebook fails every check,
and each classic ZeRO-3 bug fails the check meant to catch it, with a message that names
the problem, and passes the others.

The classes under test come from the notebooks themselves (the two exercise cells of
solutions/ and of lessons/), so this file tests what a student gets and what the
instructor ships. The broken variants below subclass the solution and replace a method.
"""

import json
import sys
import types
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit.comm import all_gather
from zerokit.grading import lesson05
from conftest import fails_every_check, fails_exactly, outcome
from zerokit.grading.harness import CheckFailed

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "05_zero3" / "05_zero3.ipynb"
RELEASE = ROOT / "lessons" / "05_zero3" / "05_zero3.ipynb"

# the classes below are sent to the ranks by value: this module is not importable there
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _cell(notebook, grade_id):
    cells = json.loads(notebook.read_text())["cells"]
    cell = next(c for c in cells if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id)
    return "".join(cell["source"])


def exercise_classes(notebook, sharded=None):
    """(ShardedParameters, MyZeRO3Adam) as the notebook's two exercise cells define them;
    `sharded`: put this class under MyZeRO3Adam instead of the notebook's own."""
    # a module missing from sys.modules: cloudpickle sends what it defines by value
    module = types.ModuleType(f"exercise_{notebook.parent.parent.name}_{id(sharded)}")
    exec(compile(_cell(notebook, "sharded_parameters"), f"{notebook.name}:sharded_parameters", "exec"),
         module.__dict__)
    if sharded is not None:
        module.ShardedParameters = sharded
    exec(compile(_cell(notebook, "my_zero3"), f"{notebook.name}:my_zero3", "exec"), module.__dict__)
    return module.ShardedParameters, module.MyZeRO3Adam


Sharded, Solution = exercise_classes(SOLUTION)
UntouchedSharded, UntouchedHooks = exercise_classes(RELEASE)


class _Done:
    """A finished collective (what a blocking call leaves behind)."""

    def wait(self):
        pass


# ---------------------------------------------------------------------------------------
# the classic bugs of exercise 1 (gather and free)


class SyncGather(Sharded):
    """start_gather waits for the all-gather and installs the parameters: no overlap."""

    def start_gather(self, bi):
        if self.full[bi] is not None or bi in self.gathering:
            return
        full = torch.empty(self.buckets[bi].padded_numel)
        all_gather(full, self.flat_params[bi], group=self.group)
        with torch.no_grad():
            for p, view in zip(self.buckets[bi].params, self.buckets[bi].views(full)):
                p.data = view
        self.full[bi] = full


class GathersTwice(Sharded):
    """finish_gather starts a fresh all-gather even when a prefetch is in flight."""

    @torch.no_grad()
    def finish_gather(self, bi):
        if self.full[bi] is not None:
            return
        self.free(bi)  # drops the prefetch (after waiting for it) ...
        self.start_gather(bi)  # ... and gathers again
        work, full, _ = self.gathering.pop(bi)
        work.wait()
        for p, view in zip(self.buckets[bi].params, self.buckets[bi].views(full)):
            p.data = view
        self.full[bi] = full


class NoWait(Sharded):
    """finish_gather installs the views without waiting for the all-gather: on gloo and a small
    buffer the data is usually there already; on a real network the weights are half written."""

    @torch.no_grad()
    def finish_gather(self, bi):
        self.start_gather(bi)
        if bi in self.gathering:
            work, full, _shard = self.gathering.pop(bi)  # BUG: no work.wait()
            for p, view in zip(self.buckets[bi].params, self.buckets[bi].views(full)):
                p.data = view
            self.full[bi] = full


class FreeKeepsBuffer(Sharded):
    """free empties the parameters but keeps the gathered buffer in self.full."""

    @torch.no_grad()
    def free(self, bi):
        if bi in self.gathering:
            self.gathering.pop(bi)[0].wait()
        for p in self.buckets[bi].params:
            p.data = torch.empty(0)


class DropsReferencesOnly(Sharded):
    """free() drops every reference to the buffer but does not release its memory: autograd's
    saved views of the weights keep the whole unit alive from forward to backward."""

    @torch.no_grad()
    def free(self, bi):
        if bi in self.gathering:
            self.gathering.pop(bi)[0].wait()
        if self.full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0)
            self.full[bi] = None
            self._gather_buffers[bi] = None  # a fresh buffer next time


class FreshBuffer(Sharded):
    """Releases the memory in place, but gathers into a new tensor every time: the views
    autograd saved in forward are left on the released storage, and backward fails."""

    def gather_buffer(self, bi, shard):
        return torch.empty(self.buckets[bi].padded_numel, dtype=shard.dtype)


class KeepsUnusedPrefetch(Sharded):
    """free() waits for a prefetch nobody used and forgets it, but leaves its buffer's memory
    allocated (the text once read that way): a unit skipped by a data-dependent branch keeps
    a full-size buffer alive between steps."""

    @torch.no_grad()
    def free(self, bi):
        if bi in self.gathering:
            self.gathering.pop(bi)[0].wait()  # BUG: no resize_(0) of the prefetch's buffer
        if self.full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.full[bi].untyped_storage().resize_(0)
            self.full[bi] = None


class GatherWithoutGroup(Sharded):
    """The all-gather issued without group=: it runs on the default group, right only while
    the optimizer's group is every rank (on a subgroup: other ranks' shards, or a crash)."""

    def start_gather(self, bi):
        if self.full[bi] is not None or bi in self.gathering:
            return
        shard = self.flat_params[bi]
        full = self.gather_buffer(bi, shard)
        work = all_gather(full, shard, async_op=True)  # BUG: no group=self.group
        self.gathering[bi] = (work, full, shard)


class FreesInFlightWithoutWait(Sharded):
    """free() releases the buffer of a prefetch nobody used without waiting for its all-gather,
    which may still be writing into that memory (hint 2's pitfall)."""

    @torch.no_grad()
    def free(self, bi):
        if bi in self.gathering:
            _work, full, _shard = self.gathering.pop(bi)  # BUG: no work.wait() before releasing
            full.untyped_storage().resize_(0)
        if self.full[bi] is not None:
            for p in self.buckets[bi].params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.full[bi].untyped_storage().resize_(0)
            self.full[bi] = None


class StashesFullCopy(Sharded):
    """free() keeps a copy of the gathered weights "for later": the parameters look sharded,
    a full copy lives on."""

    @torch.no_grad()
    def free(self, bi):
        if not hasattr(self, "_kept"):
            self._kept = {}
        if self.full[bi] is not None:
            self._kept[bi] = self.full[bi].clone()
        super().free(bi)


# ---------------------------------------------------------------------------------------
# the classic bugs of exercise 2 (the hooks)


class NeverFrees(Solution):
    """Gathers each unit and never frees it during the step (only the scaffold's end of
    backward does): right numbers, ZeRO-2's memory inside the step."""

    def post_forward(self, u, module, args, output):
        if torch.is_grad_enabled():
            register = torch.autograd.graph.register_multi_grad_hook
            tensors = [t for t in torch.utils._pytree.tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register(tensors, lambda grad, u=u: self.pre_backward(u, grad), mode="any")

    def send(self, bi):
        zerokit.ZeRO2Adam.send(self, bi)


class KeepsUntilEndOfBackward(Solution):
    """Frees after forward, but in backward keeps every unit until the end of backward."""

    def send(self, bi):
        zerokit.ZeRO2Adam.send(self, bi)


class NoRegather(Solution):
    """Frees after forward and never gathers again for backward (no multi-grad hook)."""

    def post_forward(self, u, module, args, output):
        if u != 0 or not torch.is_grad_enabled():
            for bi in self.buckets_of_unit[u]:
                self.free(bi)


class KeepsCopies(Solution):
    """Frees the parameters, but keeps a full copy of every unit "just in case": right
    numbers, right collectives, and a full copy of the model alive at rest."""

    def post_forward(self, u, module, args, output):
        if not hasattr(self, "_copies"):
            self._copies = {}
        self._copies[u] = [p.detach().clone() for bi in self.buckets_of_unit[u] for p in self.buckets[bi].params]
        super().post_forward(u, module, args, output)


class RootKeptAfterEval(Solution):
    """Keeps the root gathered after its forward even under torch.no_grad(): no backward
    follows an evaluation, so the root (an LLM's tied embedding) stays full at rest."""

    def post_forward(self, u, module, args, output):
        if torch.is_grad_enabled():
            tensors = [t for t in torch.utils._pytree.tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda grad, u=u: self.pre_backward(u, grad),
                                                              mode="any")
        if u != 0:  # BUG: the root is kept for a backward even when none will come
            for bi in self.buckets_of_unit[u]:
                self.free(bi)


class OneTensorOutput(Solution):
    """Hooks the unit's output as if it were one tensor: a unit returning a tuple (as
    nn.MultiheadAttention does) or a dict breaks the forward hook."""

    def post_forward(self, u, module, args, output):
        backward_coming = torch.is_grad_enabled()
        if backward_coming and output.requires_grad:  # BUG: output may be a tuple or a dict
            output.register_hook(lambda grad, u=u: self.pre_backward(u, grad))
        if u != 0 or not backward_coming:
            for bi in self.buckets_of_unit[u]:
                self.free(bi)


class FreesRootAfterForward(Solution):
    """Frees every unit after its forward, the root too: its backward gathers it again, one
    extra all-gather of the root (an LLM's tied embedding) every step."""

    def post_forward(self, u, module, args, output):
        if torch.is_grad_enabled():
            tensors = [t for t in torch.utils._pytree.tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda grad, u=u: self.pre_backward(u, grad),
                                                              mode="any")
        for bi in self.buckets_of_unit[u]:  # BUG: the root too
            self.free(bi)


class ModeAllHook(Solution):
    """The multi-grad hook with mode="all": it fires once every output tensor has its gradient,
    but autograd goes into a unit with several outputs (mix returns a dict) at the first one,
    and its weights are still empty there."""

    def post_forward(self, u, module, args, output):
        backward_coming = torch.is_grad_enabled()
        if backward_coming:
            tensors = [t for t in torch.utils._pytree.tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grads, u=u: self.pre_backward(u, grads), mode="all")  # BUG: "any"
        if u != 0 or not backward_coming:
            for bi in self.buckets_of_unit[u]:
                self.free(bi)


class WaitsBeforePrefetch(Solution):
    """Waits for u's transfer, then starts the next unit's: the next still overlaps u's compute
    (it is gathered ahead of its turn), but not the wait for u's own transfer."""

    def gather_unit(self, u, prefetch_next=None):
        for bi in self.buckets_of_unit[u]:
            self.start_gather(bi)
        for bi in self.buckets_of_unit[u]:
            self.finish_gather(bi)  # BUG: before the next one's start_gather
        if self.prefetch and prefetch_next is not None:
            for bi in self.buckets_of_unit[prefetch_next]:
                self.start_gather(bi)


class BackwardPrefetchInForwardOrder(Solution):
    """In backward, prefetches the unit that comes next in *forward*: one whose backward is over,
    gathered again for nothing, while the unit whose backward comes next is not prefetched."""

    def pre_backward(self, u, grad):
        self.gather_unit(u, prefetch_next=self.next_in_forward(u))  # BUG: next_in_backward


class AllReduceGradients(Solution):
    """All-reduces each unit's gradients and keeps this rank's slice: right numbers, the
    gradient not reduce-scattered (twice the traffic)."""

    @torch.no_grad()
    def send(self, bi):
        bucket = self.buckets[bi]
        flat = bucket.flatten([p.grad for p in bucket.params])
        for p in bucket.params:
            p.grad = None
        dist.all_reduce(flat, group=self.group)
        out = bucket.shard(flat).div(self.world_size)
        self._in_flight.append((_Done(), bi, out, flat))
        self._next = bi + 1
        self.free(bi)


class NoPrefetch(Solution):
    """Never gathers ahead: each unit waits for its own all-gather."""

    def gather_unit(self, u, prefetch_next=None):
        for bi in self.buckets_of_unit[u]:
            self.finish_gather(bi)


class PrefetchAlways(Solution):
    """Prefetches even with prefetch=False."""

    def gather_unit(self, u, prefetch_next=None):
        for bi in self.buckets_of_unit[u] + (self.buckets_of_unit[prefetch_next] if prefetch_next is not None else []):
            self.start_gather(bi)
        for bi in self.buckets_of_unit[u]:
            self.finish_gather(bi)


class UsesTorchAdamW(Solution):
    """Steps with torch.optim.AdamW on the gathered weights instead of the sharded Adam."""

    def step(self, closure=None):
        with self.gathered():
            torch.optim.AdamW(self.module.parameters(), lr=self.param_groups[0]["lr"]).step()


class SubclassesZeRO3(zerokit.ZeRO3Adam):
    """zerokit's ZeRO-3 under the student's name."""


class BorrowsFree(Sharded):
    free = zerokit.ZeRO3Adam.free


class BorrowsPreForward(Solution):
    pre_forward = zerokit.ZeRO3Adam.pre_forward


# ---------------------------------------------------------------------------------------
# the checks, in the configurations of the notebook's test cells


def _numerics_visible(cls, **kw):
    lesson05.check_numerics(cls, world_size=2, model="edge", **kw)
    lesson05.check_numerics(cls, world_size=2, model="awkward", units="children", **kw)  # a tuple, a dict


# (the solution passes these and the hidden configurations: nbmake runs solutions/05_zero3, and
# test_autograde grades it)
VISIBLE_MECHANICS = {
    "gather_free": lambda cls, **kw: lesson05.check_gather_free(cls, world_size=2, model="mlp", **kw),
}
# "awkward": a root unit that owns parameters (a tied embedding); with units="children", units
# that return a tuple and a dict of two tensors
VISIBLE_HOOKS = {
    "numerics": _numerics_visible,
    "memory": lambda cls, **kw: lesson05.check_memory(cls, world_size=2, model="awkward", **kw),
    "traffic": lambda cls, **kw: lesson05.check_traffic(cls, world_size=2, model="awkward", **kw),
}

# bug -> {check it must fail: a fragment of the reason}; it must pass every other check
MECHANICS_BUGS = {
    SyncGather: {"gather_free": "start the all-gather with async_op=True"},
    GathersTwice: {"gather_free": "must not be gathered again"},
    NoWait: {"gather_free": "finish_gather(0) of bucket 0"},
    FreeKeepsBuffer: {"gather_free": "still holds the gathered buffer"},
    DropsReferencesOnly: {"gather_free": "release it in place"},
    FreshBuffer: {"gather_free": "Gather into the same buffer every time"},
    StashesFullCopy: {"gather_free": "something keeps a copy of the gathered weights"},
    KeepsUnusedPrefetch: {"gather_free": "a prefetch nobody used"},
    GatherWithoutGroup: {"gather_free": "issued without group=self.group"},
    FreesInFlightWithoutWait: {"gather_free": "without waiting for the transfer"},
}
HOOK_BUGS = {
    NeverFrees: {"memory": "free each unit's parameters in its forward post-hook"},
    KeepsUntilEndOfBackward: {"memory": "as soon as its gradients are sent"},
    KeepsCopies: {"memory": "something keeps full-size buffers alive"},
    AllReduceGradients: {"traffic": "reduce-scatters of the gradients only"},
    NoPrefetch: {"traffic": "with prefetch,"},
    PrefetchAlways: {"traffic": "without prefetch nothing is gathered ahead"},
    # what the awkward model shows (kit.SITUATIONS: tuple-output, root-params, eval-no-grad)
    OneTensorOutput: {"numerics": "the hook assumed one tensor output"},
    ModeAllHook: {"numerics": 'mode="all" fires once the last of them has its gradient'},
    RootKeptAfterEval: {"memory": "after an eval forward under torch.no_grad()"},
    FreesRootAfterForward: {"traffic": "freed after its forward and gathered again for backward"},
    WaitsBeforePrefetch: {"traffic": "but not the wait for"},
    # a wrong prefetch target in backward costs memory (a unit gathered again) and the overlap
    BackwardPrefetchInForwardOrder: {"memory": "(next_in_backward), not the next one in forward order",
                                     "traffic": "next_in_backward"},
    # a unit's backward cannot run on empty weights: every check that runs backward fails
    NoRegather: {name: "must be gathered again before that unit's backward" for name in VISIBLE_HOOKS},
    UsesTorchAdamW: {name: "your code called torch.optim.AdamW" for name in VISIBLE_HOOKS},
}
# a bug that may hang the ranks is stopped sooner than a student's would be
SHORT_TIMEOUT = 20.0


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(VISIBLE_MECHANICS, UntouchedSharded)
    fails_every_check(VISIBLE_HOOKS, UntouchedHooks)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls, checks, fragment", [
    (SubclassesZeRO3, VISIBLE_HOOKS, "subclasses zerokit.ZeRO3Adam"),
    (SubclassesZeRO3, VISIBLE_MECHANICS, "subclasses zerokit.ZeRO3Adam"),
    (BorrowsFree, VISIBLE_MECHANICS, "is zerokit.ZeRO3Adam.free"),
    (BorrowsPreForward, VISIBLE_HOOKS, "is zerokit.ZeRO3Adam.pre_forward"),
], ids=["subclass-hooks", "subclass-mechanics", "borrows-free", "borrows-pre-forward"])
def test_zerokit_zero3_under_another_name_fails(cls, checks, fragment, capsys):
    for name, check in checks.items():
        reason = outcome(check, cls, capsys)
        assert reason is not None and fragment in reason, (name, reason)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bug", list(MECHANICS_BUGS), ids=lambda b: b.__name__)
def test_each_mechanics_bug_fails_exactly_its_check(bug, capsys):
    fails_exactly(VISIBLE_MECHANICS, bug, MECHANICS_BUGS[bug], capsys, timeout=SHORT_TIMEOUT)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_hooks_are_graded_apart_from_the_mechanics(capsys):
    """Right hooks on top of an unfinished exercise 1 (its stubs raise) earn every hook
    check: those run MyZeRO3Adam with zerokit's start_gather, finish_gather and free()."""
    _, hooks = exercise_classes(SOLUTION, sharded=UntouchedSharded)
    fails_exactly(VISIBLE_HOOKS, hooks, {}, capsys, timeout=SHORT_TIMEOUT)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bug", list(HOOK_BUGS), ids=lambda b: b.__name__)
def test_each_hook_bug_fails_exactly_its_check(bug, capsys):
    fails_exactly(VISIBLE_HOOKS, bug, HOOK_BUGS[bug], capsys, timeout=SHORT_TIMEOUT)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_an_unused_prefetch_in_a_real_step_is_caught_on_the_branch_model():
    """Under zerokit's hooks, BranchNet's second step skips its unit `branch`: the unit
    prefetched for it is never used, and its buffer must hold no memory between steps (the
    part of check_gather_free after the bucket-by-bucket one)."""
    with pytest.raises(CheckFailed) as info:
        lesson05.run_on_ranks(lesson05._skipped_unit_case, 2, args=(KeepsUnusedPrefetch,), timeout=SHORT_TIMEOUT)
    assert "skipped its unit `branch`" in str(info.value) and "a prefetch nobody used" in str(info.value), info.value
    lesson05.run_on_ranks(lesson05._skipped_unit_case, 2, args=(Sharded,), timeout=SHORT_TIMEOUT)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_passing_traffic_check_states_only_what_was_measured(capsys):
    """A ZeRO-3 that never frees after forward moves 2Ψ: it may pass the traffic check (the
    memory check fails it), but the ✓ must not claim backward gathers or prefetches that did
    not happen."""
    lesson05.check_traffic(NeverFrees, world_size=2, model="mlp", timeout=SHORT_TIMEOUT)
    said = capsys.readouterr().out
    assert said.startswith("✓"), said
    assert "in forward and backward" not in said, said
    assert "no all-gather in backward" in said, said
    lesson05.check_traffic(Solution, world_size=2, model="mlp", timeout=SHORT_TIMEOUT)
    said = capsys.readouterr().out
    assert "+ 2348 in backward" in said and "3.00Ψ per step" in said, said
    assert "2 of 2 units in forward, 2 of 2 in backward" in said, said
