"""Lesson 12's checks, validated on deliberately broken dim-0 shards, all-gather copies and chunk-cats.

The code under test is solutions/12_fsdp2's (the notebook's three solution cells, executed here as one
module), so what is validated is what students are graded against; the solution itself passes every
check, visible and hidden, when nbmake runs that notebook. Each broken version is one mistake; each must
fail the check listed beside it, with a message that names it, and pass the others.

| defect | fails | message |
|---|---|---|
| dim0_chunk's padded rows by floor division (example) | dim0_chunk | "rows // N = " |
| an even split, the first R mod N ranks one row more | dim0_chunk | "even split" |
| the start not clamped: past the last row | dim0_chunk | "past the last row" |
| every rank given c rows, the last too | dim0_chunk | "every rank cannot hold" |
| the DTensor without shape= and stride= (example) | shard_param | "Without shape= and stride=" |
| the local tensor a copy of the storage's rows | shard_param | "not a view of the start of padded" |
| the local tensor the padded rows, padding included | shard_param | "padding rows are storage" |
| a frozen parameter made trainable | shard_param | "frozen parameter came back trainable" |
| the cut by the default group's rank and size (a subgroup mesh) | shard_param (hidden) | "default group's" |
| the storage in the default dtype (bf16 parameters) | shard_param (hidden) | "keeps its own dtype" |
| the shard cut by distribute_tensor (a scatter) | shard_param | "communicated" |
| the copy-in's row a copy (example) | copy_in | "not a view of the output" |
| the row at offset 0 on every rank | copy_in | "starts at element 0" |
| no cast to the compute dtype (bf16) | copy_in (hidden) | "where the shards are cast" |
| the copy-out without preserving version counters (example) | copy_out | "version counters" |
| the copy-out parameter-major (contiguous blocks of the output) | copy_out | "one after another" |
| the copy-out into new tensors, not into outs | copy_out | "not (or not all) written" |
| the chunk-cat parameter-major (example) | chunk_cat | "each padded gradient whole" |
| the chunk-cat without padding | chunk_cat | "without padding" |
| no cast to the reduce dtype (bf16 gradients) | chunk_cat (hidden) | "where the gradients are cast" |
| the shard gradients' offset advanced by length (example) | shard_grads | "the rows this rank holds" |
| the shard gradients copies of the output | shard_grads | "a copy, not a view" |
| plain tensors for gradients | shard_grads | "not a DTensor" |
| zerokit.fully_shard's own functions imported | the check of each | "zerokit.fully_shard's own" |
| the untouched student notebook | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest
import torch

from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly, source_module
from tests.submissions import _solution_sources
from tests.submissions import lesson12 as examples
from zerokit.grading import lesson12

pytestmark = pytest.mark.distributed

PRELUDE = """
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
"""
CELLS = ["dim0_shard", "all_gather_copies", "reduce_scatter_copies"]

# the broken versions below are sent to the ranks by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOURCES = _solution_sources("12_fsdp2")  # the solution cells, markers removed
STUDENT = exercise_module("12_fsdp2", "lessons", CELLS, PRELUDE)

CHECKS = {
    "dim0_chunk": lambda m: lesson12.check_dim0_chunk(m.dim0_chunk),
    "shard_param": lambda m: lesson12.check_shard_param(m.shard_param, world_size=3),
    "copy_in": lambda m: lesson12.check_copy_in(m.all_gather_copy_in, world_size=3),
    "copy_out": lambda m: lesson12.check_copy_out(m.all_gather_copy_out, world_size=3),
    "chunk_cat": lambda m: lesson12.check_chunk_cat(m.reduce_scatter_copy_in, world_size=3),
    "shard_grads": lambda m: lesson12.check_shard_grads(m.shard_grads, world_size=3),
}

# The checks that call a cell's functions: the only ones a mistake in that cell can reach (every check
# builds its inputs from torch; shard_param's and shard_grads' calls to dim0_chunk are given zerokit's,
# which is what the dim0_shard cell's list holds them to). So one bug costs one check is asked of those.
READS = {"dim0_shard": ("dim0_chunk", "shard_param", "shard_grads"),
         "all_gather_copies": ("copy_in", "copy_out"),
         "reduce_scatter_copies": ("chunk_cat", "shard_grads")}


def _module(name, **edits):
    """The solution's three cells as one module, with the cells named in `edits` changed (an edit of the
    solution cell's source, or a whole new source)."""
    cells = [(edits[c] if isinstance(edits[c], str) else edits[c](SOURCES[c])) if c in edits else SOURCES[c]
             for c in CELLS]
    return source_module(f"lesson12_{name}", "\n\n".join(cells), PRELUDE)


def _edited(*pairs):
    return examples._edits(*pairs)


@pytest.mark.timeout(240)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(CHECKS, STUDENT, match=UNFINISHED)


# ---------------------------------------------------------------------------------------
# the example students (tests/submissions/lesson12.py): each mistake fails its check and passes the others
# that read its cell (READS); the autograde test grades them as notebooks, every check at once


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, cell, pair, expected", [
    ("floor", "dim0_shard", examples.FLOOR_DIVISION, {"dim0_chunk": "rows // N = "}),
    ("row_copy", "all_gather_copies", examples.ROW_COPY, {"copy_in": "not a view of the output"}),
    ("by_gradient", "reduce_scatter_copies", examples.GRADIENT_MAJOR, {"chunk_cat": "each padded gradient whole"}),
    ("no_shape", "dim0_shard", examples.NO_FULL_SHAPE, {"shard_param": "Without shape= and stride="}),
    ("versions", "all_gather_copies", examples.VERSION_COUNTERS, {"copy_out": "version counters"}),
    ("offset", "reduce_scatter_copies", examples.OFFSET_BY_LENGTH, {"shard_grads": "the rows this rank holds"}),
])
def test_example_defects_fail_exactly_their_checks(name, cell, pair, expected, capsys):
    checks = {check: CHECKS[check] for check in READS[cell]}
    fails_exactly(checks, _module(name, **{cell: _edited(pair)}), expected, capsys)


# ---------------------------------------------------------------------------------------
# more mistakes, each against the check meant to catch it

EVEN_SPLIT = ("""    padded = math.ceil(rows / world_size)
    start = min(rank * padded, rows)
    return start, min(padded, rows - start), padded""",
              """    padded = math.ceil(rows / world_size)
    base, extra = divmod(rows, world_size)  # BUG: numpy.array_split's cut
    return rank * base + min(rank, extra), base + (rank < extra), padded""")
NO_CLAMP = ("""    start = min(rank * padded, rows)
    return start, min(padded, rows - start), padded""",
            """    start = rank * padded  # BUG: past the last row for a rank that holds none
    return start, min(padded, rows - start), padded""")
FULL_LENGTH = ("    return start, min(padded, rows - start), padded",
               "    return start, padded, padded  # BUG: the last rows run out")


@pytest.mark.timeout(60)
def test_dim0_chunk_mistakes_fail_their_check():
    fails(CHECKS["dim0_chunk"], _module("even", dim0_shard=_edited(EVEN_SPLIT)), match="even split")
    fails(CHECKS["dim0_chunk"], _module("no_clamp", dim0_shard=_edited(NO_CLAMP)), match="past the last row")
    fails(CHECKS["dim0_chunk"], _module("full", dim0_shard=_edited(FULL_LENGTH)), match="every rank cannot hold")


LOCAL_COPY = ("    local = DTensor.from_local(padded[:length], mesh,",
              "    local = DTensor.from_local(padded[:length].clone(), mesh,")
WITH_PADDING = ("    local = DTensor.from_local(padded[:length], mesh,", "    local = DTensor.from_local(padded, mesh,")
TRAINABLE = ("    return padded.view(-1), nn.Parameter(local, requires_grad=param.requires_grad)",
             "    return padded.view(-1), nn.Parameter(local)  # BUG: every shard trainable")
GLOBAL_RANK = ("    start, length, padded_rows = dim0_chunk(param.size(0), mesh.size(), mesh.get_local_rank())",
               "    start, length, padded_rows = dim0_chunk(param.size(0), torch.distributed.get_world_size(),\n"
               "                                            torch.distributed.get_rank())  # BUG: the default group")
DEFAULT_DTYPE = ("    padded = torch.zeros(padded_rows, *param.shape[1:], dtype=param.dtype, device=param.device)",
                 "    padded = torch.zeros(padded_rows, *param.shape[1:], device=param.device)  # BUG: fp32")
SCATTERED = ("    padded = torch.zeros(padded_rows, *param.shape[1:], dtype=param.dtype, device=param.device)\n"
             "    padded[:length].copy_(param.detach()[start:start + length])",
             "    from torch.distributed.tensor import distribute_tensor\n"
             "    padded = torch.zeros(padded_rows, *param.shape[1:], dtype=param.dtype, device=param.device)\n"
             "    padded[:length].copy_(distribute_tensor(param.detach(), mesh, [Shard(0)]).to_local())  # BUG")


@pytest.mark.timeout(180)
def test_shard_param_mistakes_fail_their_check():
    fails(CHECKS["shard_param"], _module("copy", dim0_shard=_edited(LOCAL_COPY)),
          match="not a view of the start of padded")
    fails(CHECKS["shard_param"], _module("padding", dim0_shard=_edited(WITH_PADDING)), match="padding rows are storage")
    fails(CHECKS["shard_param"], _module("trainable", dim0_shard=_edited(TRAINABLE)),
          match="frozen parameter came back trainable")
    fails(CHECKS["shard_param"], _module("scatter", dim0_shard=_edited(SCATTERED)), match="communicated")
    # the hidden tests' situations: a subgroup mesh, bf16 parameters
    global_rank = _module("global", dim0_shard=_edited(GLOBAL_RANK))
    lesson12.check_shard_param(global_rank.shard_param, world_size=3, checkpoint=False)  # right on the whole group
    fails(lesson12.check_shard_param, global_rank.shard_param, world_size=3, group_ranks=(1, 2, 3),
          checkpoint=False, match="default group's")
    fails(lesson12.check_shard_param, _module("dtype", dim0_shard=_edited(DEFAULT_DTYPE)).shard_param,
          world_size=3, dtype=torch.bfloat16, checkpoint=False, match="keeps its own dtype")


ROW_AT_ZERO = ("    row = output.narrow(0, rank * total, total)", "    row = output.narrow(0, 0, total)  # BUG")
NO_CAST_IN = ("    output = torch.empty(world_size * total, dtype=dtype, device=device)",
              "    output = torch.empty(world_size * total, dtype=inputs[0].dtype, device=device)  # BUG: no cast")
PARAM_MAJOR_OUT = ("    views = [o.view(world_size, -1) for o in outs]\n"
                   "    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):\n"
                   "        torch.split_with_sizes_copy(output.view(world_size, -1), split_sizes, dim=1, out=views)",
                   "    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):\n"
                   "        torch.split_with_sizes_copy(output, [world_size * s for s in split_sizes], out=list(outs))"
                   "  # BUG")
NEW_TENSORS = ("    views = [o.view(world_size, -1) for o in outs]",
               "    views = [o.new_empty(o.shape).view(world_size, -1) for o in outs]  # BUG: not the buffers")


@pytest.mark.timeout(120)
def test_all_gather_copy_mistakes_fail_their_check():
    fails(CHECKS["copy_in"], _module("at_zero", all_gather_copies=_edited(ROW_AT_ZERO)), match="starts at element 0")
    fails(lesson12.check_copy_in, _module("no_cast", all_gather_copies=_edited(NO_CAST_IN)).all_gather_copy_in,
          world_size=4, compute_dtype=torch.bfloat16, match="where the shards are cast")
    fails(CHECKS["copy_out"], _module("param_major", all_gather_copies=_edited(PARAM_MAJOR_OUT)),
          match="one after another")
    fails(CHECKS["copy_out"], _module("new", all_gather_copies=_edited(NEW_TENSORS)), match="not (or not all) written")


NO_PADDING = ("""    rows = [-(-g.size(0) // world_size) * world_size for g in grads]
    total = sum(r * (g.numel() // max(g.size(0), 1)) for r, g in zip(rows, grads))
    flat = torch.empty(total, dtype=dtype, device=grads[0].device)
    torch._chunk_cat(grads, 0, world_size, out=flat.view(world_size, -1))
    return flat""", """    return torch.cat([torch.cat([g.to(dtype).tensor_split(world_size)[r].reshape(-1) for g in grads])
                      for r in range(world_size)])  # BUG: rank-major, but the chunks not padded""")
NO_CAST_RS = ("    flat = torch.empty(total, dtype=dtype, device=grads[0].device)",
              "    flat = torch.empty(total, dtype=grads[0].dtype, device=grads[0].device)  # BUG: no cast")
VIEW_COPY = ("        local = output.as_strided((length, *p.shape[1:]), p.stride(), offset)",
             "        local = output.as_strided((length, *p.shape[1:]), p.stride(), offset).clone()  # BUG")
PLAIN = ("""        grads.append(DTensor.from_local(local, mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride()))""", "        grads.append(local)  # BUG: not a DTensor")


@pytest.mark.timeout(120)
def test_reduce_scatter_mistakes_fail_their_check():
    fails(CHECKS["chunk_cat"], _module("no_pad", reduce_scatter_copies=_edited(NO_PADDING)), match="without padding")
    fails(lesson12.check_chunk_cat,
          _module("no_cast_rs", reduce_scatter_copies=_edited(NO_CAST_RS)).reduce_scatter_copy_in, world_size=4,
          grad_dtype=torch.bfloat16, dtype=torch.float32, match="where the gradients are cast")
    fails(CHECKS["shard_grads"], _module("view_copy", reduce_scatter_copies=_edited(VIEW_COPY)),
          match="a copy, not a view")
    fails(CHECKS["shard_grads"], _module("plain", reduce_scatter_copies=_edited(PLAIN)), match="not a DTensor")


@pytest.mark.timeout(120)
def test_zerokits_own_answers_are_refused():
    def then(line):  # the solution cell, then zerokit's function imported over the student's
        return lambda source: source + "\n" + line + "\n"

    borrowing = _module("borrowing", dim0_shard=then("from zerokit.fully_shard.param import dim0_chunk"),
                        all_gather_copies=then("from zerokit.fully_shard.collectives import all_gather_copy_in, "
                                               "all_gather_copy_out"),
                        reduce_scatter_copies=then("from zerokit.fully_shard.collectives import reduce_scatter_copy_in"))
    fails(CHECKS["dim0_chunk"], borrowing, match="zerokit.fully_shard's own dim0_chunk")
    fails(CHECKS["copy_in"], borrowing, match="zerokit.fully_shard's own all_gather_copy_in")
    fails(CHECKS["copy_out"], borrowing, match="zerokit.fully_shard's own all_gather_copy_out")
    fails(CHECKS["chunk_cat"], borrowing, match="zerokit.fully_shard's own reduce_scatter_copy_in")
