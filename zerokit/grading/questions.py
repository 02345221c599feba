"""Check your understanding: numbers a student computes, checked without giving them away.

A lesson ends with a few questions whose answers are numbers (the bytes per rank at N = 8,
the traffic of a design, a ratio). The student writes them into a dict in an answer cell;
the visible test cell compares each with a *digest* of the expected number, so it can say
which answers are right without printing any of them; the hidden test compares the values
themselves, computed in the hidden cell from the lesson's formulas.

    answers = {"zero3_bytes_n8": 1.9e9, "traffic_all_reduce_then_scatter": 3}
    questions.check(answers, {"zero3_bytes_n8": "5c7a05e1a3b8", ...}, lesson="05_zero3")          # visible
    questions.check(answers, {"zero3_bytes_n8": 16 * psi / 8, ...}, lesson="05_zero3", rel=0.01)  # hidden

A digest is taken of the lesson, the question's key and the number rounded to three
significant digits, so 1.875e9, 1.88e9 and 1875000000 are the same answer to one question;
pick questions whose answers are not on a rounding edge. The lesson and the key salt it:
two lessons (or two questions) whose answer is 12 have different digests, and a digest
cannot be looked up in a table of the digests of small numbers without knowing both.

    python -m zerokit.grading.questions solutions/05_zero3/05_zero3.ipynb   # the visible call, from the hidden values
    python -m zerokit.grading.questions 05_zero3 zero3_gb_paper=1.875       # digests of given numbers
"""

import ast
import hashlib
import json
import math
import numbers
import sys
from pathlib import Path

from .harness import CheckFailed, passed

__all__ = ["digest", "check", "expected_from_hidden", "visible_call"]

SIGNIFICANT = 3
HIDDEN = "### BEGIN HIDDEN TESTS"


def _canonical(value):
    if value == 0:
        return "0"
    return f"{float(value):.{SIGNIFICANT}g}"


def digest(value, lesson, key):
    """The digest of the answer `value` to question `key` of `lesson` (e.g. "05_zero3"), as the
    visible test cells store expected answers."""
    if not (isinstance(lesson, str) and lesson and isinstance(key, str) and key):
        raise TypeError("digest(value, lesson, key): lesson and key are non-empty strings, e.g. "
                        "digest(3, '03_zero1', 'all_reduce_then_slice')")
    return hashlib.sha256(f"{lesson}\0{key}\0{_canonical(value)}".encode()).hexdigest()[:12]


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def check(answers, expected, *, lesson, rel=0.005):
    """Every question in `expected` ({key: digest string, or the expected number}) answered right.

    `lesson` is the lesson's folder name ("05_zero3"): the digests are salted with it and
    with each question's key. A number is right within `rel` (relative); a digest is right
    when the answer rounds to the same three significant digits. The message names the wrong
    answers, never the right ones.
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
            right = digest(got, lesson, key) == want
        else:
            right = math.isclose(float(got), float(want), rel_tol=rel, abs_tol=1e-12)
        if not right:
            wrong.append(f"{key} (you gave {got:g})")
    if wrong:
        raise CheckFailed(f"{len(wrong)} of {len(expected)} answers are not right yet: {'; '.join(wrong)}")
    passed(f"all {len(expected)} answers right")


# ---------------------------------------------------------------------------------------
# authoring: the visible digests come from the hidden cell's values, never typed by hand


def _check_call(tree):
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "check" and isinstance(node.func.value, ast.Name)
             and node.func.value.id == "questions"]
    if len(calls) != 1:
        raise ValueError(f"expected one questions.check(...) call, found {len(calls)}")
    return calls[0]


def expected_from_hidden(source, namespace=None):
    """{key: value} of the hidden test's `questions.check(answers, {...}, ...)`, evaluated: the
    statements before the call run (in `namespace`, which the cell may need, e.g. torch), then
    the dict literal is evaluated. `source` is the test cell's source (visible part included)."""
    hidden = source.split(HIDDEN, 1)[1].split("### END HIDDEN TESTS", 1)[0]
    tree = ast.parse(hidden)
    call = _check_call(tree)
    namespace = {"__name__": "__questions__"} if namespace is None else namespace
    before = [stmt for stmt in tree.body if stmt.end_lineno < call.lineno]
    exec(compile(ast.Module(body=before, type_ignores=[]), "<hidden test>", "exec"), namespace)  # noqa: S102
    values = eval(compile(ast.Expression(call.args[1]), "<hidden test>", "eval"), namespace)  # noqa: S307
    return {key: float(value) for key, value in values.items()}


def visible_call(lesson, values, width=110):
    """The visible cell's `questions.check(...)` line(s): a digest per question, two to a line."""
    items = [f'"{key}": "{digest(value, lesson, key)}"' for key, value in values.items()]
    head = "questions.check(answers, {"
    lines = [head + ", ".join(items[:2])]
    for i in range(2, len(items), 2):
        lines[-1] += ","
        lines.append(" " * len(head) + ", ".join(items[i:i + 2]))
    lines[-1] += f'}}, lesson="{lesson}")'
    return "\n".join(lines)


def _from_notebook(path):
    path = Path(path)
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells]
    test = next((s for s in sources if "questions.check" in s and HIDDEN in s), None)
    if test is None:
        raise SystemExit(f"{path}: no test cell calls questions.check(...) with hidden tests")
    import torch  # the hidden cells run after the notebook's imports; torch is the one they use

    return visible_call(path.stem, expected_from_hidden(test, {"torch": torch}))


def main(argv):
    if len(argv) == 1 and argv[0].endswith(".ipynb"):
        print(_from_notebook(argv[0]))
    elif len(argv) >= 2 and all("=" in arg for arg in argv[1:]):
        for key, value in (arg.split("=", 1) for arg in argv[1:]):
            print(f"{key}={value}: {digest(float(value), argv[0], key)}")
    else:
        print("usage:\n" + __doc__.split("\n\n")[-1].rstrip())
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
