"""Check-your-understanding answers: right and wrong answers told apart, none given away."""

import pytest

from zerokit.grading import questions
from zerokit.grading.harness import CheckFailed


def test_a_digest_is_the_same_for_the_same_number_to_three_significant_digits():
    assert questions.digest(1.875e9) == questions.digest(1875000000) == questions.digest(1.88e9)
    assert questions.digest(1.875e9) != questions.digest(1.86e9)
    assert questions.digest(3) == questions.digest(3.0) != questions.digest(4)


def test_right_answers_pass_by_digest_and_by_value(capsys):
    questions.check({"a": 1.875e9, "b": 3}, {"a": questions.digest(1.875e9), "b": questions.digest(3)})
    questions.check({"a": 1.875e9, "b": 3}, {"a": 1.87e9, "b": 3.0}, rel=0.01)
    assert capsys.readouterr().out.count("✓ all 2 answers right") == 2


def test_a_wrong_answer_is_named_and_the_right_one_is_not_printed():
    with pytest.raises(CheckFailed) as info:
        questions.check({"a": 1.875e9, "b": 5}, {"a": questions.digest(1.875e9), "b": questions.digest(3)})
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
        questions.check(answers, {"a": questions.digest(1)})


def test_an_answer_cell_left_as_released_is_the_stub():
    with pytest.raises(CheckFailed, match="still the stub"):
        questions.check({"a": ..., "b": ...}, {"a": questions.digest(1), "b": questions.digest(2)})
    with pytest.raises(CheckFailed) as info:
        questions.check({"a": 1, "b": ...}, {"a": questions.digest(1), "b": questions.digest(2)})
    assert "no answer yet for b" in str(info.value) and "stub" not in str(info.value)
