"""Example students for lesson 08 (count_saved, recomputing_zero3, disk_adam_step, understanding).

Points: test_saved_bytes 2, test_saved_views 2 (exercise 1, the count); test_recompute 3,
test_recompute_memory 2, test_recompute_traffic 2 (exercise 2, the hooks: each check grades
one hook with zerokit's other); test_offload_numerics 3, test_offload_memory 2 (exercise 3,
the disk step); test_understanding 2. Every defect answers the questions, so it loses only
the points of its own check.
"""

from . import SOLUTION, Student, correct, full_marks, one_per_exercise, solution_with, untouched

LESSON = "08_beyond_model_states"
# The cell the exercises need besides their own (the launcher choice, imports); the demo
# cells are left out of the lean examples so the set grades quickly. `correct` keeps all.
KEEP = ('os.environ["ZEROKIT_LAUNCHER"]',)

FULL = full_marks(LESSON)
SOLVED = {"count_saved": SOLUTION, "recomputing_zero3": SOLUTION, "disk_adam_step": SOLUTION,
          "understanding": SOLUTION}


def _with(cell, old, new):
    return {**SOLVED, cell: solution_with(old, new)}


STUDENTS = [
    correct(LESSON, "count_saved", "recomputing_zero3", "disk_adam_step", "understanding"),
    untouched(LESSON, "still the stub"),
    Student("counts_views_twice", "the count adds a storage once per saved view of it (no deduplication)",
            {**FULL, "test_saved_views": 0}, reason="a storage costs its bytes once",
            cells=_with("count_saved", "storages[s.data_ptr()] = s.nbytes()",
                        "storages[len(storages)] = s.nbytes()  # BUG: one entry per saved tensor")),
    Student("counts_by_view_shape", "the count keys a storage by its address and the saved view's shape: a storage "
            "saved as x and as x flattened is counted twice", {**FULL, "test_saved_views": 0},
            reason="counted once per shape",
            cells=_with("count_saved", "storages[s.data_ptr()] = s.nbytes()",
                        "storages[(s.data_ptr(), tuple(t.shape))] = s.nbytes()  # BUG: one entry per shape")),
    Student("recompute_on_freed_parameters", "pre_forward does nothing inside backward ('the pre-backward hook "
            "gathered it'): the recomputation runs units freed after their forward",
            {**FULL, "test_recompute": 0}, reason="pre_forward must gather it",
            cells=_with("recomputing_zero3", "            self.gather_unit(u)\n            return",
                        "            return  # BUG: nothing gathers the units inside the block")),
    Student("keeps_units_gathered", "post_forward never frees a unit while backward is coming, so that the "
            "recomputation finds it full: ZeRO-2's parameter memory",
            {**FULL, "test_recompute_memory": 0}, reason="still held its full weights",
            cells=_with("recomputing_zero3", "        if u != 0 or not backward_coming:",
                        "        if not backward_coming:  # BUG: keep every unit for the recomputation")),
    Student("double_reduce_scatter", "post_forward inside backward 'frees' the unit with send(): its bucket is "
            "reduce-scattered from the recomputation and again when its gradients come",
            {**FULL, "test_recompute_traffic": 0}, reason="was sent 2 times",
            cells=_with("recomputing_zero3",
                        "        if in_backward():  # keep u for its backward (send frees it); its outputs get no "
                        "gradient\n            return\n",
                        "        if in_backward():  # BUG: send frees the unit, but it also sends\n"
                        "            for bi in self.buckets_of_unit[u]:\n                self.send(bi)\n"
                        "            return\n")),
    Student("frees_root_in_recompute", "post_forward frees the root unit in a recomputation ('the block does not "
            "need it'): awkward's root owns the tied embedding, whose gradient is still to come",
            {**FULL, "test_recompute_memory": 0}, reason="had freed the root unit's embed.weight",
            cells=_with("recomputing_zero3",
                        "        if in_backward():  # keep u for its backward (send frees it); its outputs get no "
                        "gradient\n            return\n",
                        "        if in_backward():  # BUG: the root is not needed by the recomputed block\n"
                        "            for bi in self.buckets_of_unit[0]:\n                self.free(bi)\n"
                        "            return\n")),
    Student("forgets_one_release", "the disk step releases the windows of master and m, not of v: one file "
            "(16 MiB) stays resident", {**FULL, "test_offload_memory": 0},
            reason="you released master and exp_avg, not exp_avg_sq",
            cells=_with("disk_adam_step",
                        "        for t in (master, exp_avg, exp_avg_sq):\n            t.release(a, b)",
                        "        for t in (master, exp_avg):  # BUG: v's windows are never released\n"
                        "            t.release(a, b)")),
    Student("loads_whole_state", "the disk step takes the whole shard as one chunk: right numbers, the whole "
            "state in memory", {**FULL, "test_offload_memory": 0}, reason="the state was brought into memory",
            cells=_with("disk_adam_step", "    for a in range(0, n, chunk_numel):\n        b = min(a + chunk_numel, n)",
                        "    for a in range(0, n, n):  # BUG: one chunk, all of it\n        b = n")),
]

# Each mistake above is one student; graded as few notebooks as their cells allow, one mistake per exercise
# in each (one_per_exercise: the checks grade an exercise with zerokit's versions of the others).
STUDENTS = [*STUDENTS[:2], *one_per_exercise(FULL, STUDENTS[2:])]
