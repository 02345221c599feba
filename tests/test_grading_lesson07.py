"""Lesson 07's checks, validated on the solution and on deliberately broken exercises.

The solution is the code in solutions/07_checkpoints (the notebook's solution cells, executed
here), so what is validated is what students are graded against. Every broken version below
is one classic bug; each must fail exactly the checks listed beside it, with a message that
names the problem, and pass the others: one bug costs its own points only.

| exercise | defect | fails | message |
|---|---|---|---|
| (a) save_shards | every rank gathers and saves everything | memory | "Each rank writes only what it owns" |
| (a) | every shard copied before writing (all at once, or one at a time) | memory | "copied before being written" |
| (a) | shapes from p.shape (empty under ZeRO-3 at rest) | numerics (its ZeRO-3 run) | "you recorded p.shape" |
| (a) | one step count for every parameter, or per bucket | numerics, hidden (branch) | "one step count" |
| (a) | offsets counted across buckets | numerics | "runs past the bucket" (the loader refuses it) |
| (a) | the tensors written in reverse order | numerics | "They are the saved v (exp_avg_sq)", no layout hint |
| (a) | hands the work to zerokit's save_shards | numerics, memory | "zerokit's own" |
| (b) shard_reads | shards of numel // N (off by the padding) | reshard | "expected" |
| (b) | reads the padding | reshard | "expected" |
| (b) | hands the work to zerokit.checkpoint.covering | reshard | "zerokit's own" |
| (c) consolidate | keeps each bucket's padding | consolidate | "differs from the saved weights" |
| (c) | a tied weight copied | consolidate | "is a copy of" |
| (c) | every rank file read whole first | memory | "peak memory" |
| (c) | each rank's shard of a bucket read whole, then cut (example) | memory (ZeRO-1 on one rank: a shard is the model) | "Something that size was held" |
| (c) | a frozen parameter kept in its saved 16-bit dtype (example) | consolidate (a bf16 job's checkpoint) | "a plain fp32 state_dict" |
| (c) | hands the work to zerokit's consolidate | consolidate, memory | "zerokit's own" |
| answers | one wrong number; the stub | answers | "not right yet", "NotImplementedError" |
| the untouched student notebook | | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest

from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly, source_module
from tests.submissions import _solution_sources
from tests.submissions import lesson07 as examples
from zerokit.grading import lesson07

pytestmark = pytest.mark.distributed

PRELUDE = """
import math
from pathlib import Path
import torch
import torch.distributed as dist
import zerokit
import zerokit.checkpoint as ckpt
from zerokit.checkpoint.files import Reader, rank_file, write_tensors
"""

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def notebook_code(folder, grade_ids):
    return exercise_module("07_checkpoints", folder, grade_ids, PRELUDE)


SOLUTION = notebook_code("solutions", ["save_shards", "shard_reads", "consolidate", "answers"])
STUDENT = notebook_code("lessons", ["save_shards", "shard_reads", "consolidate"])  # its answers cell raises

def _visible_numerics(fn):
    """The visible numerics cell: ZeRO-2 and ZeRO-3, saved on 2 ranks, loaded on 3."""
    lesson07.check_numerics(fn, world_size=2, load_world_size=3, model="mlp")
    lesson07.check_numerics(fn, world_size=2, load_world_size=3, model="mlp", stage="zero3")


SAVE_CHECKS = {
    "numerics": _visible_numerics,
    "memory": lambda fn: lesson07.check_memory(fn, world_size=2, model="deep-mlp"),
}
RESHARD_CHECKS = {"reshard": lambda fn: lesson07.check_reshard_map(fn, world_size=2, load_world_size=3)}
CONSOLIDATE_CHECKS = {
    "consolidate": lambda fn: lesson07.check_consolidate(fn, world_size=2, model="edge", precision="bf16"),
    "memory": lambda fn: lesson07.check_consolidate_memory(fn, world_size=1, stage="zero1"),
}


def _defects(sources, name):
    """Functions defined by source strings (as a notebook cell would), each renamed."""
    module = source_module(f"lesson07_{name}", "\n\n".join(
        src.replace(f"def {name}(", f"def {name}_{i}(") for i, src in enumerate(sources)), PRELUDE)
    return [getattr(module, f"{name}_{i}") for i in range(len(sources))]


def _solution(name):
    """The solution cell `name` of solutions/07_checkpoints, its solution markers removed."""
    return _solution_sources(examples.LESSON)[name]


def _solution_with(name, old, new):
    source = _solution(name)
    assert old in source, f"the solution of {name} no longer contains {old!r}"
    return source.replace(old, new)


# ---------------------------------------------------------------------------------------
# exercise (a): save_shards

OFFSETS_ACROSS_BUCKETS = _solution_with(
    "save_shards", '''    buckets = [{"numel": sh.bucket.numel''', '''    running = 0
    for sh in shards:  # BUG: offsets counted from the first bucket, not from each bucket's own start
        sh.bucket.offsets_global = [running + o for o in sh.bucket.offsets]
        running += sh.bucket.numel
    buckets = [{"numel": sh.bucket.numel''').replace(
    "sh.bucket.shapes, sh.bucket.offsets,", "sh.bucket.shapes, sh.bucket.offsets_global,")
M_FIRST = _solution_with("save_shards", "for kind in ckpt.TENSORS])", "for kind in reversed(ckpt.TENSORS)])")
CALLS_ZEROKIT_SAVE = '''def save_shards(directory, model, opt):
    return ckpt.save_shards(directory, model, opt)
'''
COPIES_ONE_AT_A_TIME = _solution_with(  # a generator: write_tensors holds one copy at a time
    "save_shards", "[getattr(sh, kind) for sh in shards for kind in ckpt.TENSORS]",
    "(getattr(sh, kind).clone() for sh in shards for kind in ckpt.TENSORS)")
STEP_PER_BUCKET = _solution_with("save_shards", '"step": step}', '"step": max(sh.steps)}  # BUG: one per bucket')
(EveryRankSavesEverything, OffsetsAcrossBuckets, MFirst, CallsZerokitSave, CopiesShards, CopiesOneAtATime,
 ShapeFromParam, OneStepCount, StepPerBucket) = _defects(
    [examples.EVERY_RANK_SAVES_EVERYTHING, OFFSETS_ACROSS_BUCKETS, M_FIRST, CALLS_ZEROKIT_SAVE,
     examples.COPIES_SHARDS(_solution("save_shards")), COPIES_ONE_AT_A_TIME,
     examples.SHAPE_FROM_PARAM(_solution("save_shards")), examples.ONE_STEP_COUNT(_solution("save_shards")),
     STEP_PER_BUCKET], "save_shards")

SAVE_DEFECTS = [
    (EveryRankSavesEverything, {"memory": "Each rank writes only what it owns"}),
    (OffsetsAcrossBuckets, {"numerics": "runs past the bucket"}),
    (MFirst, {"numerics": "They are the saved v (exp_avg_sq)"}),
    (CallsZerokitSave, {"numerics": "zerokit's own", "memory": "zerokit's own"}),
    (CopiesShards, {"memory": "the shards were copied before being written"}),
    (ShapeFromParam, {"numerics": "you recorded p.shape, and under ZeRO-3 a parameter is empty at rest"}),
    (OneStepCount, {}),  # the visible runs train every layer every step: the hidden branch run catches it
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn, expected", SAVE_DEFECTS, ids=["everything", "offsets", "m_first", "zerokit", "copies",
                                                            "p_shape", "one_step"])
def test_save_defects_fail_exactly_their_checks(fn, expected, capsys):
    fails_exactly(SAVE_CHECKS, fn, expected, capsys)


@pytest.mark.timeout(90)
def test_a_layer_that_sat_out_a_step_needs_its_own_step_count(capsys):
    """The hidden run: BranchNet's branch skips step 2 before the save, so its step counts are one
    fewer; one count for every parameter (or per bucket: ZeRO-1 has one) is told so."""
    hidden = dict(world_size=2, load_world_size=4, model="branch", stage="zero1")
    lesson07.check_numerics(SOLUTION.save_shards, **hidden)
    assert "branch" in capsys.readouterr().out
    for fn in (OneStepCount, StepPerBucket):
        reason = fails(lesson07.check_numerics, fn, **hidden, match="one step count for the whole bucket")
        assert "branch.bias, branch.weight sat out a step" in reason, reason
    # ZeRO-2's two buckets, the branch sharing one with the output layer: one count for every parameter
    fails(lesson07.check_numerics, OneStepCount, world_size=2, load_world_size=3, model="branch",
          match="one step count for every parameter")


@pytest.mark.timeout(90)
def test_the_memory_check_measures_the_peak_not_the_bytes_written(capsys):
    """A copy of every shard writes the same file and the same bytes; only the peak tells it (about 0
    for the solution, the whole state for the copy)."""
    import re

    lesson07.check_memory(SOLUTION.save_shards, world_size=2, model="deep-mlp")
    said = capsys.readouterr().out
    solution_peak = float(re.search(r"peak memory up by at most ([\d.]+) MiB", said).group(1))
    reason = fails(lesson07.check_memory, CopiesShards, world_size=2, model="deep-mlp", match="copied before")
    copy_peak, shards = map(float, re.search(r"rose by ([\d.]+) MiB \(its shards: ([\d.]+) MiB", reason).groups())
    assert solution_peak < 0.1 and copy_peak > 0.9 * shards, (said, reason)


@pytest.mark.timeout(90)
def test_a_wrong_save_gets_the_hint_its_numbers_show_and_no_other():
    """Tensors written in the wrong order are told so; the hint about offsets and the file's layout,
    once added to every difference, is not."""
    reason = fails(lesson07.check_numerics, MFirst, world_size=2, load_world_size=3, model="mlp",
                   match="differ from what was saved")
    assert "They are the saved v (exp_avg_sq)" in reason and "offset" not in reason, reason


# ---------------------------------------------------------------------------------------
# exercise (b): shard_reads

READS_PADDING = _solution_with("shard_reads", "start, end = min(new_rank * s_new, numel), min((new_rank + 1) * s_new, numel)",
                               "start, end = new_rank * s_new, (new_rank + 1) * s_new  # BUG: into the padding")
CALLS_COVERING = '''def shard_reads(numel, old_world, new_world, new_rank):
    s = -(-numel // new_world)
    return ckpt.covering(min(new_rank * s, numel), min((new_rank + 1) * s, numel), -(-numel // old_world))
'''
OffByPadding, ReadsPadding, CallsCovering = _defects([examples.OFF_BY_PADDING, READS_PADDING, CALLS_COVERING],
                                                     "shard_reads")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn, match", [(OffByPadding, "expected"), (ReadsPadding, "expected"),
                                       (CallsCovering, "zerokit's own")], ids=["floor", "padding", "covering"])
def test_reshard_defects_fail_the_map_check(fn, match, capsys):
    fails_exactly(RESHARD_CHECKS, fn, {"reshard": match}, capsys)


def test_the_map_check_quotes_pytorch_planner_cases():
    assert lesson07.RESHARD_CASES[:3] == [(128, 8, 4), (128, 4, 8), (120, 4, 3)]
    assert lesson07._expected_reads(120, 4, 3, 1) == [(1, 40, 60), (2, 60, 80)]
    assert all(len(lesson07._expected_reads(128, 8, 4, r)) == 2 for r in range(4))
    assert lesson07._expected_reads(128, 4, 8, 3) == [(1, 48, 64)]  # half a chunk


# ---------------------------------------------------------------------------------------
# exercise (c): consolidate

READS_EVERYTHING_FIRST = '''def consolidate(path):
    meta, state = ckpt.read_metadata(path), {}
    files = [torch.from_file(str(Path(path) / rank_file(r)), size=(Path(path) / rank_file(r)).stat().st_size,
                             dtype=torch.uint8).clone() for r in range(meta["world_size"])]  # BUG: all of it, first
    for b, bucket in enumerate(meta["buckets"]):
        size, at = bucket["shard_numel"], ckpt.tensor_offset(meta, b, "weights")
        for p in bucket["params"]:
            n = math.prod(p["shape"])
            flat = torch.empty(n)
            for r, lo, hi in ckpt.covering(p["offset"], p["offset"] + n, size):
                start = at + 4 * (lo - r * size)
                flat[lo - p["offset"]:hi - p["offset"]] = files[r][start:start + 4 * (hi - lo)].view(torch.float32)
            state[p["name"]] = flat.view(p["shape"])
    with Reader(path) as reader:
        for entry in meta.get("replicated", []):
            state[entry["name"]] = ckpt.read_replicated(reader, entry)
    for alias, name in meta.get("aliases", {}).items():
        state[alias] = state[name]
    return {k: state[k] for k in meta.get("keys", list(state))}
'''
CALLS_ZEROKIT_CONSOLIDATE = '''def consolidate(path):
    return ckpt.consolidate(path)
'''
KeepsPadding, DuplicatesTied, ReadsEverythingFirst, CallsZerokitConsolidate, KeepsSavedDtype, ReadsWholeShards = \
    _defects([examples.KEEPS_PADDING, examples._duplicates_tied(_solution("consolidate")), READS_EVERYTHING_FIRST,
              CALLS_ZEROKIT_CONSOLIDATE, examples.KEEPS_SAVED_DTYPE(_solution("consolidate")),
              examples.READS_WHOLE_SHARDS], "consolidate")

CONSOLIDATE_DEFECTS = [
    (KeepsPadding, {"consolidate": "differs from the saved weights"}),
    (DuplicatesTied, {"consolidate": "is a copy of"}),
    (ReadsEverythingFirst, {"memory": "peak memory"}),
    (KeepsSavedDtype, {"consolidate": "a plain fp32 state_dict"}),
    (ReadsWholeShards, {"memory": "Something that size was held"}),
    (CallsZerokitConsolidate, {"consolidate": "zerokit's own", "memory": "zerokit's own"}),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fn, expected", CONSOLIDATE_DEFECTS,
                         ids=["padding", "tied", "everything", "zerokit", "saved_dtype", "whole_shards"])
def test_consolidate_defects_fail_exactly_their_checks(fn, expected, capsys):
    fails_exactly(CONSOLIDATE_CHECKS, fn, expected, capsys)


@pytest.mark.timeout(90)
def test_the_consolidation_memory_reason_and_its_pass_state_the_same_limit(capsys):
    """The ✓ and the failure name one limit, the output plus the largest parameter, and its value
    (the ✓ once printed the largest parameter alone as "limit")."""
    import re

    lesson07.check_consolidate_memory(SOLUTION.consolidate, world_size=1, stage="zero1")
    said = capsys.readouterr().out
    reason = fails(lesson07.check_consolidate_memory, ReadsEverythingFirst, world_size=1, stage="zero1",
                   match="over the limit")
    limits = [re.search(r"the limit ([\d.]+) MiB = the output \(deep-mlp's state_dict, ([\d.]+) MiB\) \+ the largest "
                        r"parameter \(([\d.]+) MiB\)", text) for text in (said, reason)]
    assert all(limits), (said, reason)
    assert limits[0].groups() == limits[1].groups(), (said, reason)
    total, output, largest = map(float, limits[0].groups())
    assert abs(total - output - largest) <= 0.011
    peaks = [float(re.search(r"peak memory was ([\d.]+) MiB", text).group(1)) for text in (said, reason)]
    assert peaks[0] <= total < peaks[1], (said, reason)


# ---------------------------------------------------------------------------------------
# check your understanding; the untouched notebook; the hidden configurations


def test_answers():
    lesson07.check_answers(SOLUTION.answers)
    fails(lesson07.check_answers, {**SOLUTION.answers, "q3_reads": 2}, match="not right yet: q3_reads")
    fails(lesson07.check_answers, dict.fromkeys(SOLUTION.answers), match=UNFINISHED)


@pytest.mark.timeout(90)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(SAVE_CHECKS, STUDENT.save_shards)
    fails_every_check(RESHARD_CHECKS, STUDENT.shard_reads)
    fails_every_check(CONSOLIDATE_CHECKS, STUDENT.consolidate)


@pytest.mark.timeout(90)
def test_hidden_configurations_catch_the_same_bugs():
    """N = 3 -> 2 and 2 -> 4, on models the visible tests do not use."""
    fails(lesson07.check_numerics, MFirst, world_size=3, load_world_size=2, model="awkward",
          stage="zero3", match="differ from what was saved")
    fails(lesson07.check_numerics, ShapeFromParam, world_size=3, load_world_size=2, model="awkward",
          stage="zero3", match="you recorded p.shape")
    fails(lesson07.check_memory, EveryRankSavesEverything, world_size=3, model="deep-mlp", stage="zero3",
          match="Each rank writes only what it owns")
    fails(lesson07.check_memory, CopiesOneAtATime, world_size=3, model="deep-mlp", stage="zero3",
          match="copied before being written")
    fails(lesson07.check_consolidate, KeepsPadding, world_size=3, model="edge", stage="zero2",
          match="differs from the saved weights")
    fails(lesson07.check_consolidate, DuplicatesTied, world_size=3, model="edge", stage="zero2",
          match="is a copy of")


@pytest.mark.timeout(90)
def test_what_the_fp32_and_the_sharded_fixtures_cannot_see():
    """Why the visible consolidate check uses a bf16 job's checkpoint: in an fp32 checkpoint a frozen
    parameter's saved dtype is fp32 already (and the memory check ZeRO-1 on one rank: under ZeRO-3 on
    2 ranks, the old setting, no shard is larger than deep-mlp's largest parameter, which the rule
    allows besides the output; measured 5.7 MiB against a limit of 6.9). The hidden settings (fp16 at
    N = 3; ZeRO-3 on one rank, whose rank file is the whole model) catch them too."""
    lesson07.check_consolidate(KeepsSavedDtype, world_size=2, model="edge")
    fails(lesson07.check_consolidate, KeepsSavedDtype, world_size=3, model="edge", stage="zero1", precision="fp16",
          match="is torch.float16, the dtype the checkpoint holds it in")
    fails(lesson07.check_consolidate_memory, ReadsEverythingFirst, world_size=1, stage="zero3",
          match="over the limit")
