"""Example students for lesson 00 (my_all_reduce): one defect each, named by the student id.

Points: test_my_all_reduce 3, test_same_volume 2, test_questions 2. A defect that breaks only
the sum (not the volume) must cost only test_my_all_reduce's 3 points. Every defect student
answers the questions right (ANSWERED), so that only its defect costs points.
"""

from . import SOLUTION, Student, correct, full_marks, hostile, untouched

LESSON = "00_collectives"
# The demo cells the exercises need (imports, the launcher choice); the rest are left out
# of the lean examples so the set grades quickly. `correct` keeps every cell.
KEEP = ("import zerokit", 'os.environ["ZEROKIT_LAUNCHER"]')

FULL = full_marks(LESSON)
DUE_DATE, LATE_TIMESTAMP = "2026-01-01 10:00:00 UTC", "2026-01-01 12:00:00.000000 UTC"
ZERO = dict.fromkeys(FULL, 0)
EXERCISES_ZERO = {**ZERO, "test_questions": FULL["test_questions"]}  # the exercise cells fail, the answers are right
VOLUME_ONLY = {**EXERCISES_ZERO, "test_same_volume": 2}
ANSWERED = {"answers": SOLUTION}

HEAD = '''def my_all_reduce(tensor):
    """Sum `tensor` over all ranks with a reduce-scatter and an all-gather; return the sum."""
    n = dist.get_world_size()
    numel = tensor.numel()
    chunk = -(-numel // n)
    padded = torch.zeros(chunk * n, dtype=tensor.dtype, device=tensor.device)
    padded[:numel] = tensor
    mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
'''
RS_AG = '''    dist.reduce_scatter_single(mine, padded)
    dist.all_gather_single(padded, mine)
'''
RETURN = "    return padded[:numel].clone()\n"

# Right collectives, right volume, wrong values: the mean instead of the sum.
MEAN = HEAD + RS_AG + "    return padded[:numel] / n  # BUG: the mean, not the sum\n"
# Right values, no reduce-scatter: every rank's whole tensor gathered, then summed locally.
GATHERS_AND_SUMS = '''def my_all_reduce(tensor):
    n = dist.get_world_size()
    everything = torch.empty(n * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(everything, tensor.contiguous())  # BUG: N x the tensor, no reduce-scatter
    return everything.view(n, -1).sum(0)
'''
# Right collectives and volume, the gathered chunks put back in reverse order.
REVERSED = HEAD + RS_AG + "    return torch.cat(list(reversed(padded.chunk(n))))[:numel]  # BUG: chunk order\n"
WRONG_ANSWERS = '''answers = {
    "ring_all_reduce_bytes": 2 * 1_000_000 * 4,  # BUG: forgets (N - 1) / N
    "ring_rounds": 8 - 1,  # BUG: only the reduce-scatter's rounds
    "ring_reduce_scatter_bytes": 1_000_000 * 4 * 7 / 8,
    "my_all_reduce_volume": 2008,
    "gloo_reduce_scatter_ratio": 2,
}
'''


def answered(**cells):
    return {**ANSWERED, **cells}


STUDENTS = [
    correct(LESSON, "my_all_reduce", "answers"),
    untouched(LESSON, "still the stub"),
    Student("deadlock", "rank 0 waits at a barrier no other rank reaches", EXERCISES_ZERO,
            reason="rank 0: never finished: inside torch.distributed.barrier",
            cells={**ANSWERED, "my_all_reduce": HEAD + "    if dist.get_rank() == 0:\n        dist.barrier()  # BUG\n"
                   + RS_AG + RETURN}),
    Student("raises_on_one_rank", "raises ValueError on the last rank only", EXERCISES_ZERO,
            reason="your code raised ValueError: the last rank's chunk is short",
            cells={**ANSWERED, "my_all_reduce": HEAD + "    if dist.get_rank() == n - 1:\n"
                   "        raise ValueError(\"the last rank's chunk is short\")  # BUG\n" + RS_AG + RETURN}),
    Student("crash_os_exit", "rank 1 calls os._exit(3)", EXERCISES_ZERO,
            reason="failed on 1 of 2 ranks: rank 1: exited without returning (exit code 3)",
            cells={**ANSWERED, "my_all_reduce": "import os\n\n" + HEAD + "    if dist.get_rank() == 1:\n"
                   "        os._exit(3)  # BUG\n" + RS_AG + RETURN}),
    Student("runaway_memory", "rank 1 keeps allocating until the check stops it", EXERCISES_ZERO,
            reason="out of memory on 1 of 2 ranks: rank 1: used",
            cells={**ANSWERED, "my_all_reduce": HEAD + "    copies = []\n    while dist.get_rank() == 1:  # BUG\n"
                   "        copies.append(torch.ones(2**25))\n" + RS_AG + RETURN}),
    Student("kernel_memory", "a cell of the notebook allocates without bound: the kernel is killed", ZERO,
            reason="not run: the kernel died in an earlier cell: the kernel (the Python process running your "
                   "notebook) used",
            cells={**ANSWERED, "my_all_reduce": SOLUTION},
            before={"test_my_all_reduce": "hoard = []\nwhile True:\n    hoard.append(torch.ones(2**25))\n"}),
    Student("endless_cell", "a cell of the notebook loops forever (the exercise is right)", FULL,
            cells={**ANSWERED, "my_all_reduce": SOLUTION}, before={"test_my_all_reduce": "while True:\n    pass\n"}),
    Student("misnamed", "defines my_allreduce instead of my_all_reduce", EXERCISES_ZERO,
            reason="name 'my_all_reduce' is not defined",
            cells={**ANSWERED, "my_all_reduce": (HEAD + RS_AG + RETURN).replace("def my_all_reduce", "def my_allreduce")}),
    Student("wrong_signature", "my_all_reduce(tensor, world_size)", EXERCISES_ZERO,
            reason="missing 1 required positional argument: 'world_size'",
            cells={**ANSWERED, "my_all_reduce": (HEAD + RS_AG + RETURN).replace("(tensor):", "(tensor, world_size):")}),
    Student("syntax_error", "a missing colon", EXERCISES_ZERO,
            reason="name 'my_all_reduce' is not defined",
            cells={**ANSWERED, "my_all_reduce": (HEAD + RS_AG + RETURN).replace("(tensor):", "(tensor)")}),
    Student("deleted_test_cell", "sums wrong, and deleted the test cell", VOLUME_ONLY,
            reason="It is the sum divided by N = 2, the mean",
            cells={**ANSWERED, "my_all_reduce": MEAN}, delete=("test_my_all_reduce",)),
    Student("patched_checks", "sums wrong, and replaces lesson00.check_all_reduce, torch.testing.assert_close "
            "and torch.allclose in the notebook", VOLUME_ONLY, reason="It is the sum divided by N = 2, the mean",
            cells={**ANSWERED, "my_all_reduce": MEAN},
            before={"test_my_all_reduce": "from zerokit.grading import lesson00\n"
                    "lesson00.check_all_reduce = lambda *args, **kwargs: None\n"
                    "torch.testing.assert_close = lambda *args, **kwargs: None\n"
                    "torch.allclose = lambda *args, **kwargs: True\n"}),
    Student("patched_torch_on_ranks", "sums right, but replaces torch.allclose inside my_all_reduce",
            EXERCISES_ZERO,
            reason="your code replaced torch.allclose",
            cells={**ANSWERED, "my_all_reduce": HEAD + "    torch.allclose = lambda *args, **kwargs: True  # BUG\n"
                   + RS_AG + RETURN}),
    Student("uses_all_reduce", "right result from dist.all_reduce, not reduce-scatter + all-gather", VOLUME_ONLY,
            reason="your function called dist.all_reduce",
            cells={**ANSWERED, "my_all_reduce": "def my_all_reduce(tensor):\n    out = tensor.clone()\n"
                   "    dist.all_reduce(out)\n    return out\n"}),
    Student("gathers_and_sums", "all-gathers every rank's whole tensor and sums locally: no reduce-scatter, "
            "N x the traffic (at N = 2 exactly dist.all_reduce's)", EXERCISES_ZERO, reason="made no reduce-scatter",
            cells={**ANSWERED, "my_all_reduce": GATHERS_AND_SUMS}),
    Student("chunks_reversed", "reduce-scatter + all-gather, the chunks put back in reverse order",
            {**FULL, "test_my_all_reduce": 0}, reason="right values in the wrong places",
            cells={**ANSWERED, "my_all_reduce": REVERSED}),
    Student("wrong_answers", "the exercise right; two answers wrong (no (N-1)/N; only half the rounds)",
            {**FULL, "test_questions": 0}, reason="2 of 5 answers are not right yet: ring_all_reduce_bytes",
            cells={"my_all_reduce": SOLUTION, "answers": WRONG_ANSWERS}),
    Student("corrupt_file", "the .ipynb is not valid JSON", ZERO,
            reason="the file is not a notebook (not valid JSON)", raw='{"cells": [ this is not JSON\n'),
    # Submissions that attack the grader (hostile.py): behind the wall every attempt fails and the
    # student gets what the code is worth; tests/test_autograde.py reads each attempt's outcome.
    Student("hostile_writes", "sums wrong, and rewrites the checks' comparison, solutions/ and lessons/; "
            "reads solutions/", VOLUME_ONLY, reason="differs on rank",
            cells={**ANSWERED, "my_all_reduce": MEAN}, before={"test_my_all_reduce": hostile.WRITES}),
    Student("hostile_processes", "right, but starts a detached process with an empty environment, connects "
            "out, kills its grader's process group and parent; a plain folder named zerokit beside it", FULL,
            cells={**ANSWERED, "my_all_reduce": SOLUTION}, before={"test_my_all_reduce": hostile.PROCESSES},
            after={"test_same_volume": hostile.KILL_GRADER},
            files={"zerokit/NOTES.md": "my notes on the course (a plain folder, not a package)\n"}),
    Student("planted_zerokit", "sums wrong, with a copy of zerokit beside the notebook whose assert_close "
            "never fails", VOLUME_ONLY, reason="differs on rank",
            cells={**ANSWERED, "my_all_reduce": MEAN}, files=hostile.planted_zerokit()),
    # Late: nbgrader's timestamp.txt, 2 h after the due date the test sets (none is set otherwise).
    Student("late", "right, submitted 2 h after the due date", FULL, cells={**ANSWERED, "my_all_reduce": SOLUTION},
            files={"timestamp.txt": LATE_TIMESTAMP}),
]
