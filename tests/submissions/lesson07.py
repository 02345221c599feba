"""Example students for lesson 07 (sharded checkpoints): save_shards, shard_reads, consolidate.

Points: test_save_numerics 3, test_save_memory 2 (exercise a), test_reshard_map 3 (exercise b),
test_consolidate 3, test_consolidate_memory 2 (exercise c), test_answers 2. Each exercise is
graded with zerokit's versions of the others, so a defect costs only its own exercise's checks:
the issue's defects (every rank saves everything; one step count for every parameter; shapes
from p.shape, empty under ZeRO-3; shards copied before writing; a resharding map off by the
padding; a consolidation that keeps the padding, duplicates a tied weight, keeps a frozen parameter
in its 16-bit saved dtype, or reads a whole shard before cutting it) each cost one check.
"""

from . import SOLUTION, Student, correct, full_marks, one_per_exercise, solution_with, untouched

LESSON = "07_checkpoints"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)
EXERCISES = ("save_shards", "shard_reads", "consolidate", "answers")

FULL = full_marks(LESSON)

# Every rank gathers the whole state and writes it: a checkpoint that loads (as one of world
# size 1, which every file holds in full), at N times the bytes, on every rank.
EVERY_RANK_SAVES_EVERYTHING = '''def save_shards(directory, model, opt):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    names = {p: n for n, p in model.named_parameters()}
    shards = opt.state_shards()
    whole = []
    for sh in shards:
        for kind in ckpt.TENSORS:
            full = torch.empty(sh.bucket.shard_numel * world_size)
            dist.all_gather_single(full, getattr(sh, kind))  # BUG: every rank gets everything ...
            whole.append(full[:sh.bucket.numel])
    write_tensors(Path(directory) / rank_file(rank), whole)  # ... and writes it
    if rank != 0:
        return None
    buckets = [{"numel": sh.bucket.numel, "shard_numel": sh.bucket.numel,
                "params": [{"name": names[p], "shape": list(shape), "offset": offset, "step": step}
                           for p, shape, offset, step in zip(sh.bucket.params, sh.bucket.shapes, sh.bucket.offsets,
                                                             sh.steps)]}
               for sh in shards]
    return {"format": ckpt.FORMAT, "version": ckpt.VERSION, "world_size": 1,
            "tensors": list(ckpt.TENSORS), "buckets": buckets}
'''

# Shards of numel // N elements: uneven sizes put every boundary in the wrong place.
OFF_BY_PADDING = '''def shard_reads(numel, old_world, new_world, new_rank):
    s_old, s_new = numel // old_world, numel // new_world  # BUG: the padded shard is ceil(numel / N)
    start, end = min(new_rank * s_new, numel), min((new_rank + 1) * s_new, numel)
    reads = []
    while start < end:
        q = start // s_old
        hi = min(end, (q + 1) * s_old)
        reads.append((q, start, hi))
        start = hi
    return reads
'''

# Every bucket rebuilt whole, padding included, the buckets laid end to end, and the
# parameters cut from it at a running offset: every bucket after the first is shifted by the
# padding of the ones before it.
KEEPS_PADDING = '''def consolidate(path):
    meta, state = ckpt.read_metadata(path), {}
    world_size = meta["world_size"]
    total = sum(b["shard_numel"] * world_size for b in meta["buckets"])
    flat, at = torch.empty(total), 0
    with Reader(path) as reader:
        for b, bucket in enumerate(meta["buckets"]):
            size = bucket["shard_numel"]
            for r in range(world_size):  # the whole padded bucket, shard after shard
                reader.read(rank_file(r), ckpt.tensor_offset(meta, b, "weights"), flat[at + r * size:at + (r + 1) * size])
            at += size * world_size
        offset = 0
        for bucket in meta["buckets"]:
            for p in bucket["params"]:
                numel = math.prod(p["shape"])
                state[p["name"]] = flat[offset:offset + numel].view(p["shape"])  # BUG: the padding stays in
                offset += numel
        for entry in meta.get("replicated", []):
            state[entry["name"]] = ckpt.read_replicated(reader, entry)
    for alias, name in meta.get("aliases", {}).items():
        state[alias] = state[name]
    return {k: state[k] for k in meta.get("keys", list(state))}
'''

def _duplicates_tied(solution):
    """The solution of consolidate with a .clone() on every tied name."""
    old = "state[alias] = state[name]  # the same tensor: one tied weight"
    if old not in solution:
        raise KeyError("the solution of consolidate no longer ties its aliases this way: update this example")
    return solution.replace(old, "state[alias] = state[name].clone()  # BUG: a second copy of a tied weight")


# Frozen parameters read by hand in the dtype replicated.bin holds them in: fp32 in an fp32 job's
# checkpoint (right by chance), 16-bit in a mixed-precision job's, inside a "plain fp32" state_dict.
KEEPS_SAVED_DTYPE = solution_with(
    '            state[entry["name"]] = ckpt.read_replicated(reader, entry)\n',
    '            t = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))\n'
    '            reader.read("replicated.bin", entry["offset"], t)\n'
    '            state[entry["name"]] = t  # BUG: a frozen parameter stays in the dtype it was saved in\n')

# Each rank's shard of a bucket read whole, then the parameters cut out of it: the right values, and
# a temporary of a whole shard (ZeRO-1 on one rank: the whole model) beside the state_dict.
READS_WHOLE_SHARDS = '''def consolidate(path):
    meta, state = ckpt.read_metadata(path), {}
    with Reader(path) as reader:
        for b, bucket in enumerate(meta["buckets"]):
            size, at = bucket["shard_numel"], ckpt.tensor_offset(meta, b, "weights")
            flats = {p["name"]: torch.empty(math.prod(p["shape"])) for p in bucket["params"]}
            for r in range(meta["world_size"]):
                shard = torch.empty(size)  # BUG: a whole shard in memory before any parameter is cut out
                reader.read(rank_file(r), at, shard)
                for p in bucket["params"]:
                    lo = max(p["offset"], r * size)
                    hi = min(p["offset"] + math.prod(p["shape"]), (r + 1) * size)
                    if lo < hi:
                        flats[p["name"]][lo - p["offset"]:hi - p["offset"]] = shard[lo - r * size:hi - r * size]
            for p in bucket["params"]:
                state[p["name"]] = flats[p["name"]].view(p["shape"])
        for entry in meta.get("replicated", []):
            state[entry["name"]] = ckpt.read_replicated(reader, entry)
    for alias, name in meta.get("aliases", {}).items():
        state[alias] = state[name]
    return {k: state[k] for k in meta.get("keys", list(state))}
'''


# One Adam step count for the whole optimizer: right until a layer sits out a step (the
# hidden test's branch), then the resumed run's bias correction uses the wrong count.
ONE_STEP_COUNT = solution_with('"step": step}', '"step": max(max(s.steps) for s in shards)}  # BUG: one count')
# Shapes read from the parameters: under ZeRO-3 a parameter is empty at rest ([0]).
SHAPE_FROM_PARAM = solution_with('"shape": list(shape)', '"shape": list(p.shape)')  # BUG: empty under ZeRO-3
# Every shard copied before writing: the right file, and a copy of the rank's whole state in memory.
COPIES_SHARDS = solution_with("[getattr(sh, kind) for sh", "[getattr(sh, kind).clone() for sh")  # BUG: a copy


def _with(**cells):
    return {**dict.fromkeys(EXERCISES, SOLUTION), **cells}


STUDENTS = [
    correct(LESSON, *EXERCISES),
    untouched(LESSON, "NotImplementedError"),
    Student("every_rank_saves_everything", "save_shards gathers the whole state and writes it on every rank",
            {**FULL, "test_save_memory": 0}, reason="Each rank writes only what it owns",
            cells=_with(save_shards=EVERY_RANK_SAVES_EVERYTHING)),
    Student("one_step_count", "save_shards records one Adam step count for every parameter, though a layer "
            "that sat out a step has taken fewer", {**FULL, "test_save_numerics": 0}, reason="one step count",
            cells=_with(save_shards=ONE_STEP_COUNT)),
    Student("shape_from_param", "save_shards records p.shape, empty under ZeRO-3 at rest",
            {**FULL, "test_save_numerics": 0}, reason="you recorded p.shape",
            cells=_with(save_shards=SHAPE_FROM_PARAM)),
    Student("copies_shards", "save_shards writes a clone of every shard: the right file, a copy of the state in "
            "memory", {**FULL, "test_save_memory": 0}, reason="copied before being written",
            cells=_with(save_shards=COPIES_SHARDS)),
    Student("reshard_off_by_padding", "shard_reads cuts shards of numel // N elements (off by the padding)",
            {**FULL, "test_reshard_map": 0}, reason="expected",
            cells=_with(shard_reads=OFF_BY_PADDING)),
    Student("consolidate_keeps_padding", "consolidate keeps each bucket's padding: later parameters shifted",
            {**FULL, "test_consolidate": 0}, reason="differs from the saved weights",
            cells=_with(consolidate=KEEPS_PADDING)),
    Student("consolidate_keeps_saved_dtype", "consolidate reads frozen parameters in their saved dtype: bf16 in a "
            "mixed-precision job's checkpoint", {**FULL, "test_consolidate": 0}, reason="a plain fp32 state_dict",
            cells=_with(consolidate=KEEPS_SAVED_DTYPE)),
    Student("consolidate_reads_whole_shards", "consolidate reads each rank's shard of a bucket whole, then cuts "
            "the parameters out: right values, a whole shard in memory", {**FULL, "test_consolidate_memory": 0},
            reason="Something that size was held", cells=_with(consolidate=READS_WHOLE_SHARDS)),
    Student("consolidate_duplicates_tied", "consolidate copies a tied weight under its second name",
            {**FULL, "test_consolidate": 0}, reason="is a copy of",
            cells=_with(consolidate=_duplicates_tied)),
]

# Each mistake above is one student; graded as few notebooks as their cells allow, one mistake per exercise
# in each (one_per_exercise: the checks grade an exercise with zerokit's versions of the others).
STUDENTS = [*STUDENTS[:2], *one_per_exercise(FULL, STUDENTS[2:])]
