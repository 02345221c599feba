"""Check-your-understanding answers: right and wrong answers told apart, none given away."""

import json
import re

import pytest
import torch

from conftest import ROOT
from zerokit.grading import questions
from zerokit.grading.harness import CheckFailed

L = "99_test"


def d(value, key="a", lesson=L):
    return questions.digest(value, lesson, key)


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
        for key, value in values.items():
            assert visible[key] == questions.digest(value, path.stem, key), (path.stem, key)
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
