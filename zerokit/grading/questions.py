"""Check your understanding: numbers a student computes, checked without giving them away.

A lesson ends with a few questions whose answers are numbers (the bytes per rank at N = 8,
the traffic of a design, a ratio). The student writes them into a dict in an answer cell;
the visible test cell compares each with a *digest* of the expected number, so it can say
which answers are right without printing any of them; the hidden test compares the values
themselves, computed in the hidden cell from the lesson's formulas.

What is right. An answer that is an integer (bytes, a count, a number of ranks) is right
only exactly: its digest is taken of the integer itself, so 136,960 is not 136,576. Any
other answer is right to three significant digits: 0.1133, 0.113 and 0.11326 are the same
answer. (Digests made before the integers were exact, taken of three digits for every
number, still read as they did; `python -m zerokit.grading.questions` makes the exact ones.)
The lesson and the key salt each digest: two lessons (or two questions) whose answer is 12
have different digests, and a digest cannot be looked up in a table of the digests of small
numbers without knowing both.

Why the numbers matter, without the numbers. The text that explains a lesson's answers
states them, so the student notebook cannot hold it. It lives in the test cell's hidden
tests, `questions.explain(lesson, text)` placed *before* the visible check, and the visible
call carries it sealed: `why=` is the text encrypted with a key made of the right answers'
digest forms. The check shows it
- in the student's notebook once every answer is right: their answers open the seal (until
  then it is noise; opening it without the answers takes the same search over numbers as
  breaking a digest);
- in a graded notebook whatever the answers: there the hidden `explain` ran first, so
  nbgrader's feedback holds the explanation (the hidden tests' code is never shown in it).

The test cell of a lesson:

    from zerokit.grading import questions

    ### BEGIN HIDDEN TESTS
    questions.explain("05_zero3", '''ZeRO-3's ... (markdown)''')
    ### END HIDDEN TESTS
    questions.check(answers, {"zero3_mb_paper": "5c7a05e1a3b8", ...}, lesson="05_zero3", why=(...))
    ### BEGIN HIDDEN TESTS
    questions = importlib.import_module("zerokit.grading.questions")   # fresh, as every hidden test
    questions.check(answers, {"zero3_mb_paper": 16 * psi / 64 / 1e6, ...}, lesson="05_zero3",
                    exact_integers=True)
    ### END HIDDEN TESTS

The visible call is made from the hidden one, never typed by hand:

    python -m zerokit.grading.questions solutions/05_zero3/05_zero3.ipynb           # print it
    python -m zerokit.grading.questions solutions/05_zero3/05_zero3.ipynb --write   # put it in the cell
    python -m zerokit.grading.questions 05_zero3 zero3_mb_paper=1875                # digests of given numbers
"""

import ast
import base64
import hashlib
import json
import math
import numbers
import sys
import textwrap
import zlib
from pathlib import Path

from .harness import CheckFailed, passed

__all__ = ["digest", "check", "explain", "seal", "expected_from_hidden", "explanation_from_hidden",
           "visible_call", "write_visible_call"]

SIGNIFICANT = 3
HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"
TITLE = "Why these numbers matter"
_explanations = {}  # lesson -> the text a hidden `explain` gave, for the next check of that lesson


def _canonical(value):
    if value == 0:
        return "0"
    return f"{float(value):.{SIGNIFICANT}g}"


def _integral(value):
    """The integer `value` is, up to float rounding (0.1 * 3 * 10 is 3), else None."""
    x = float(value)
    n = round(x)
    return int(n) if abs(x - n) <= 1e-12 * max(1.0, abs(x)) else None


def _forms(value):
    """The forms under which an answer may match a digest: three significant digits, and, for
    an integer, the integer itself ("=" marks it: "=12" and the three digits "12" differ)."""
    n = _integral(value)
    return [_canonical(value)] + ([f"={n}"] if n is not None else [])


def _digest_form(value):
    """The form a new digest is taken of: the integer exactly, any other number to three digits."""
    return _forms(value)[-1]


def _hash(lesson, key, form):
    return hashlib.sha256(f"{lesson}\0{key}\0{form}".encode()).hexdigest()[:12]


def digest(value, lesson, key, exact=False):
    """The digest of the answer `value` to question `key` of `lesson` (e.g. "05_zero3"), as the
    visible test cells store expected answers: of three significant digits, or with
    `exact=True` of the integer `value` itself (right only exactly)."""
    if not (isinstance(lesson, str) and lesson and isinstance(key, str) and key):
        raise TypeError("digest(value, lesson, key): lesson and key are non-empty strings, e.g. "
                        "digest(3, '03_zero1', 'all_reduce_then_slice')")
    if exact and _integral(value) is None:
        raise ValueError(f"an exact digest is of an integer, not {value!r}")
    return _hash(lesson, key, _forms(value)[-1] if exact else _canonical(value))


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


# ---------------------------------------------------------------------------------------
# the explanation, sealed with the right answers


def _seal_key(lesson, forms):
    """The key of `lesson`'s seal: its answers' digest forms ({question: form}), salted."""
    material = "\0".join(["zerokit why", lesson, *(f"{k}\0{forms[k]}" for k in sorted(forms))])
    return hashlib.sha256(material.encode()).digest()


def _keystream(key, n):
    blocks = (hashlib.sha256(key + i.to_bytes(8, "big")).digest() for i in range(-(-n // 32)))
    return b"".join(blocks)[:n]


def seal(text, lesson, values):
    """`text` encrypted with the right answers `values` ({question: number}) of `lesson`: the
    visible check's `why=`, which check() opens with the student's answers once they are all
    right. (SHA-256 as a keystream over the compressed text, and a tag that tells a right key.)"""
    key = _seal_key(lesson, {k: _digest_form(v) for k, v in values.items()})
    body = zlib.compress(text.encode(), 9)
    tag = hashlib.sha256(key + b"tag").digest()[:8]
    return base64.b64encode(tag + bytes(a ^ b for a, b in zip(body, _keystream(key, len(body))))).decode()


def _unseal(blob, lesson, forms):
    """The text sealed in `blob`, if `forms` ({question: digest form}) are the right answers; else None."""
    key = _seal_key(lesson, forms)
    raw = base64.b64decode(blob)
    if raw[:8] != hashlib.sha256(key + b"tag").digest()[:8]:
        return None
    body = raw[8:]
    return zlib.decompress(bytes(a ^ b for a, b in zip(body, _keystream(key, len(body))))).decode()


def explain(lesson, text):
    """In the hidden tests, before the visible check: the explanation of `lesson`'s answers,
    which that check shows whatever the answers (so a graded notebook's feedback holds it).
    A student's notebook never runs this; its check opens the sealed copy (`why=`) instead."""
    _explanations[lesson] = textwrap.dedent(text).strip()


def _show(text):
    """The explanation under its title: as markdown in a notebook, as text elsewhere."""
    plain = f"{TITLE}:\n{text}"
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        sys.stdout.flush()  # after the ✓ line, not before it
        display({"text/markdown": f"**{TITLE}**\n\n{text}", "text/plain": plain}, raw=True)
    else:
        print(plain)


# ---------------------------------------------------------------------------------------
# the check


def check(answers, expected, *, lesson, rel=0.005, exact_integers=False, why=None):
    """Every question in `expected` ({key: digest string, or the expected number}) answered right.

    `lesson` is the lesson's folder name ("05_zero3"): the digests are salted with it and
    with each question's key. A digest is right when the answer has its form: the integer
    itself for an exact digest, the same three significant digits otherwise. A number is
    right within `rel` (relative), or, with `exact_integers`, exactly where it is an integer
    (as the exact digests are: give the hidden call this when the visible one was made
    with them). `why`: the explanation sealed with the right answers (see `seal`), shown
    once they are all right. The message names the wrong answers, never the right ones.
    """
    __tracebackhide__ = True
    told = _explanations.pop(lesson, None)  # a graded notebook: the hidden tests gave it
    try:
        forms = _judge(answers, expected, lesson, rel, exact_integers)
    except CheckFailed:
        if told:
            _show(told)  # the feedback explains the answers to a student who missed them too
        raise
    passed(f"all {len(expected)} answers right")
    text = told
    if text is None and why is not None:
        text = _unseal(why, lesson, forms)
        if text is None:
            raise RuntimeError(f"{lesson}: the sealed explanation (why=) does not open with the right answers: it "
                               "was sealed for other answers; make the visible call again (python -m "
                               "zerokit.grading.questions NOTEBOOK --write)")
    if text:
        _show(text)


def _judge(answers, expected, lesson, rel, exact_integers):
    """Raise CheckFailed naming the wrong answers; else {key: the form that matched its digest}."""
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
    wrong, forms = [], {}
    for key, want in expected.items():
        got = answers[key]
        if isinstance(want, str):
            forms[key] = next((f for f in _forms(got) if _hash(lesson, key, f) == want), None)
            right = forms[key] is not None
        elif exact_integers and _integral(want) is not None:
            right = _integral(got) == _integral(want)
        else:
            right = math.isclose(float(got), float(want), rel_tol=rel, abs_tol=1e-12)
        if not right:
            wrong.append(f"{key} (you gave {_integral(got) if _integral(got) is not None else format(got, 'g')})")
    if wrong:
        raise CheckFailed(f"{len(wrong)} of {len(expected)} answers are not right yet: {'; '.join(wrong)}")
    return forms


# ---------------------------------------------------------------------------------------
# authoring: the visible call comes from the hidden cell's values and text, never typed by hand


def _calls(tree, name):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == name and isinstance(node.func.value, ast.Name) and node.func.value.id == "questions"]


def _hidden_regions(source):
    """The code of each hidden-tests region of a test cell's source."""
    return [part.split(END_HIDDEN, 1)[0] for part in source.split(HIDDEN)[1:]]


def expected_from_hidden(source, namespace=None):
    """{key: value} of the hidden test's `questions.check(answers, {...}, ...)`, evaluated: the
    statements before the call run (in `namespace`, which the cell may need, e.g. torch), then
    the dict literal is evaluated. `source` is the test cell's source (visible part included)."""
    regions = [(r, ast.parse(r)) for r in _hidden_regions(source)]
    found = [(tree, call) for _, tree in regions for call in _calls(tree, "check")]
    if len(found) != 1:
        raise ValueError(f"expected one questions.check(...) call in the hidden tests, found {len(found)}")
    tree, call = found[0]
    namespace = {"__name__": "__questions__"} if namespace is None else namespace
    before = [stmt for stmt in tree.body if stmt.end_lineno < call.lineno]
    exec(compile(ast.Module(body=before, type_ignores=[]), "<hidden test>", "exec"), namespace)  # noqa: S102
    values = eval(compile(ast.Expression(call.args[1]), "<hidden test>", "eval"), namespace)  # noqa: S307
    return {key: float(value) for key, value in values.items()}


def explanation_from_hidden(source):
    """The text of the hidden `questions.explain(lesson, text)` before the visible check, as
    explain() keeps it; None if the cell has none. The text must be a string literal."""
    calls = [call for region in _hidden_regions(source) for call in _calls(ast.parse(region), "explain")]
    if not calls:
        return None
    if len(calls) > 1:
        raise ValueError(f"expected at most one questions.explain(...) call in the hidden tests, found {len(calls)}")
    return textwrap.dedent(ast.literal_eval(calls[0].args[1])).strip()


def visible_call(lesson, values, why=None, width=100):
    """The visible cell's `questions.check(...)`: a digest per question, two to a line (the
    integers' exact), and, with `why` (the explanation), that text sealed with the answers."""
    items = [f'"{key}": "{digest(value, lesson, key, exact=_integral(value) is not None)}"'
             for key, value in values.items()]
    head = "questions.check(answers, {"
    lines = [head + ", ".join(items[:2])]
    for i in range(2, len(items), 2):
        lines[-1] += ","
        lines.append(" " * len(head) + ", ".join(items[i:i + 2]))
    if why is None:
        lines[-1] += f'}}, lesson="{lesson}")'
        return "\n".join(lines)
    blob = seal(why, lesson, values)
    lines[-1] += f'}}, lesson="{lesson}",'
    lines.append(" " * len("questions.check(") + "why=(  # why these numbers matter: your right answers open it")
    chunks = [blob[i:i + width] for i in range(0, len(blob), width)]
    lines += [f'    "{chunk}"' for chunk in chunks]
    lines[-1] += "))"
    return "\n".join(lines)


def _test_cell(cells):
    found = [c for c in cells if c["cell_type"] == "code" and "questions.check" in "".join(c["source"])
             and HIDDEN in "".join(c["source"])]
    if len(found) != 1:
        raise SystemExit(f"expected one test cell that calls questions.check(...) with hidden tests, found {len(found)}")
    return found[0]


def _call_for(path, source):
    import torch  # the hidden cells run after the notebook's imports; torch is the one they use

    return visible_call(Path(path).stem, expected_from_hidden(source, {"torch": torch}),
                        why=explanation_from_hidden(source))


def write_visible_call(path):
    """Put the visible call made from the hidden tests into the notebook's test cell, in place.
    The cell must read: imports; hidden tests (with the explain call); the visible check alone;
    hidden tests (with the check of the values)."""
    path = Path(path)
    nb = json.loads(path.read_text())
    cell = _test_cell(nb["cells"])
    source = "".join(cell["source"])
    parts = source.split(HIDDEN)
    if len(parts) != 3 or END_HIDDEN not in parts[1]:
        raise SystemExit(f"{path}: the test cell must hold two hidden-test regions, the explanation's before the "
                         "visible check and the values' after it (see zerokit.grading.questions)")
    end, _old = parts[1].split(END_HIDDEN, 1)
    parts[1] = f"{end}{END_HIDDEN}\n{_call_for(path, source)}\n"
    new = HIDDEN.join(parts)
    cell["source"] = new.splitlines(keepends=True)
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return new != source


def main(argv):
    if len(argv) in (1, 2) and argv[0].endswith(".ipynb") and argv[1:] in ([], ["--write"]):
        if argv[1:] == ["--write"]:
            changed = write_visible_call(argv[0])
            print(f"{argv[0]}: the visible call {'rewritten' if changed else 'was already up to date'}")
        else:
            print(_call_for(argv[0], "".join(_test_cell(json.loads(Path(argv[0]).read_text())["cells"])["source"])))
    elif len(argv) >= 2 and all("=" in arg for arg in argv[1:]):
        for key, value in (arg.split("=", 1) for arg in argv[1:]):
            exact = _integral(float(value)) is not None
            print(f"{key}={value}: {digest(float(value), argv[0], key, exact=exact)}"
                  + (" (exact: an integer)" if exact else " (three significant digits)"))
    else:
        print("usage:\n" + __doc__.split("never typed by hand:\n\n")[-1].rstrip())
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
