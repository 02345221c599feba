"""Example students for lesson 04 (ZeRO-2): MyZeRO2Adam's three methods.

Points: test_matches_adamw 4, test_gradients_sharded 3, test_reduced_during_backward 3,
test_unused_parameters 3, test_accumulation 2, test_questions 2 (the stretch exercise's cell is not graded).
"""

from . import SOLUTION, Student, correct, full_marks, solution_with, untouched

LESSON = "04_zero2"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
ZERO = dict.fromkeys(FULL, 0)


# _send without `p.grad = None`: every full gradient outlives backward (the point of ZeRO-2 missed).
KEEPS_FULL_GRADIENT = solution_with(
    "            p.grad = None  # the full gradient is gone as soon as its bucket is on its way\n",
    "            pass  # BUG: the full gradient stays alive\n")

STUDENTS = [
    correct(LESSON, "my_zero2", "answers", "stretch_clipping"),
    # the stubs' reason and the questions' both ask whether the cell is still the stub
    untouched(LESSON, "still the stub"),
    Student("no_answers", "the exercise solved, the check-your-understanding answers left as released",
            {**FULL, "test_questions": 0}, reason="no answer yet", cells={"my_zero2": SOLUTION}),
    # never freeing .grad costs the memory check, and accumulation too: each backward adds into the
    # last one's .grad, so the earlier micro-batches are sent again
    Student("keeps_full_gradient", "never frees .grad (the point missed), and replaced that test cell by `pass`",
            {**FULL, "test_gradients_sharded": 0, "test_accumulation": 0}, reason=".grad is still set",
            cells={"my_zero2": KEEPS_FULL_GRADIENT, "test_gradients_sharded": "pass  # all good\n",
                   "answers": SOLUTION}),
]
