"""Example students for lesson 11 (ZeRO++ and hybrid sharding): MyHpZAdam, the block quantiser, qwz_all_gather.

Points: test_hpz_numerics 3, test_hpz_traffic 2, test_hpz_memory 2, test_quantize 2, test_qwz_gather 2,
test_qwz_training 2, test_questions 2. Each defect costs the check meant to catch it: the hpZ checks grade
one method each (numerics keep_secondary's piece, traffic start_gather, memory what keep_secondary keeps
and free() drops) with zerokit's version of the others; the gather check runs zerokit's quantiser; training
runs the student's quantiser on whole blocks and writes out= itself. The one defect that costs two is the
per-tensor scale, which check_quantize names and which also shows in training (the lesson's claim that
blocks train as exact ZeRO-3 does).
"""

from . import SOLUTION, Student, correct, full_marks, method_replaced, one_per_exercise, solution_with, untouched

LESSON = "11_zeropp"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
SOLVED = {"answers": SOLUTION}  # the check-your-understanding answers, right


def _both(*edits):
    """A cell's source: the solution with several planted edits, in order (one mistake in two places)."""
    def edit(solution):
        for e in edits:
            solution = e(solution)
        return solution

    return edit


def _rest_replaced(first_line, new):
    """A cell's source: the instructor's solution from `first_line` to its end replaced by `new`."""
    def edit(solution):
        if first_line not in solution:
            raise KeyError(f"the solution no longer contains {first_line!r}: update this example student")
        return solution[:solution.index(first_line)] + new

    return edit


# ---- exercise 1, MyHpZAdam

# Backward gathers the primary shards over every rank, as ZeRO-3 does: the secondary shard is kept and never
# used. The numbers and the memory are hpZ's; backward's bytes all cross the nodes.
HPZ_ACROSS_NODES = method_replaced("start_gather", '''
    def start_gather(self, bi):
        """Start bucket bi's all-gather."""
        return super().start_gather(bi)  # BUG: from the primary shards over every rank, across the nodes
''')

# The secondary shard is kept, but the unit is not freed: it stays gathered until backward (FSDP2's
# reshard_after_forward=False's memory, and the secondary on top). Right numbers, no gather in backward.
HPZ_KEEPS_WHOLE_UNIT = solution_with(
    "        secondary = self.full[bi][j * piece:(j + 1) * piece].clone()\n"
    "        self.free(bi)\n"
    "        self.secondary[bi] = (secondary, node)",
    "        secondary = self.full[bi][j * piece:(j + 1) * piece].clone()\n"
    "        self.secondary[bi] = (secondary, node)  # BUG: the unit is not freed: it stays whole until backward")

# The secondary shard is never dropped: the gather reads it and leaves it, free() forgets to clear it. Every
# secondary shard outlives backward (and the next forward would find a stale one).
HPZ_NEVER_DROPS_SECONDARY = _both(
    solution_with("        (secondary, node), self.secondary[bi] = self.secondary[bi], None  # the gather holds it "
                  "until done",
                  "        secondary, node = self.secondary[bi]  # BUG: the entry stays"),
    solution_with("        self.secondary[bi] = None\n        super().free(bi)",
                  "        super().free(bi)  # BUG: the secondary shard is not dropped"))

# No secondary shard kept at all: the piece is cut and the unit freed, but the pair is never stored. The
# numbers are ZeRO-3's, and backward has nothing to gather inside the node.
HPZ_KEEPS_NO_SECONDARY = solution_with("        self.secondary[bi] = (secondary, node)\n",
                                       "        # BUG: the piece is never stored in self.secondary\n")

# The gather from the secondary shards into a tensor of its own instead of the bucket's buffer: autograd's
# saved views of the weights point into the bucket's buffer, which stays empty ("setStorage ... out of bounds").
HPZ_FRESH_BUFFER = solution_with("        full = self.gather_buffer(bi, secondary)\n",
                                 "        full = torch.empty(self.buckets[bi].padded_numel)  # BUG: not the bucket's\n")

# A synchronous gather that installs the buffer itself: no transfer recorded in self.gathering, so ZeRO-3's
# finish_gather never puts the parameters' views into it ("The size of tensor a (0) must match ...").
HPZ_SYNCHRONOUS = solution_with(
    "        work = all_gather(full, secondary, group=node, async_op=True)\n"
    "        self.gathering[bi] = (work, full, secondary)",
    "        all_gather(full, secondary, group=node)  # BUG: synchronous, and nothing recorded in self.gathering\n"
    "        self.full[bi] = full")

# The secondary branch without the guard "full, or already on its way", its entry left in place: ZeRO-3's
# finish_gather calls start_gather again while the gather is in flight, and a second gather writes the
# same buffer (gloo's threads crash the rank with signal 11).
HPZ_NO_GUARD = solution_with(
    "        if self.secondary[bi] is None or self.full[bi] is not None or bi in self.gathering:\n"
    "            return super().start_gather(bi)\n"
    "        (secondary, node), self.secondary[bi] = self.secondary[bi], None  # the gather holds it until done",
    "        if self.secondary[bi] is None:  # BUG: no guard for a bucket full or on its way\n"
    "            return super().start_gather(bi)\n"
    "        secondary, node = self.secondary[bi]")

# The secondary shards gathered on the optimizer's whole group instead of the node: 1/k of the unit from
# each of N ranks does not fill the unit (gloo: "invalid tensor size").
HPZ_WHOLE_GROUP = solution_with("        work = all_gather(full, secondary, group=node, async_op=True)",
                                "        work = all_gather(full, secondary, group=self.group, async_op=True)  # BUG")

# The secondary shards kept for the next step too ("why gather across nodes in forward when the node still
# has the pieces?"): the next forward gathers last step's weights, from before the optimizer's step, inside
# the node.
HPZ_REUSES_SECONDARY = method_replaced("start_gather", '''
    def start_gather(self, bi):
        """Start bucket bi's all-gather: from the secondary shards inside the node if this rank
        keeps one, else as ZeRO-3 does."""
        if self.full[bi] is not None or bi in self.gathering:
            return super().start_gather(bi)
        entry = self.secondary[bi]
        if entry is None:
            entry = getattr(self, "_reused", {}).get(bi)  # BUG: last step's pieces, kept for the next forward
            if entry is None:
                return super().start_gather(bi)
        self.secondary[bi] = None
        self.__dict__.setdefault("_reused", {})[bi] = entry
        secondary, node = entry
        full = self.gather_buffer(bi, secondary)
        work = all_gather(full, secondary, group=node, async_op=True)
        self.gathering[bi] = (work, full, secondary)
''')

# ---- exercise 2, the quantiser

# Every block gets the scale of the whole tensor: the right count and bytes, the error of one scale.
QWZ_PER_TENSOR = solution_with(
    "    scales = blocks.abs().amax(dim=1) / 127",
    "    scales = torch.full((n_blocks,), float(x.abs().max()) / 127)  # BUG: one scale for the whole tensor")

# dequantize_blocks ignores out=: it returns a new tensor and leaves out unwritten, which ZeRO++'s gather
# dequantises into (each rank's chunk of the gathered buffer).
DEQUANTIZE_IGNORES_OUT = solution_with("    return x if out is None else out.copy_(x)",
                                       "    return x  # BUG: out= ignored")

# out= written, but nothing returned.
DEQUANTIZE_RETURNS_NONE = solution_with("    return x if out is None else out.copy_(x)",
                                        "    if out is not None:\n"
                                        "        out.copy_(x)  # BUG: and returns None\n"
                                        "        return\n"
                                        "    return x")

# The tensor viewed as rows of B without padding: right wherever the size is a multiple of B, a crash on a
# short last block.
QUANTIZE_NO_PADDING = solution_with(
    "    padded = torch.zeros(n_blocks * block, dtype=torch.float32, device=x.device)  # zeros raise no maximum\n"
    "    padded[:n] = x.reshape(-1)\n"
    "    blocks = padded.view(n_blocks, block)",
    "    blocks = x.reshape(-1, block).float()  # BUG: no padding for a short last block")

# The quantised values written back into x (as if "the weights on the wire" were the weights): the
# optimizer's master copy would be rounded into int8's grid at every step.
QUANTIZE_IN_PLACE = solution_with("    return q.view(-1)[:n], scales",
                                  "    x.copy_((q.float() * divisor[:, None]).view(-1)[:n])  # BUG: x rounded\n"
                                  "    return q.view(-1)[:n], scales")

# ---- exercise 3, the quantised all-gather

# The whole gathered tensor dequantised in one call: element i with scale i // B of all the ranks' scales,
# right only where the shard's size is a multiple of the block.
QWZ_WRONG_BLOCK_SCALE = solution_with(
    "    for chunk, q_r, s_r in zip(output.chunk(n), q_all.chunk(n), scales_all.chunk(n)):\n"
    "        dequantize_blocks(q_r, s_r, block, out=chunk)  # rank r's values with rank r's scales",
    "    dequantize_blocks(q_all, scales_all, block, out=output)  # BUG: blocks counted across the whole output")

# The fp32 shards gathered, then each rank's chunk quantised and dequantised: the same values, 4 bytes an element.
QWZ_GATHERS_FP32 = _rest_replaced(
    "    q, scales = quantize_blocks(shard, block)\n",
    "    all_gather(output, shard, group=group)  # BUG: the weights travel in fp32\n"
    "    for chunk in output.chunk(n):\n"
    "        dequantize_blocks(*quantize_blocks(chunk, block), block, out=chunk)\n")

# Both all-gathers on the default group, whatever group was given: right when the job is the whole world.
QWZ_DEFAULT_GROUP = solution_with(
    "    all_gather(q_all, q, group=group)\n    all_gather(scales_all, scales, group=group)\n",
    "    all_gather(q_all, q, group=group)\n    all_gather(scales_all, scales)  # BUG: the default group\n")

# N taken from the world, not from the group: right when the job is the whole world.
QWZ_WORLD_SIZE = solution_with("    n = dist.get_world_size(group)",
                               "    n = dist.get_world_size()  # BUG: the world's")

# This rank's own chunk copied from its exact shard (it has it, why round it?): every other rank computes with
# its dequantised weights, so the replicas of a unit differ from rank to rank.
QWZ_OWN_CHUNK_EXACT = solution_with(
    "        dequantize_blocks(q_r, s_r, block, out=chunk)  # rank r's values with rank r's scales",
    "        dequantize_blocks(q_r, s_r, block, out=chunk)\n"
    "    output.chunk(n)[dist.get_rank(group)].copy_(shard)  # BUG: this rank's own chunk exact")


def _student(name, defect, lost, reason, cell, edit):
    cells = {"hpz_class": SOLUTION, "quantize": SOLUTION, "qwz_gather": SOLUTION, **SOLVED, cell: edit}
    return Student(name, defect, {**FULL, **dict.fromkeys(lost, 0)}, reason=reason, cells=cells)


EXERCISES = ("hpz_class", "quantize", "qwz_gather", "answers")
# one mistake each; graded as few notebooks, one mistake per exercise in each (one_per_exercise)
DEFECTS = [
    _student("hpz_across_nodes", "backward gathers the primary shards over every rank, the secondary shard unused",
             ["test_hpz_traffic"], "gathered across nodes in backward", "hpz_class", HPZ_ACROSS_NODES),
    _student("hpz_keeps_whole_unit", "a secondary shard kept, but the unit not freed after forward",
             ["test_hpz_memory"], "whole gathered copy", "hpz_class", HPZ_KEEPS_WHOLE_UNIT),
    _student("hpz_never_drops_secondary", "the secondary shard neither taken by the gather nor dropped by free()",
             ["test_hpz_memory"], "still held after backward", "hpz_class", HPZ_NEVER_DROPS_SECONDARY),
    _student("hpz_keeps_no_secondary", "the piece cut and the unit freed, the piece never stored",
             ["test_hpz_memory"], "No secondary shard is kept", "hpz_class", HPZ_KEEPS_NO_SECONDARY),
    _student("hpz_fresh_buffer", "backward's gather into a fresh tensor, not the bucket's buffer",
             ["test_hpz_traffic"], "a tensor of its own", "hpz_class", HPZ_FRESH_BUFFER),
    _student("hpz_synchronous_gather", "a synchronous gather that sets self.full itself, nothing in self.gathering",
             ["test_hpz_traffic"], "recorded no transfer", "hpz_class", HPZ_SYNCHRONOUS),
    _student("hpz_no_guard", "the secondary branch without the guard for a bucket full or on its way",
             ["test_hpz_traffic"], "while bucket", "hpz_class", HPZ_NO_GUARD),
    _student("hpz_gathers_on_whole_group", "the secondary shards gathered on every rank, not the node",
             ["test_hpz_traffic"], "gather it on the node's group", "hpz_class", HPZ_WHOLE_GROUP),
    _student("hpz_reuses_secondary", "the secondary shards kept and gathered again in the next step's forward",
             ["test_hpz_traffic"], "inside a node", "hpz_class", HPZ_REUSES_SECONDARY),
    _student("qwz_scale_per_tensor", "every block quantised with the scale of the whole tensor",
             ["test_quantize", "test_qwz_training"], "scale per tensor, not per block", "quantize", QWZ_PER_TENSOR),
    _student("dequantize_ignores_out", "dequantize_blocks returns a new tensor and leaves out= unwritten",
             ["test_quantize"], "left out unwritten", "quantize", DEQUANTIZE_IGNORES_OUT),
    _student("dequantize_returns_none", "dequantize_blocks writes out= and returns None",
             ["test_quantize"], "returned NoneType", "quantize", DEQUANTIZE_RETURNS_NONE),
    _student("quantize_no_padding", "the tensor viewed as rows of B without padding the last block",
             ["test_quantize"], "is not a multiple of", "quantize", QUANTIZE_NO_PADDING),
    _student("quantize_in_place", "the dequantised values written back into the tensor quantised",
             ["test_quantize"], "changed the tensor it quantised", "quantize", QUANTIZE_IN_PLACE),
    _student("qwz_wrong_block_scale", "the gathered values dequantised in one call, blocks counted over the output",
             ["test_qwz_gather"], "wrong block's scale", "qwz_gather", QWZ_WRONG_BLOCK_SCALE),
    _student("qwz_gathers_fp32", "the shards all-gathered in fp32, quantised after the gather",
             ["test_qwz_gather"], "went over the wire in fp32", "qwz_gather", QWZ_GATHERS_FP32),
    _student("qwz_default_group", "the scales all-gathered on the default group, not the group given",
             ["test_qwz_gather"], "not on the group it was given", "qwz_gather", QWZ_DEFAULT_GROUP),
    _student("qwz_world_size", "N read from the world, not from the group given",
             ["test_qwz_gather"], "not the world's", "qwz_gather", QWZ_WORLD_SIZE),
    _student("qwz_own_chunk_exact", "this rank's own chunk copied from its exact shard",
             ["test_qwz_gather"], "own chunk", "qwz_gather", QWZ_OWN_CHUNK_EXACT),
]

STUDENTS = [
    correct(LESSON, *EXERCISES),
    # the stub's reason and the questions' both ask whether the cell is still the stub
    untouched(LESSON, "still the stub"),
    *one_per_exercise(FULL, DEFECTS),
]
