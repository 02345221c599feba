"""Example students for lesson 12 (FSDP2): dim0_chunk and shard_param, the all-gather's copies, the chunk-cat.

Points: test_dim0_chunk 1, test_shard_param 3, test_copy_in 2, test_copy_out 2, test_chunk_cat 2,
test_shard_grads 2, test_questions 2. The lesson's six checks are independent (each builds its inputs from
torch, and the two that call dim0_chunk get zerokit's), so two notebooks carry three mistakes each, in
three different functions: each mistake loses its own check with a reason that names it, and the other
checks of the same notebook pass. Graded once each, they cover every check failing once and passing once.
"""

from . import SOLUTION, Student, correct, full_marks, solution_with, untouched

LESSON = "12_fsdp2"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
SOLVED = {"answers": SOLUTION}

# dim0_chunk: the padded rows by floor division, the remainder's rows dropped
FLOOR_DIVISION = ("    padded = math.ceil(rows / world_size)",
                  "    padded = rows // world_size  # BUG: the remainder's rows belong to no rank")
# the all-gather's input copied into a buffer of its own, not a row of the output
ROW_COPY = ("    row = output.narrow(0, rank * total, total)",
            "    row = output.narrow(0, rank * total, total).clone()  # BUG: a second S-element buffer")
# the gradients laid out whole, one after another (parameter-major), not rank-major
GRADIENT_MAJOR = ("    torch._chunk_cat(grads, 0, world_size, out=flat.view(world_size, -1))",
                  "    offset = 0  # BUG: each padded gradient whole, one after another\n"
                  "    for g, r in zip(grads, rows):\n"
                  "        padded = torch.zeros(r, *g.shape[1:], dtype=dtype)\n"
                  "        padded[:g.size(0)] = g\n"
                  "        flat[offset:offset + padded.numel()] = padded.reshape(-1)\n"
                  "        offset += padded.numel()")
# the DTensor built without the full shape: from_local takes N x the local rows
NO_FULL_SHAPE = ("    local = DTensor.from_local(padded[:length], mesh, (Shard(0),), run_check=False, shape=param.size(),\n"
                 "                               stride=param.stride())",
                 "    local = DTensor.from_local(padded[:length], mesh, (Shard(0),), run_check=False)  # BUG: no shape")
# the copy-out without preserving autograd's version counters
VERSION_COUNTERS = ("    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):\n"
                    "        torch.split_with_sizes_copy(output.view(world_size, -1), split_sizes, dim=1, out=views)",
                    "    torch.split_with_sizes_copy(output.view(world_size, -1), split_sizes, dim=1, out=views)  # BUG")
# the shard gradients' offset advanced by the rows this rank holds, not the padded rows
OFFSET_BY_LENGTH = ("        offset += padded_rows * math.prod(p.shape[1:])",
                    "        offset += length * math.prod(p.shape[1:])  # BUG: the padding rows are skipped")


def _edits(*pairs):
    """One cell's solution with several (old, new) replacements."""
    def edit(solution):
        for old, new in pairs:
            solution = solution_with(old, new)(solution)
        return solution

    return edit


STUDENTS = [
    correct(LESSON, "dim0_shard", "all_gather_copies", "reduce_scatter_copies", "answers"),
    untouched(LESSON, "still the stub"),
    Student("floor_rowcopy_bygradient",
            "dim0_chunk by floor division; the copy-in's row a copy; the chunk-cat parameter-major",
            {**FULL, "test_dim0_chunk": 0, "test_copy_in": 0, "test_chunk_cat": 0},
            reason={"test_dim0_chunk": "rows // N = ", "test_copy_in": "not a view of the output",
                    "test_chunk_cat": "each padded gradient whole"},
            cells={"dim0_shard": _edits(FLOOR_DIVISION), "all_gather_copies": _edits(ROW_COPY),
                   "reduce_scatter_copies": _edits(GRADIENT_MAJOR), **SOLVED}),
    Student("noshape_versions_offset",
            "the DTensor without the full shape; the copy-out bumps version counters; shard offsets by length",
            {**FULL, "test_shard_param": 0, "test_copy_out": 0, "test_shard_grads": 0},
            reason={"test_shard_param": "Without shape= and stride=", "test_copy_out": "version counters",
                    "test_shard_grads": "the rows this rank holds"},
            cells={"dim0_shard": _edits(NO_FULL_SHAPE), "all_gather_copies": _edits(VERSION_COUNTERS),
                   "reduce_scatter_copies": _edits(OFFSET_BY_LENGTH), **SOLVED}),
]
