"""Lesson 04's grader, validated: the untouched student notebook fails every check,
and each classic ZeRO-2 bug fails exactly the check meant to catch it, with a message
that names the problem.

The classes under test come from the notebooks themselves (the exercise cell of
solutions/ and of lessons/), so this file tests what a student gets and what the
instructor ships. The broken variants below subclass the solution and replace one method.
"""

import json
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import zerokit
from zerokit.comm import reduce_scatter
from zerokit.grading import lesson04
from conftest import ROOT, exercise_module, fails_every_check, fails_exactly, outcome

# the classes below are sent to the ranks by value: this module is not importable there
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# MyZeRO2Adam as the notebook's exercise cell defines it, in what the instructor ships and
# in what a student gets
Solution = exercise_module("04_zero2", "solutions", ["my_zero2"]).MyZeRO2Adam
Untouched = exercise_module("04_zero2", "lessons", ["my_zero2"]).MyZeRO2Adam


class _Done:
    """A finished collective (what a blocking call leaves behind)."""

    def wait(self):
        pass


# ---------------------------------------------------------------------------------------
# the classic bugs


class KeepsFullGradient(Solution):
    """Sends on time but never frees .grad: the full gradient outlives backward."""

    @torch.no_grad()
    def send(self, bi):
        bucket = self.buckets[bi]
        flat = bucket.flatten([p.grad for p in bucket.params])
        out = torch.empty(bucket.shard_numel)
        work = reduce_scatter(out, flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self._in_flight.append((work, bi, out, flat))
        self._next = bi + 1


class FreesLate(KeepsFullGradient):
    """Frees .grad only at the end of backward: every gradient is alive at once."""

    @torch.no_grad()
    def _end_of_backward(self):
        super()._end_of_backward()
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = None


class AllReduceKeepSlice(Solution):
    """All-reduce every bucket and keep a copy of this rank's slice: right numbers, twice
    the traffic, and the full reduced gradient alive on every rank while it lasts."""

    view = False

    @torch.no_grad()
    def send(self, bi):
        bucket = self.buckets[bi]
        flat = bucket.flatten([p.grad for p in bucket.params])
        for p in bucket.params:
            p.grad = None
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self._in_flight.append((work, bi, None, flat))
        self._next = bi + 1

    @torch.no_grad()
    def _end_of_backward(self):
        while self._next < len(self.buckets):
            self.send(self._next)
        for work, bi, _, flat in self._in_flight:
            work.wait()
            flat.div_(self.world_size)
            mine = self.buckets[bi].shard(flat)
            mine = mine if self.view else mine.clone()
            self.grad_shards[bi] = mine if self.grad_shards[bi] is None else self.grad_shards[bi] + mine


class AllReduceKeepView(AllReduceKeepSlice):
    """The same, keeping a view of the all-reduced buffer: the full gradient survives too."""

    view = True


class ReduceToRankZero(Solution):
    """Reduce every bucket to rank 0, which scatters the shards: rank 0 holds the full
    gradient and all traffic funnels through it."""

    @torch.no_grad()
    def send(self, bi):
        bucket = self.buckets[bi]
        flat = bucket.flatten([p.grad for p in bucket.params])
        for p in bucket.params:
            p.grad = None
        dist.reduce(flat, dst=0, group=self.group)
        out = torch.empty(bucket.shard_numel)
        chunks = list(flat.div(self.world_size).chunk(self.world_size)) if self.rank == 0 else None
        dist.scatter(out, chunks, src=0, group=self.group)
        self._in_flight.append((_Done(), bi, out, flat))
        self._next = bi + 1


class SendsAtEnd(Solution):
    """Counts the gradients but sends every bucket at the end of backward: no overlap."""

    def _on_grad_ready(self, param):
        bi, _ = self._where[param]
        self._ready[bi] += 1


class SendsWhenFull(Solution):
    """Sends a bucket as soon as it is complete, whatever the order: ranks whose gradients
    arrive differently issue their collectives in different orders."""

    def _begin_backward(self):
        super()._begin_backward()
        self._sent = set()

    def _on_grad_ready(self, param):
        bi, _ = self._where[param]
        self._ready[bi] += 1
        if self._ready[bi] == len(self.buckets[bi].params):
            self._send_any(bi)

    @torch.no_grad()
    def _send_any(self, bi):
        self.send(bi)
        self._sent.add(bi)

    @torch.no_grad()
    def _end_of_backward(self):
        for bi in range(len(self.buckets)):
            if bi not in self._sent:
                self._send_any(bi)
        for work, bi, out, _ in self._in_flight:
            work.wait()
            self.grad_shards[bi] = out if self.grad_shards[bi] is None else self.grad_shards[bi] + out


class NoFlush(Solution):
    """Waits at the end of backward but never sends the buckets still incomplete."""

    @torch.no_grad()
    def _end_of_backward(self):
        for work, bi, out, _ in self._in_flight:
            work.wait()
            self.grad_shards[bi] = out if self.grad_shards[bi] is None else self.grad_shards[bi] + out


class OverwritesShards(Solution):
    """Each backward replaces the kept shard instead of adding to it."""

    @torch.no_grad()
    def _end_of_backward(self):
        while self._next < len(self.buckets):
            self.send(self._next)
        for work, bi, out, _ in self._in_flight:
            work.wait()
            self.grad_shards[bi] = out


class SumNotMean(Solution):
    """Reduce-scatter with SUM: the gradient is N times too large (Adam hides most of it)."""

    @torch.no_grad()
    def send(self, bi):
        bucket = self.buckets[bi]
        flat = bucket.flatten([p.grad for p in bucket.params])
        for p in bucket.params:
            p.grad = None
        out = torch.empty(bucket.shard_numel)
        work = reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._in_flight.append((work, bi, out, flat))
        self._next = bi + 1


class IfNotWhile(Solution):
    """`if` where `while` belongs: a gradient that completes the head of the line sends only the head,
    though buckets behind it are complete too (gradients out of bucket order): they go out late."""

    def _on_grad_ready(self, param):
        bi, _ = self._where[param]
        self._ready[bi] += 1
        if self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self.send(self._next)


class WaitsInSend(Solution):
    """Waits for each reduce-scatter inside send(): right numbers, no overlap with backward."""

    @torch.no_grad()
    def send(self, bi):
        super().send(bi)
        self._in_flight[-1][0].wait()


class BlockingSend(Solution):
    """The reduce-scatter called blocking (async_op=False), a finished stand-in kept as its work."""

    @torch.no_grad()
    def send(self, bi):
        bucket = self.buckets[bi]
        flat = bucket.flatten([p.grad for p in bucket.params])
        for p in bucket.params:
            p.grad = None
        out = torch.empty(bucket.shard_numel)
        reduce_scatter(out, flat, op=dist.ReduceOp.AVG, group=self.group)
        self._in_flight.append((_Done(), bi, out, flat))
        self._next = bi + 1


class DefaultGroup(Solution):
    """Reduce-scatters on the default group instead of self.group: right only while they are the same."""

    @torch.no_grad()
    def send(self, bi):
        bucket = self.buckets[bi]
        flat = bucket.flatten([p.grad for p in bucket.params])
        for p in bucket.params:
            p.grad = None
        out = torch.empty(bucket.shard_numel)
        work = reduce_scatter(out, flat, op=dist.ReduceOp.AVG, async_op=True)
        self._in_flight.append((work, bi, out, flat))
        self._next = bi + 1


class CapsOneInFlight(Solution):
    """Not a bug: at most one transfer in flight, so the next send first waits for the previous one
    (section 8's cap, at 1). Each transfer still overlaps the backward up to the next send."""

    @torch.no_grad()
    def send(self, bi):
        while self._in_flight:
            work, b, out, _flat = self._in_flight.pop(0)
            work.wait()
            self.grad_shards[b] = out if self.grad_shards[b] is None else self.grad_shards[b] + out
        super().send(bi)


class SubclassesZeRO2(zerokit.ZeRO2Adam):
    """zerokit's ZeRO-2 under the student's name."""


class BorrowsSend(Solution):
    send = zerokit.ZeRO2Adam.send


# ---------------------------------------------------------------------------------------
# the checks, in the visible configurations of the notebook's test cells

VISIBLE = {
    "numerics": lambda cls, **kw: lesson04.check_numerics(cls, world_size=2, model="mlp", bucket_numel=300, **kw),
    "memory": lambda cls, **kw: lesson04.check_memory(cls, world_size=2, model="mlp", bucket_numel=300, **kw),
    "traffic": lambda cls, **kw: lesson04.check_traffic(cls, world_size=2, model="mlp", bucket_numel=300, **kw),
    "unused_parameters": lambda cls, **kw: lesson04.check_unused_parameters(cls, world_size=2,
                                                                            models=("edge", "branch"), bucket_numel=100,
                                                                            **kw),
    "accumulation": lambda cls, **kw: lesson04.check_accumulation(cls, world_size=2, model="mlp", bucket_numel=300,
                                                                  accum=3, **kw),
}
# (the solution passes these and the hidden configurations: nbmake runs solutions/04_zero2, and
# test_autograde grades it)


def _hidden(grade_id, check):
    """The hidden call of lesson04.<check> in the solution's test cell grade_id, as check(cls, **kw)."""
    nb = json.loads((ROOT / "solutions" / "04_zero2" / "04_zero2.ipynb").read_text())
    src = next("".join(c["source"]) for c in nb["cells"]
               if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == grade_id)
    hidden = src.split("### BEGIN HIDDEN TESTS")[1]
    call = next(line for line in hidden.splitlines() if line.startswith(f"lesson04.{check}(MyZeRO2Adam, "))
    args = call[len(f"lesson04.{check}(MyZeRO2Adam, "):-1]
    return eval(f"lambda cls, **kw: lesson04.{check}(cls, {args}, **kw)", {"lesson04": lesson04})


# buckets of 30 on the transformer (gradients out of bucket order), on a group of ranks 1, 2 of 3
HIDDEN_TRAFFIC = _hidden("test_reduced_during_backward", "check_traffic")

# bug -> {check it must fail: a fragment of the reason}; it must pass every other check
BUGS = {
    # never freeing .grad also breaks accumulation: each backward adds into the last one's .grad,
    # so k micro-batches sum to k*g1 + (k-1)*g2 + ... (issue 18)
    KeepsFullGradient: {"memory": ".grad is still set", "accumulation": ".grad is still set"},
    FreesLate: {"memory": "was still alive"},
    AllReduceKeepSlice: {"traffic": "all-reduce"},
    AllReduceKeepView: {"memory": "view into a buffer", "traffic": "all-reduce"},
    ReduceToRankZero: {"traffic": "reduce + scatter"},
    SendsAtEnd: {"traffic": "not at the end of backward"},
    SendsWhenFull: {"unused_parameters": "even ranks only"},
    NoFlush: {"unused_parameters": "after the step differs"},  # the last buckets never sent: stale weights
    OverwritesShards: {"accumulation": "must be added to grad_shards"},
    SumNotMean: {"numerics": "the mean over ranks, not the sum"},
    WaitsInSend: {"traffic": "was waited for inside send()"},
}
# Adam is nearly blind to the scale of the gradient, but not quite (eps): the weights that
# unused_parameters and accumulation compare may drift past their tolerance too
MAY_ALSO_FAIL = {SumNotMean: {"unused_parameters", "accumulation"}}
# a bug that may hang the ranks is stopped sooner than a student's would be
SHORT_TIMEOUT = 20.0


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(VISIBLE, Untouched)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls, fragment", [(SubclassesZeRO2, "subclasses zerokit.ZeRO2Adam"),
                                           (BorrowsSend, "is zerokit.ZeRO2Adam.send")])
def test_zerokit_zero2_under_another_name_fails_every_check(cls, fragment, capsys):
    for name, check in VISIBLE.items():
        reason = outcome(check, cls, capsys)
        assert reason is not None and fragment in reason, (name, reason)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bug", list(BUGS), ids=lambda b: b.__name__)
def test_each_bug_fails_exactly_its_check(bug, capsys):
    fails_exactly(VISIBLE, bug, BUGS[bug], capsys, may_also_fail=MAY_ALSO_FAIL.get(bug, ()), timeout=SHORT_TIMEOUT)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_bucket_order_rule_is_told_only_where_the_gradient_shards_point_at_it(capsys):
    """check_unused_parameters once added its rule (same reduce-scatters, same order, every bucket
    flushed) to every failure: a sum for a mean that drifted the weights was told about bucket order.
    Now the shards backward left say which: a bucket never sent gets the rule, a sum gets the sum."""
    summed = outcome(VISIBLE["unused_parameters"], SumNotMean, capsys, timeout=SHORT_TIMEOUT)
    if summed is not None:  # Adam may hide the scale within the tolerance
        assert "the reduce-scatter summed" in summed and lesson04.ORDER_RULE not in summed, summed
    unflushed = outcome(VISIBLE["unused_parameters"], NoFlush, capsys, timeout=SHORT_TIMEOUT)
    assert unflushed is not None and lesson04.ORDER_RULE in unflushed and "grad_shards[" in unflushed, unflushed


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bug, fragment", [
    # LayerNorm's bias completes its weight's bucket too
    (IfNotWhile, "completed 2 buckets at once (bucket 1 (norm.bias); bucket 2 (norm.weight)"),
    (BlockingSend, "was issued blocking (async_op=False)"),
    (DefaultGroup, "went to ranks [0, 1, 2] (the default group?), not to the optimizer's group, ranks [1, 2]"),
], ids=["IfNotWhile", "BlockingSend", "DefaultGroup"])
def test_the_hidden_traffic_check_catches_what_only_its_fixture_shows(bug, fragment, capsys):
    """Out-of-order gradients (a bucket completed behind the head) and a subgroup are in the hidden
    configuration only; a blocking call is the wait in send by another name."""
    reason = outcome(HIDDEN_TRAFFIC, bug, capsys, timeout=SHORT_TIMEOUT)
    assert reason is not None and fragment in reason.splitlines()[0], reason


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls", [Solution, CapsOneInFlight], ids=lambda c: c.__name__)
def test_the_hidden_traffic_check_passes_the_solution_and_a_cap_on_transfers_in_flight(cls, capsys):
    """A cap waits for an earlier transfer inside the next send: not the wait the check refuses."""
    assert outcome(HIDDEN_TRAFFIC, cls, capsys, timeout=SHORT_TIMEOUT) is None


# ---------------------------------------------------------------------------------------
# the stretch exercise: clipping sharded gradients, checked when attempted and worth no points

clip_solution = exercise_module("04_zero2", "solutions", ["my_zero2", "stretch_clipping"]).clip_sharded_grad_norm_


def _shards(opt):
    return [g for g in opt.grad_shards if g is not None]


def clip_local_norm(opt, max_norm):
    """This rank's shards only: no all-reduce."""
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in _shards(opt))))
    for g in _shards(opt):
        g.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def clip_sum_of_norms(opt, max_norm):
    """The ranks' norms added, not their squares."""
    norm = torch.sqrt(sum((g ** 2).sum() for g in _shards(opt)))
    dist.all_reduce(norm)
    for g in _shards(opt):
        g.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))
    return float(norm)


def clip_never(opt, max_norm):
    """The right norm, and no clipping."""
    sq = sum((g ** 2).sum() for g in _shards(opt))
    dist.all_reduce(sq)
    return float(sq.sqrt())


def clip_with_zerokit(opt, max_norm):
    return float(opt.clip_grad_norm_(max_norm))


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_stretch_clipping_is_checked_when_attempted_and_never_fails_its_cell(capsys):
    lesson04.check_clipping(clip_solution)
    assert capsys.readouterr().out.startswith("✓")
    for fn, fragment in ((clip_local_norm, "this rank's shards only"), (clip_sum_of_norms, "sum of the ranks' norms"),
                         (clip_never, "must be scaled by max_norm"), (clip_with_zerokit, "write the clipping yourself")):
        with pytest.raises(lesson04.CheckFailed) as info:
            lesson04.check_clipping(fn)
        assert fragment in str(info.value), (fn.__name__, str(info.value))
    capsys.readouterr()
    assert lesson04.try_stretch(None) is False and "not attempted" in capsys.readouterr().out
    assert lesson04.try_stretch(clip_never) is False
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("✗ stretch:")
    assert lesson04.try_stretch(clip_solution) is True
