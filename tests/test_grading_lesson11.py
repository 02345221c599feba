"""Lesson 11's checks, validated on deliberately broken hpZ classes, quantisers and quantised gathers.

The code under test is solutions/11_zeropp's (the notebook's three solution cells, executed here as one
module), so what is validated is what students are graded against; the solution itself passes every
check, visible and hidden, when nbmake runs that notebook. Each broken version is one mistake; each must
fail the checks listed beside it, with a message that names it, and pass the others.

| defect | fails | message |
|---|---|---|
| backward gathers the primary shards over every rank (example) | hpZ traffic | "gathered across nodes in backward" |
| the unit kept whole after forward, beside its secondary (example) | hpZ memory | "whole gathered copy" |
| the secondary piece indexed by the rank in the whole group | hpZ numerics | "place in its node" |
| the secondary shard a view of the gathered buffer, not a copy | hpZ numerics | "view of the gathered buffer" |
| a secondary shard never dropped (not taken by the gather, not freed) | hpZ memory | "still held after backward" |
| every block with the whole tensor's scale (example) | quantize, training | "scale per tensor, not per block" |
| q cast to int8 without rounding | quantize | "rounded toward zero" |
| scales of max|x|/128 | quantize | "max|x|/128" |
| the scales tiled (the whole list repeated) in dequantisation | quantize | "wrong block's scale" |
| the shard quantised in place | quantize, training | "changed the tensor", "changed the shard" |
| the gathered values dequantised in one call (example) | gather | "wrong block's scale" |
| the fp32 shard gathered, quantised after (example) | gather | "went over the wire in fp32" |
| only the values gathered, this rank's scales for every chunk | gather | "wrong block's scale" |
| the gather on the default group (a subgroup job) | gather (hidden) | "raised" |
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
from zerokit.activations import in_backward
from zerokit.comm import all_gather
from zerokit.zero2 import weak_hook
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
    "gather": lambda m: lesson11.check_qwz_gather(m.qwz_all_gather, world_size=4, shard_numel=200, block=64),
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
# the example students (tests/submissions/lesson11.py): each fails its checks and passes the others


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, cell, edit, checks, expected", [
    ("across_nodes", "hpz_class", examples.HPZ_ACROSS_NODES, HPZ, {"traffic": "gathered across nodes in backward"}),
    ("whole_unit", "hpz_class", examples.HPZ_KEEPS_WHOLE_UNIT, HPZ, {"memory": "whole gathered copy"}),
    ("per_tensor", "quantize", examples.QWZ_PER_TENSOR, QWZ, {"quantize": "scale per tensor, not per block",
                                                               "training": "scale per tensor, not per block"}),
    ("wrong_block", "qwz_gather", examples.QWZ_WRONG_BLOCK_SCALE, QWZ, {"gather": "wrong block's scale"}),
    ("fp32", "qwz_gather", examples.QWZ_GATHERS_FP32, QWZ, {"gather": "went over the wire in fp32"}),
])
def test_example_defects_fail_exactly_their_checks(name, cell, edit, checks, expected, capsys):
    fails_exactly(checks, _module(name, **{cell: edit}), expected, capsys)


# ---------------------------------------------------------------------------------------
# more mistakes, each against the check meant to catch it

GROUP_RANK = _edited("k, j = dist.get_world_size(node), dist.get_rank(node)",
                     "k, j = dist.get_world_size(node), dist.get_rank()  # BUG: the rank in the whole group")
A_VIEW = _edited("secondary = self._full[bi][j * piece:(j + 1) * piece].clone()",
                 "secondary = self._full[bi][j * piece:(j + 1) * piece]  # BUG: a view, released by _free")
NEVER_DROPPED = lambda source: _edited(  # noqa: E731
    "        (secondary, node), self._secondary[bi] = self._secondary[bi], None  # the gather holds it until done",
    "        secondary, node = self._secondary[bi]  # BUG: the entry stays")(_edited(
        "        self._secondary[bi] = None\n        super()._free(bi)",
        "        super()._free(bi)  # BUG: the secondary shard is not dropped")(source))


@pytest.mark.timeout(180)
def test_hpz_mistakes_fail_their_check():
    fails(HPZ["numerics"], _module("group_rank", hpz_class=GROUP_RANK), match="place in its node")
    fails(HPZ["numerics"], _module("a_view", hpz_class=A_VIEW), match="view of the gathered buffer")
    fails(HPZ["memory"], _module("never_dropped", hpz_class=NEVER_DROPPED), match="still held after backward")


TRUNCATES = _edited("q = torch.round(blocks / divisor[:, None]).to(torch.int8)",
                    "q = (blocks / divisor[:, None]).to(torch.int8)  # BUG: a cast truncates")
BY_128 = _edited("scales = blocks.abs().amax(dim=1) / 127",
                 "scales = blocks.abs().amax(dim=1) / 128  # BUG")
TILED = _edited("x = q.float() * scales.repeat_interleave(block)[:q.numel()]",
                "x = q.float() * scales.repeat(block)[:q.numel()]  # BUG: the list repeated, not each scale")
IN_PLACE = _edited("    return q.view(-1)[:n], scales",
                   "    x.copy_((q.float() * divisor[:, None]).view(-1)[:n])  # BUG: the master weights rounded\n"
                   "    return q.view(-1)[:n], scales")
OWN_SCALES = _edited("    all_gather(scales_all, scales, group=group)\n",
                     "    scales_all = scales.repeat(n)  # BUG: this rank's scales for every rank's values\n")


@pytest.mark.timeout(240)
def test_quantiser_mistakes_fail_their_check():
    fails(QWZ["quantize"], _module("truncates", quantize=TRUNCATES), match="rounded toward zero")
    fails(QWZ["quantize"], _module("by_128", quantize=BY_128), match="max|x|/128")
    fails(QWZ["quantize"], _module("tiled", quantize=TILED), match="wrong block's scale")
    in_place = _module("in_place", quantize=IN_PLACE)
    fails(QWZ["quantize"], in_place, match="changed the tensor")
    fails(QWZ["training"], in_place, match="changed the shard")
    fails(QWZ["gather"], _module("own_scales", qwz_gather=OWN_SCALES), match="wrong block's scale")


DEFAULT_GROUP = _edited("    all_gather(q_all, q, group=group)\n    all_gather(scales_all, scales, group=group)\n",
                        "    all_gather(q_all, q)  # BUG: the default group, whatever group was given\n"
                        "    all_gather(scales_all, scales)\n")


@pytest.mark.timeout(180)
def test_the_hidden_situations_catch_them_too():
    """The gather on a subgroup (ranks 2-5 of 6): one that ignores its group fails; hpZ's traffic on the
    subgroup, whose nodes are {2, 3} and {4, 5}: a backward over every rank is named."""
    solution = _module("solution")
    lesson11.check_qwz_gather(solution.qwz_all_gather, world_size=4, shard_numel=300, block=128,
                              group_ranks=(2, 3, 4, 5))
    fails(lesson11.check_qwz_gather, _module("default_group", qwz_gather=DEFAULT_GROUP).qwz_all_gather,
          world_size=4, shard_numel=300, block=128, group_ranks=(2, 3, 4, 5), match="raised")
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
