"""Example students for lesson 04 (ZeRO-2): MyZeRO2Adam's three methods.

Points: test_matches_adamw 4, test_gradients_sharded 3, test_reduced_during_backward 3,
test_unused_parameters 3, test_accumulation 2, test_questions 2 (the stretch exercise's cell is not graded).
"""

from . import SOLUTION, Student, correct, full_marks, solution_with, untouched

LESSON = "04_zero2"
KEEP = ("import zerokit",)  # the imports cell (it also picks the forkserver launcher)

FULL = full_marks(LESSON)
ZERO = dict.fromkeys(FULL, 0)


# send without `p.grad = None`: every full gradient outlives backward (the point of ZeRO-2 missed).
KEEPS_FULL_GRADIENT = solution_with(
    "            p.grad = None  # the full gradient is gone as soon as its bucket is on its way\n",
    "            pass  # BUG: the full gradient stays alive\n")

# _on_grad_ready with `if` for `while`: when one gradient completes several buckets (those behind the
# head already complete), only the head goes out and the rest wait; the hidden test's buckets of 30
# put each LayerNorm's bias and weight apart, and the weight's gradient arrives first.
IF_NOT_WHILE = solution_with(
    "        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]",
    "        if self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]")

# send waits for its own reduce-scatter: right numbers, but backward stands still while each bucket travels.
WAITS_IN_SEND = solution_with(
    "        self._in_flight.append((work, bi, out, flat))\n",
    "        work.wait()  # BUG: blocks backward until the transfer is done\n"
    "        self._in_flight.append((work, bi, out, flat))\n")

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
    Student("if_not_while", "sends only the head of the line when one gradient completes several buckets",
            {**FULL, "test_reduced_during_backward": 0}, reason="only the first went out",
            cells={"my_zero2": IF_NOT_WHILE, "answers": SOLUTION}),
    Student("waits_in_send", "waits for each reduce-scatter inside send(): no overlap with backward",
            {**FULL, "test_reduced_during_backward": 0}, reason="waited for inside send()",
            cells={"my_zero2": WAITS_IN_SEND, "answers": SOLUTION}),
]
