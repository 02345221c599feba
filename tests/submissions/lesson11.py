"""Example students for lesson 11 (ZeRO++ and hybrid sharding): MyHpZAdam, the block quantiser, qwz_all_gather.

Points: test_hpz_numerics 3, test_hpz_traffic 2, test_hpz_memory 2, test_quantize 2, test_qwz_gather 2,
test_qwz_training 2, test_questions 2. Each defect costs the checks meant to catch it: one, but for the
per-tensor scale, which check_quantize names and which also shows in training (check_qwz_training runs the
student's quantiser end to end: the lesson's claim that blocks train as exact ZeRO-3 does).
"""

from . import SOLUTION, Student, correct, full_marks, method_replaced, solution_with, untouched

LESSON = "11_zeropp"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
SOLVED = {"answers": SOLUTION}  # the check-your-understanding answers, right

# Backward gathers the primary shards over every rank, as ZeRO-3 does: the secondary shard is kept and never
# used. The numbers and the memory are hpZ's; backward's bytes all cross the nodes.
HPZ_ACROSS_NODES = method_replaced("_start_gather", '''
    def _start_gather(self, bi):
        """Start bucket bi's all-gather."""
        return super()._start_gather(bi)  # BUG: from the primary shards over every rank, across the nodes
''')

# The secondary shard is kept, but the unit is not freed: it stays gathered until backward (FSDP2's
# reshard_after_forward=False's memory, and the secondary on top). Right numbers, no gather in backward.
HPZ_KEEPS_WHOLE_UNIT = solution_with(
    "        secondary = self._full[bi][j * piece:(j + 1) * piece].clone()\n"
    "        self._free(bi)\n"
    "        self._secondary[bi] = (secondary, node)",
    "        secondary = self._full[bi][j * piece:(j + 1) * piece].clone()\n"
    "        self._secondary[bi] = (secondary, node)  # BUG: the unit is not freed: it stays whole until backward")

# Every block gets the scale of the whole tensor: the right count and bytes, the error of one scale.
QWZ_PER_TENSOR = solution_with(
    "    scales = blocks.abs().amax(dim=1) / 127",
    "    scales = torch.full((n_blocks,), float(x.abs().max()) / 127)  # BUG: one scale for the whole tensor")

# The whole gathered tensor dequantised in one call: element i with scale i // B of all the ranks' scales,
# right only where the shard's size is a multiple of the block.
QWZ_WRONG_BLOCK_SCALE = solution_with(
    "    for chunk, q_r, s_r in zip(output.chunk(n), q_all.chunk(n), scales_all.chunk(n)):\n"
    "        dequantize_blocks(q_r, s_r, block, out=chunk)  # rank r's values with rank r's scales",
    "    dequantize_blocks(q_all, scales_all, block, out=output)  # BUG: blocks counted across the whole output")



def _rest_replaced(first_line, new):
    """A cell's source: the instructor's solution from `first_line` to its end replaced by `new`."""
    def edit(solution):
        if first_line not in solution:
            raise KeyError(f"the solution no longer contains {first_line!r}: update this example student")
        return solution[:solution.index(first_line)] + new

    return edit


# The fp32 shards gathered, then each rank's chunk quantised and dequantised: the same values, 4 bytes an element.
QWZ_GATHERS_FP32 = _rest_replaced(
    "    q, scales = quantize_blocks(shard, block)\n",
    "    all_gather(output, shard, group=group)  # BUG: the weights travel in fp32\n"
    "    for chunk in output.chunk(n):\n"
    "        dequantize_blocks(*quantize_blocks(chunk, block), block, out=chunk)\n")

STUDENTS = [
    correct(LESSON, "hpz_class", "quantize", "qwz_gather", "answers"),
    # the stub's reason and the questions' both ask whether the cell is still the stub
    untouched(LESSON, "still the stub"),
    Student("hpz_across_nodes", "backward gathers the primary shards over every rank, the secondary shard unused",
            {**FULL, "test_hpz_traffic": 0}, reason="gathered across nodes in backward",
            cells={"hpz_class": HPZ_ACROSS_NODES, "quantize": SOLUTION, "qwz_gather": SOLUTION, **SOLVED}),
    Student("hpz_keeps_whole_unit", "a secondary shard kept, but the unit not freed after forward",
            {**FULL, "test_hpz_memory": 0}, reason="whole gathered copy",
            cells={"hpz_class": HPZ_KEEPS_WHOLE_UNIT, "quantize": SOLUTION, "qwz_gather": SOLUTION, **SOLVED}),
    Student("qwz_scale_per_tensor", "every block quantised with the scale of the whole tensor",
            {**FULL, "test_quantize": 0, "test_qwz_training": 0}, reason="scale per tensor, not per block",
            cells={"hpz_class": SOLUTION, "quantize": QWZ_PER_TENSOR, "qwz_gather": SOLUTION, **SOLVED}),
    Student("qwz_wrong_block_scale", "the gathered values dequantised in one call, blocks counted over the output",
            {**FULL, "test_qwz_gather": 0}, reason="wrong block's scale",
            cells={"hpz_class": SOLUTION, "quantize": SOLUTION, "qwz_gather": QWZ_WRONG_BLOCK_SCALE, **SOLVED}),
    Student("qwz_gathers_fp32", "the shards all-gathered in fp32, quantised after the gather",
            {**FULL, "test_qwz_gather": 0}, reason="went over the wire in fp32",
            cells={"hpz_class": SOLUTION, "quantize": SOLUTION, "qwz_gather": QWZ_GATHERS_FP32, **SOLVED}),
]
