"""Lesson 11's checks, validated on deliberately broken hpZ classes, quantisers and quantised gathers.

The code under test is solutions/11_zeropp's (the notebook's three solution cells, executed here as one
module), so what is validated is what students are graded against; the solution itself passes every
check, visible and hidden, when nbmake runs that notebook. Each broken version is one mistake; each must
fail the checks listed beside it, with a message that names it, and pass the others. Those marked
(example) are tests/submissions/lesson11.py's students, graded end to end by tests/test_autograde.py too.

| defect | fails | message |
|---|---|---|
| backward gathers the primary shards over every rank (example) | hpZ traffic | "gathered across nodes in backward" |
| backward's gather into a fresh tensor, not the bucket's buffer (example) | hpZ traffic | "a tensor of its own" |
| a synchronous gather that sets self.full itself (example) | hpZ traffic | "recorded no transfer" |
| no guard for a bucket full or on its way, the entry left (example) | hpZ traffic | "while bucket" |
| the secondary shards gathered on the whole group (example) | hpZ traffic | "gather it on the node's group" |
| the secondary shards gathered again in the next forward (example) | hpZ traffic | "inside a node" |
| the unit kept whole after forward, beside its secondary (example) | hpZ memory | "whole gathered copy" |
| the secondary shard never dropped (example) | hpZ memory | "still held after backward" |
| no secondary shard stored (example) | hpZ memory | "No secondary shard is kept" |
| the secondary piece indexed by the rank in the whole group | hpZ numerics, memory | "place in its node", "not 1/2" |
| the secondary shard a view of the gathered buffer | hpZ numerics, memory | "view of the gathered buffer", "views" |
| a piece the size of the primary shard | hpZ numerics, memory | "the size of a primary shard" |
| every block with the whole tensor's scale (example) | quantize, training | "scale per tensor, not per block" |
| out= ignored (example) | quantize | "left out unwritten" |
| out= written, None returned (example) | quantize | "returned NoneType" |
| no padding for a short last block (example) | quantize | "is not a multiple of" |
| the shard quantised in place (example) | quantize | "changed the tensor" |
| q cast to int8 without rounding | quantize | "rounded toward zero" |
| scales of max|x|/128 | quantize | "max|x|/128" |
| the scales tiled (the whole list repeated) in dequantisation | quantize | "wrong block's scale" |
| the gathered values dequantised in one call (example) | gather | "wrong block's scale" |
| the fp32 shard gathered, quantised after (example) | gather | "went over the wire in fp32" |
| the scales gathered on the default group (example) | gather (on ranks 1-4 of 5) | "not on the group it was given" |
| N from the world's size (example) | gather (on ranks 1-4 of 5) | "not the world's" |
| this rank's own chunk copied exact (example) | gather | "own chunk" |
| only the values gathered, this rank's scales for every chunk | gather | "wrong block's scale" |
| a subclass of zerokit's ZeROppAdam | every hpZ check | "subclasses" |
| zerokit's own quantize_blocks called | quantize | "zerokit.zeropp's own" |
| the untouched student notebook | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest

from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly, source_module
from tests.submissions import _solution_sources
from tests.submissions import lesson11 as examples
from zerokit.grading import lesson11

pytestmark = pytest.mark.distributed

PRELUDE = """
from functools import partial

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

import zerokit
from zerokit.comm import all_gather
from zerokit.hooks import in_backward, weak_hook
from zerokit.zeropp import node_group
"""
CELLS = ["hpz_class", "quantize", "qwz_gather"]

# the broken versions below are sent to the ranks by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOURCES = _solution_sources("11_zeropp")  # the solution cells, markers removed
STUDENT = exercise_module("11_zeropp", "lessons", CELLS, PRELUDE)

HPZ = {
    "numerics": lambda m: lesson11.check_hpz_numerics(m.MyHpZAdam, world_size=4, node_size=2, model="nested"),
    "traffic": lambda m: lesson11.check_hpz_traffic(m.MyHpZAdam, world_size=4, node_size=2, model="nested"),
    "memory": lambda m: lesson11.check_hpz_memory(m.MyHpZAdam, world_size=4, node_size=2, model="nested"),
}
QWZ = {
    "quantize": lambda m: lesson11.check_quantize(m.quantize_blocks, m.dequantize_blocks),
    # the notebook's visible gather test: a job on ranks 1-4 of 5 (a group that is not the world)
    "gather": lambda m: lesson11.check_qwz_gather(m.qwz_all_gather, world_size=4, shard_numel=200, block=64,
                                                  group_ranks=(1, 2, 3, 4)),
    "training": lambda m: lesson11.check_qwz_training(m.quantize_blocks, m.dequantize_blocks, world_size=4,
                                                      node_size=2, block=32),
}


def _module(name, **edits):
    """The solution's three cells as one module, with the cells named in `edits` changed (an edit of the
    solution cell's source, or a whole new source)."""
    cells = [(edits[c] if isinstance(edits[c], str) else edits[c](SOURCES[c])) if c in edits else SOURCES[c]
             for c in CELLS]
    return source_module(f"lesson11_{name}", "\n\n".join(cells), PRELUDE)


def _edited(old, new):
    def edit(source):
        assert old in source, f"the solution no longer contains {old!r}"
        return source.replace(old, new)
    return edit


@pytest.mark.timeout(240)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check({**HPZ, **QWZ}, STUDENT, match=UNFINISHED)


# ---------------------------------------------------------------------------------------
# the example students (tests/submissions/lesson11.py): each fails its check and passes the others
#
# Each check runs only some of the student's code (the hpZ checks one method each, with zerokit's others;
# the gather check with zerokit's quantiser; training with the student's quantiser on whole blocks, writing
# out= itself). The first two tests below prove that isolation once; each example is then run against the
# checks that run the code it changed (tests/test_autograde.py grades every example's whole notebook).

_GRADES = {"numerics": {"keep_secondary"}, "traffic": {"start_gather"}, "memory": {"keep_secondary", "free"}}
_LOST = {"test_hpz_numerics": "numerics", "test_hpz_traffic": "traffic", "test_hpz_memory": "memory",
         "test_quantize": "quantize", "test_qwz_gather": "gather", "test_qwz_training": "training"}
DEFECTS = examples.DEFECTS  # each alone (the graded notebooks hold one per exercise: one_per_exercise)


def _methods(source):
    import ast

    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "MyHpZAdam")
    return {f.name: ast.dump(f) for f in cls.body if isinstance(f, ast.FunctionDef)}


def _checks_that_run(cell, edited):
    """The checks that run the code the edit changed."""
    if cell == "hpz_class":
        before, after = _methods(SOURCES[cell]), _methods(edited)
        changed = {name for name in before | after if before.get(name) != after.get(name)}
        assert changed <= {"keep_secondary", "start_gather", "free"}, changed
        return {name: HPZ[name] for name, graded in _GRADES.items() if graded & changed}
    if cell == "quantize":
        return {"quantize": QWZ["quantize"], "training": QWZ["training"]}
    return {"gather": QWZ["gather"]}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("student", DEFECTS, ids=[s.id for s in DEFECTS])
def test_example_defects_fail_exactly_their_checks(student, capsys):
    (cell,) = [c for c, edit in student.cells.items() if edit is not examples.SOLUTION]
    edited = student.cells[cell](SOURCES[cell])
    lost = {_LOST[name]: student.reason for name, points in student.expected.items() if points == 0}
    checks = _checks_that_run(cell, edited)
    if cell == "quantize" and "training" not in lost:
        checks.pop("training")  # blind to it by construction: test_training_grades_what_the_quantiser_does
    assert set(lost) <= set(checks), (student.id, lost, list(checks))
    fails_exactly(checks, _module(student.id, **{cell: edited}), lost, capsys)


_UNCALLED = """
    def {name}(self, *args):
        raise AssertionError("the check called the student's {name}, which it does not grade")
"""


@pytest.mark.timeout(120)
def test_each_hpz_check_runs_only_the_methods_it_grades(capsys):
    """The solution with, in turn, every method but a check's own made to fail if called: each check
    passes, so a mistake in another method cannot cost it."""
    from tests.submissions import method_replaced

    for name, graded in _GRADES.items():
        edit = SOURCES["hpz_class"]
        for method in {"keep_secondary", "start_gather", "free"} - graded:
            edit = method_replaced(method, _UNCALLED.format(name=method))(edit)
        fails_exactly({name: HPZ[name]}, _module(f"only_{name}", hpz_class=edit), {}, capsys)


@pytest.mark.timeout(120)
def test_training_grades_what_the_quantiser_does_not_its_edge_cases(capsys):
    """check_qwz_training on a quantiser with the three mistakes check_quantize alone names (no padding
    for a short last block, its input rounded in place, out= ignored): it trains as the solution does."""
    edit = _both_edits(examples.QUANTIZE_NO_PADDING, examples.QUANTIZE_IN_PLACE, examples.DEQUANTIZE_IGNORES_OUT)
    fails_exactly({"training": QWZ["training"]}, _module("edge_cases", quantize=edit), {}, capsys)


def _both_edits(*edits):
    def edit(source):
        for e in edits:
            source = e(source)
        return source
    return edit


# ---------------------------------------------------------------------------------------
# more mistakes, each against the checks it breaks

GROUP_RANK = _edited("k, j = dist.get_world_size(node), dist.get_rank(node)",
                     "k, j = dist.get_world_size(node), dist.get_rank()  # BUG: the rank in the whole group")
A_VIEW = _edited("secondary = self.full[bi][j * piece:(j + 1) * piece].clone()",
                 "secondary = self.full[bi][j * piece:(j + 1) * piece]  # BUG: a view, released by free")
PRIMARY_SIZE = _edited("piece = self.buckets[bi].padded_numel // k",
                       "piece = self.buckets[bi].padded_numel // dist.get_world_size()  # BUG: the primary's size")


@pytest.mark.timeout(180)
def test_hpz_mistakes_in_the_piece_fail_numerics_and_memory_each_naming_it():
    """A wrong piece breaks what numerics checks (which piece) and what memory measures (its bytes)."""
    group_rank, a_view = _module("group_rank", hpz_class=GROUP_RANK), _module("a_view", hpz_class=A_VIEW)
    fails(HPZ["numerics"], group_rank, match="place in its node")
    fails(HPZ["memory"], group_rank, match="not 1/2 of their unit")
    fails(HPZ["numerics"], a_view, match="view of the gathered buffer")
    fails(HPZ["memory"], a_view, match="views of the gathered buffer")
    fails(lesson11.check_hpz_numerics, _module("primary", hpz_class=PRIMARY_SIZE).MyHpZAdam, world_size=4,
          node_size=2, model="awkward", units="children", match="the size of a primary shard")


TRUNCATES = _edited("q = torch.round(blocks / divisor[:, None]).to(torch.int8)",
                    "q = (blocks / divisor[:, None]).to(torch.int8)  # BUG: a cast truncates")
BY_128 = _edited("scales = blocks.abs().amax(dim=1) / 127",
                 "scales = blocks.abs().amax(dim=1) / 128  # BUG")
TILED = _edited("x = q.float() * scales.repeat_interleave(block)[:q.numel()]",
                "x = q.float() * scales.repeat(block)[:q.numel()]  # BUG: the list repeated, not each scale")
OWN_SCALES = _edited("    all_gather(scales_all, scales, group=group)\n",
                     "    scales_all = scales.repeat(n)  # BUG: this rank's scales for every rank's values\n")


@pytest.mark.timeout(120)
def test_quantiser_mistakes_fail_their_check():
    fails(QWZ["quantize"], _module("truncates", quantize=TRUNCATES), match="rounded toward zero")
    fails(QWZ["quantize"], _module("by_128", quantize=BY_128), match="max|x|/128")
    fails(QWZ["quantize"], _module("tiled", quantize=TILED), match="wrong block's scale")
    fails(QWZ["gather"], _module("own_scales", qwz_gather=OWN_SCALES), match="wrong block's scale")


DEFAULT_GROUP = _edited("    all_gather(q_all, q, group=group)\n    all_gather(scales_all, scales, group=group)\n",
                        "    all_gather(q_all, q)  # BUG: the default group, whatever group was given\n"
                        "    all_gather(scales_all, scales)\n")


@pytest.mark.timeout(180)
def test_the_hidden_situations_catch_them_too():
    """The gather on another subgroup (ranks 2-5 of 6, S = 300, B = 128): one that ignores its group fails,
    named; hpZ's traffic on the subgroup, whose nodes are {2, 3} and {4, 5}: a backward over every rank is
    named."""
    solution = _module("solution")
    lesson11.check_qwz_gather(solution.qwz_all_gather, world_size=4, shard_numel=300, block=128,
                              group_ranks=(2, 3, 4, 5))
    fails(lesson11.check_qwz_gather, _module("default_group", qwz_gather=DEFAULT_GROUP).qwz_all_gather,
          world_size=4, shard_numel=300, block=128, group_ranks=(2, 3, 4, 5), match="not on the group it was given")
    fails(lesson11.check_hpz_traffic, _module("across6", hpz_class=examples.HPZ_ACROSS_NODES).MyHpZAdam,
          world_size=4, node_size=2, model="awkward", group_ranks=(2, 3, 4, 5), match="(2, 3, 4, 5)")


@pytest.mark.timeout(60)
def test_zerokits_own_answers_are_refused():
    import zerokit.zeropp

    class Borrowed(zerokit.zeropp.ZeROppAdam):
        pass

    for check in HPZ.values():
        fails(lambda m: check(m), type("M", (), {"MyHpZAdam": Borrowed}), match="subclasses")
    borrowing = _module("borrowing", quantize="from zerokit.zeropp import quantize_blocks, dequantize_blocks\n")
    fails(QWZ["quantize"], borrowing, match="zerokit.zeropp's own")
