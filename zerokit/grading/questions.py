"""Check your understanding: numbers a student computes, checked without giving them away.

A lesson ends with a few questions whose answers are numbers (the bytes per rank at N = 8,
the traffic of a design, a ratio). The student writes them into a dict in an answer cell;
the visible test cell compares each with a *digest* of the expected number, so it can say
which answers are right without printing any of them; the hidden test compares the values
themselves, computed in the hidden cell from the lesson's formulas.

    answers = {"zero3_bytes_n8": 1.9e9, "traffic_all_reduce_then_scatter": 3}
    questions.check(answers, {"zero3_bytes_n8": "5c7a05e1a3b8", ...})          # visible
    questions.check(answers, {"zero3_bytes_n8": 16 * psi / 8, ...}, rel=0.01)  # hidden

A digest is taken of the number rounded to three significant digits, so 1.875e9,
1.88e9 and 1875000000 are the same answer; pick questions whose answers are not on a
rounding edge. `python -m zerokit.grading.questions 1.875e9 3` prints digests.
"""

import hashlib
import math
import numbers
import sys

from .harness import CheckFailed, passed

__all__ = ["digest", "check"]

SIGNIFICANT = 3


def _canonical(value):
    if value == 0:
        return "0"
    return f"{float(value):.{SIGNIFICANT}g}"


def digest(value):
    """The digest of a number, as the visible test cells store expected answers."""
    return hashlib.sha256(_canonical(value).encode()).hexdigest()[:12]


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def check(answers, expected, rel=0.005):
    """Every question in `expected` ({key: digest string, or the expected number}) answered right.

    A number is right within `rel` (relative); a digest is right when the answer rounds to the
    same three significant digits. The message names the wrong answers, never the right ones.
    """
    __tracebackhide__ = True
    if not isinstance(answers, dict):
        raise CheckFailed(f"`answers` must be a dict {{question: number}}, got {type(answers).__name__}")
    unanswered = [k for k in expected if answers.get(k, ...) is ...]
    if unanswered:
        stub = " (the answer cell is still the stub)" if len(unanswered) == len(expected) else ""
        raise CheckFailed(f"no answer yet for {', '.join(unanswered)}{stub}: replace the ... in `answers` with a number")
    not_numbers = [k for k in expected if not _is_number(answers[k])]
    if not_numbers:
        raise CheckFailed("answers must be numbers (int or float): "
                          + ", ".join(f"{k} is {answers[k]!r}" for k in not_numbers))
    wrong = []
    for key, want in expected.items():
        got = answers[key]
        if isinstance(want, str):
            right = digest(got) == want
        else:
            right = math.isclose(float(got), float(want), rel_tol=rel, abs_tol=1e-12)
        if not right:
            wrong.append(f"{key} (you gave {got:g})")
    if wrong:
        raise CheckFailed(f"{len(wrong)} of {len(expected)} answers are not right yet: {'; '.join(wrong)}")
    passed(f"all {len(expected)} answers right")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {digest(float(arg))}")
