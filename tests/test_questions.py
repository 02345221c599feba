"""Check-your-understanding answers: right and wrong answers told apart, none given away, and
the explanation of the answers shown once they are right (or after grading), never before."""

import ast
import json
import re

import pytest
import torch

from conftest import ROOT
from zerokit.grading import questions
from zerokit.grading.harness import CheckFailed

L = "99_test"


def d(value, key="a", lesson=L, exact=False):
    return questions.digest(value, lesson, key, exact=exact)


def test_a_digest_is_the_same_for_the_same_number_to_three_significant_digits():
    assert d(1.875e9) == d(1875000000) == d(1.88e9)
    assert d(1.875e9) != d(1.86e9)
    assert d(3) == d(3.0) != d(4)


def test_a_digest_is_salted_by_lesson_and_question():
    """Two lessons' answers 12 (05's accumulation traffic, say, and another's) do not share a
    digest, nor do two questions of one lesson, and a digest is not sha256 of the number."""
    import hashlib

    assert d(12, "accumulation_traffic_psi", "05_zero3") != d(12, "accumulation_traffic_psi", "08_beyond_model_states")
    assert d(12, "a") != d(12, "b")
    assert d(12) not in {hashlib.sha256(s.encode()).hexdigest()[:12] for s in ("12", "12.0", "12.000")}
    with pytest.raises(TypeError, match="lesson and key"):
        questions.digest(12, "", "a")


def test_the_released_lessons_answers_of_equal_value_have_different_digests():
    """Every lesson's visible digests, with the hidden values behind them: where two questions
    (in one lesson or in two) have the same answer, their digests still differ."""
    seen = {}
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        test = next((c for c in cells if "questions.check" in "".join(c["source"])), None)
        if test is None:
            continue
        source = "".join(test["source"])
        values = questions.expected_from_hidden(source, {"torch": torch})
        visible = eval(re.search(r"questions\.check\(answers, (\{.*?\}), lesson=", source, re.S).group(1))  # noqa: S307
        for key, value in values.items():  # an integer's digest may be exact (made since) or of 3 digits (before)
            made = {questions.digest(value, path.stem, key)}
            made |= {questions.digest(value, path.stem, key, exact=True)} if value == int(value) else set()
            assert visible[key] in made, (path.stem, key)
            seen.setdefault(questions._canonical(value), []).append((path.stem, key, visible[key]))
    shared = {v: qs for v, qs in seen.items() if len(qs) > 1}
    assert any(len({lesson for lesson, _, _ in qs}) > 1 for qs in shared.values()), shared  # 03's and 04's 3 at least
    for qs in shared.values():
        assert len({digest for _, _, digest in qs}) == len(qs), qs


def test_the_visible_call_is_made_from_the_hidden_values():
    call = questions.visible_call("05_zero3", {"a": 1.0, "b": 2.0, "c": 3.0})
    assert call.endswith(', lesson="05_zero3")') and call.count("\n") == 1
    namespace = {"questions": questions, "answers": {"a": 1, "b": 2, "c": 3}}
    exec(call, namespace)  # noqa: S102
    assert questions.main(["05_zero3", "a=1"]) == 0


def test_right_answers_pass_by_digest_and_by_value(capsys):
    questions.check({"a": 1.875e9, "b": 3}, {"a": d(1.875e9), "b": d(3, "b")}, lesson=L)
    questions.check({"a": 1.875e9, "b": 3}, {"a": 1.87e9, "b": 3.0}, lesson=L, rel=0.01)
    assert capsys.readouterr().out.count("✓ all 2 answers right") == 2


def test_a_right_answer_to_another_lesson_or_question_is_not_right():
    with pytest.raises(CheckFailed, match="a \\(you gave 3\\)"):
        questions.check({"a": 3}, {"a": d(3)}, lesson="98_other")
    with pytest.raises(CheckFailed, match="b \\(you gave 3\\)"):
        questions.check({"b": 3}, {"b": d(3, "a")}, lesson=L)


def test_a_wrong_answer_is_named_and_the_right_one_is_not_printed():
    with pytest.raises(CheckFailed) as info:
        questions.check({"a": 1.875e9, "b": 5}, {"a": d(1.875e9), "b": d(3, "b")}, lesson=L)
    message = str(info.value)
    assert "1 of 2" in message and "b (you gave 5)" in message
    assert "a (" not in message and "3" not in message.replace("1 of 2", "")


@pytest.mark.parametrize("answers, fragment", [
    ({"a": ...}, "no answer yet for a"),
    ({}, "no answer yet for a"),
    ({"a": "12"}, "must be numbers"),
    ({"a": True}, "must be numbers"),
    ({"a": float("nan")}, "must be numbers"),
    ([1], "must be a dict"),
])
def test_unfinished_or_malformed_answers_say_why(answers, fragment):
    """(an answer cell left as released is named as the stub, as an exercise left as released is)"""
    with pytest.raises(CheckFailed, match=fragment):
        questions.check(answers, {"a": d(1)}, lesson=L)


def test_an_answer_cell_left_as_released_is_the_stub():
    with pytest.raises(CheckFailed, match="still the stub"):
        questions.check({"a": ..., "b": ...}, {"a": d(1), "b": d(2, "b")}, lesson=L)
    with pytest.raises(CheckFailed) as info:
        questions.check({"a": 1, "b": ...}, {"a": d(1), "b": d(2, "b")}, lesson=L)
    assert "no answer yet for b" in str(info.value) and "stub" not in str(info.value)


# ---------------------------------------------------------------------------------------
# integers exactly


def test_an_integer_answer_is_right_only_exactly():
    """Lesson 10's Ψ on paper: 136,960 (biases the model does not have) rounds to the same three
    digits as 136,576; an exact digest tells them apart, and float noise in a right method
    (0.1 * 3 * 10) is still the integer."""
    want = {"psi": d(136576, "psi", exact=True), "a": d(3, exact=True)}
    questions.check({"psi": 136576.0, "a": 0.1 * 3 * 10}, want, lesson=L)
    with pytest.raises(CheckFailed, match=r"psi \(you gave 136960\)"):
        questions.check({"psi": 136960, "a": 3}, want, lesson=L)
    with pytest.raises(CheckFailed, match=r"a \(you gave 3.0001\)"):
        questions.check({"psi": 136576, "a": 3.0001}, want, lesson=L)
    with pytest.raises(ValueError, match="exact digest is of an integer"):
        questions.digest(1.5, L, "a", exact=True)


def test_a_non_integer_answer_is_right_to_three_digits_an_integer_one_too():
    questions.check({"a": 338.64}, {"a": d(338.64325)}, lesson=L)
    questions.check({"a": 339}, {"a": d(338.64325)}, lesson=L)  # three digits of 338.64 are 339
    with pytest.raises(CheckFailed):
        questions.check({"a": 338}, {"a": d(338.64325)}, lesson=L)


def test_digests_made_before_integers_were_exact_read_as_they_did():
    """Lessons whose visible call predates exact digests keep their three digits, hidden check too."""
    old = {"a": d(2525247)}
    questions.check({"a": 2.53e6}, old, lesson=L)
    questions.check({"a": 2.53e6}, {"a": 2525247}, lesson=L)  # the hidden check as those lessons call it


def test_the_hidden_check_of_values_takes_integers_exactly_when_told():
    questions.check({"a": 12, "b": 1.131}, {"a": 12, "b": 1.1326}, lesson=L, exact_integers=True)
    with pytest.raises(CheckFailed, match=r"a \(you gave 12.04\)"):
        questions.check({"a": 12.04, "b": 1.131}, {"a": 12, "b": 1.1326}, lesson=L, exact_integers=True)


# ---------------------------------------------------------------------------------------
# the explanation: sealed with the right answers, shown by the check


WHY = "Two numbers: 1875 MB is the paper's 1.9 GB, and 12 is $4 \\times 3\\Psi$."


def _values():
    return {"a": 1875, "b": 1.1326}


def test_the_sealed_explanation_opens_with_the_right_answers_only(capsys):
    call = questions.visible_call(L, _values(), why=WHY)
    assert "1875" not in call and "Two numbers" not in call and "why=(" in call
    namespace = {"questions": questions, "answers": {"a": 1875, "b": 1.13}}
    exec(call, namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert out.index("✓ all 2 answers right") < out.index(questions.TITLE) < out.index(WHY), out
    namespace["answers"] = {"a": 1876, "b": 1.13}
    with pytest.raises(CheckFailed) as info:
        exec(call, namespace)  # noqa: S102
    assert WHY not in str(info.value) + capsys.readouterr().out


def test_a_seal_is_salted_by_lesson_and_made_for_its_answers():
    blob = questions.seal(WHY, L, _values())
    forms = {"a": "=1875", "b": "1.13"}
    assert questions._unseal(blob, L, forms) == WHY
    assert questions._unseal(blob, "98_other", forms) is None
    assert questions._unseal(blob, L, {"a": "=1876", "b": "1.13"}) is None
    assert questions._unseal(blob, L, {"a": "1.88e+03", "b": "1.13"}) is None  # 3 digits of 1875: not the integer


def test_a_graded_notebook_shows_the_explanation_whatever_the_answers(capsys):
    """The hidden tests' explain() runs before the visible check: its text is shown once, after
    a pass, before a failure (nbgrader's feedback holds it), and for an unanswered stub too."""
    call = questions.visible_call(L, _values(), why=WHY)
    namespace = {"questions": questions}
    for answers, fails in (({"a": ..., "b": ...}, True), ({"a": 1, "b": 1.13}, True), ({"a": 1875, "b": 1.13}, False)):
        questions.explain(L, f"""
            told: {WHY}
        """)
        namespace["answers"] = answers
        if fails:
            with pytest.raises(CheckFailed):
                exec(call, namespace)  # noqa: S102
        else:
            exec(call, namespace)  # noqa: S102
        out = capsys.readouterr().out
        assert out.count(questions.TITLE) == 1 and f"told: {WHY}" in out, (answers, out)
    exec(call, namespace)  # noqa: S102  (explain() holds for one check: the next opens the seal)
    assert "told:" not in capsys.readouterr().out


def test_a_seal_for_other_answers_is_the_authors_error_not_the_students():
    call = questions.visible_call(L, {"a": 1875, "b": 1.1326}, why=WHY)
    tampered = call.replace(questions.seal(WHY, L, _values())[:20], questions.seal(WHY, L, {"a": 1, "b": 2})[:20])
    with pytest.raises(RuntimeError, match="make the visible call again"):
        exec(tampered, {"questions": questions, "answers": {"a": 1875, "b": 1.13}})  # noqa: S102


def test_write_visible_call_fills_the_cell_from_the_hidden_tests(tmp_path, capsys):
    source = ('from zerokit.grading import questions\n\n### BEGIN HIDDEN TESTS\n'
              f'questions.explain("{L}", r"""\n    {WHY}\n""")\n### END HIDDEN TESTS\n'
              'questions.check(answers, {}, lesson="stale")\n### BEGIN HIDDEN TESTS\n'
              f'questions.check(answers, {{"a": 1875, "b": 1.1326}}, lesson="{L}", exact_integers=True)\n'
              '### END HIDDEN TESTS')
    path = tmp_path / f"{L}.ipynb"
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": source.splitlines(keepends=True),
                                           "metadata": {}, "outputs": [], "execution_count": None}]}))
    assert questions.main([str(path), "--write"]) == 0
    new = "".join(json.loads(path.read_text())["cells"][0]["source"])
    assert questions.explanation_from_hidden(new) == WHY
    assert new.count("### BEGIN HIDDEN TESTS") == 2 and 'lesson="stale"' not in new
    capsys.readouterr()
    visible = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "", new, flags=re.S)
    exec(visible, {"answers": {"a": 1875, "b": 1.13}})  # noqa: S102  (what a student's notebook runs)
    assert WHY in capsys.readouterr().out
    assert not questions.write_visible_call(path)  # made again: the same


# ---------------------------------------------------------------------------------------
# every lesson: no answer in the student notebook, in any form


def _question_lessons():
    out = []
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        if any("questions.check" in "".join(c["source"]) for c in cells):
            out.append(path.stem)
    return out


def _test_source(lesson):
    cells = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())["cells"]
    return "".join(next(c for c in cells if "questions.check" in "".join(c["source"])
                        and "### BEGIN HIDDEN TESTS" in "".join(c["source"]))["source"])


def _significant(text):
    digits = re.sub(r"\D", "", text).lstrip("0")
    return len(digits) if "." in text else len(digits.rstrip("0"))


def answer_forms(value):
    """How a notebook might state `value`: the integer with any thousands separator, or its
    roundings to 3-6 significant digits, as is or scaled by 10^±3, ±6, ±9 (GB for bytes). Only
    forms of 3 significant digits or more (4 when scaled): "12" and "1.5" are everywhere."""
    out = set()
    for k in (-9, -6, -3, 0, 3, 6, 9):
        x, least = value * 10.0 ** k, 3 if k == 0 else 4
        n = questions._integral(x)
        if n is not None:
            if _significant(str(n)) >= least or (k == 0 and abs(n) >= 1000):
                out |= {f"{n:,}".replace(",", sep) for sep in (",", "\\,", " ", "{,}", "\u2009", "_", "")}
        else:
            out |= {s for digits in range(3, 7) if "e" not in (s := f"{x:.{digits}g}") and _significant(s) >= least}
    return out


def _words(text):
    return re.findall(r"[A-Za-z0-9$\\^{}.%-]+", text)


@pytest.mark.parametrize("lesson", _question_lessons())
def test_no_answer_sits_in_the_student_notebook(lesson):
    """lessons/<lesson>: no box that explains the answers, no run of eight words of the hidden
    explanation, and none of the answers written out (cells' sources, outputs too)."""
    released = json.loads((ROOT / "lessons" / lesson / f"{lesson}.ipynb").read_text())["cells"]
    text = "\n".join("".join(c["source"]) + "".join(json.dumps(o) for o in c.get("outputs", [])) for c in released)
    boxes = re.findall(r"<summary>.{0,40}Why these numbers matter.*?</details>", text, re.S)
    assert not boxes, f"{lesson}: the student notebook explains its answers: {boxes[0][:160]!r}"
    source = _test_source(lesson)
    why = questions.explanation_from_hidden(source)
    if why:
        words, released_words = _words(why), " ".join(_words(text))
        runs = [" ".join(words[i:i + 8]) for i in range(max(1, len(words) - 7))]
        leaked = [run for run in runs if run in released_words]
        assert not leaked, f"{lesson}: the hidden explanation's words are in the student notebook: {leaked[0]!r}"
    for key, value in questions.expected_from_hidden(source, {"torch": torch}).items():
        for form in answer_forms(value):
            hit = re.search(r"(?<![\d.,])" + re.escape(form) + r"(?![\d]|[.,]\d)", text)
            assert hit is None, (f"{lesson}: the answer to {key} ({form}) is in the student notebook: "
                                 f"...{text[max(0, hit.start() - 80):hit.end() + 40]}...")


def _visible_check(source):
    visible = re.sub(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", "", source, flags=re.S)
    return next(node for node in ast.walk(ast.parse(visible)) if isinstance(node, ast.Call)
                and getattr(node.func, "attr", None) == "check")


@pytest.mark.parametrize("lesson", [lesson for lesson in _question_lessons()
                                    if questions.explanation_from_hidden(_test_source(lesson))])
def test_the_explanation_is_sealed_with_the_answers_and_integers_are_exact(lesson):
    """A lesson that explains its answers keeps the text in the hidden tests and its sealed copy
    in the visible call, which the right answers open; its integers are checked exactly, in the
    visible digests and the hidden check alike."""
    source = _test_source(lesson)
    values = questions.expected_from_hidden(source, {"torch": torch})
    call = _visible_check(source)
    kwargs = {k.arg: k.value for k in call.keywords}
    forms = {k: questions._digest_form(v) for k, v in values.items()}
    assert questions._unseal(ast.literal_eval(kwargs["why"]), lesson, forms) == \
        questions.explanation_from_hidden(source), f"{lesson}: make the visible call again (--write)"
    digests = ast.literal_eval(call.args[1])
    for key, value in values.items():
        exact = questions._integral(value) is not None
        assert digests[key] == questions.digest(value, lesson, key, exact=exact), (lesson, key)
    assert "exact_integers=True" in source.split("### BEGIN HIDDEN TESTS")[-1], lesson
