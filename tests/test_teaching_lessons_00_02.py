"""Lessons 00-02 teach by thinking: each exercise states its contract and offers a ladder of hints
(the recipe only in the last rung), and each lesson ends with questions whose answers the
student computes, checked without being given away.

The markup of a rung is the same in every lesson (JupyterLab, nbconvert and the feedback
HTML render it; the blank lines let the markdown inside render too):

    <details><summary><b>Hint 1 — the idea</b></summary>

    ...

    </details>
"""

import json
import re

import pytest

from conftest import ROOT
from zerokit.grading import questions
from zerokit.grading.harness import CheckFailed

LESSONS = ("00_collectives", "01_adam", "02_distributed_adam")
# solution cells that are not exercises with a ladder: the answers, and an optional stretch
NOT_LADDERED = {"answers", "loss_curve"}
RUNG = re.compile(r"<details><summary><b>Hint (\d) — ([^<]+)</b></summary>\n\n(.*?)\n\n</details>", re.S)


def _cells(folder, lesson):
    return json.loads((ROOT / folder / lesson / f"{lesson}.ipynb").read_text())["cells"]


def _meta(cell):
    return cell.get("metadata", {}).get("nbgrader", {})


def _source(cell):
    return "".join(cell["source"])


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_exercise_opens_with_a_ladder_of_hints_ending_in_the_recipe(lesson):
    cells = _cells("solutions", lesson)
    exercises = [i for i, c in enumerate(cells)
                 if _meta(c).get("solution") and _meta(c)["grade_id"] not in NOT_LADDERED]
    assert exercises, lesson
    for i in exercises:
        j = i - 1
        while j >= 0 and cells[j]["cell_type"] == "markdown":
            j -= 1
        text = "\n".join(_source(c) for c in cells[j + 1:i])
        gid = _meta(cells[i])["grade_id"]
        rungs = RUNG.findall(text)
        assert len(rungs) >= 2, f"{lesson}/{gid}: a ladder needs at least two rungs, found {len(rungs)}"
        assert text.count("<details>") == len(rungs), f"{lesson}/{gid}: a <details> not in the ladder's markup"
        assert [int(n) for n, _, _ in rungs] == list(range(1, len(rungs) + 1)), f"{lesson}/{gid}: rungs out of order"
        assert rungs[0][1] == "the idea" and rungs[-1][1] == "the recipe", f"{lesson}/{gid}: {[r[1] for r in rungs]}"
        before = text[:text.index("<details>")]
        assert "contract" in before.lower(), f"{lesson}/{gid}: no contract above the hints"


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_ends_with_questions_whose_released_stub_says_no_answer_yet(lesson):
    cells = _cells("lessons", lesson)
    assert any(c["cell_type"] == "markdown" and "## Check your understanding" in _source(c) for c in cells), lesson
    answer = next(c for c in cells if _meta(c).get("grade_id") == "answers")
    test = next(c for c in cells if _meta(c).get("grade_id") == "test_questions")
    assert _meta(test).get("grade") and _meta(test).get("points", 0) > 0
    stub = _source(answer)
    assert "raise NotImplementedError()" in stub
    namespace = {}
    exec(stub.split("# YOUR CODE HERE")[0], namespace)
    answers = namespace["answers"]
    assert 3 <= len(answers) <= 5 and all(v is ... for v in answers.values()), answers
    expected = re.search(r"questions\.check\(answers, (\{.*?\}), lesson=\"(\w+)\"\)", _source(test), re.S)
    assert expected.group(2) == lesson
    digests = eval(expected.group(1))  # noqa: S307  (the visible cell's own literal)
    assert set(digests) == set(answers) and all(isinstance(d, str) for d in digests.values())
    with pytest.raises(CheckFailed, match="still the stub"):
        questions.check(answers, digests, lesson=lesson)


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_visible_digests_and_the_hidden_values_agree_with_the_solution(lesson, capsys):
    cells = _cells("solutions", lesson)
    answer = _source(next(c for c in cells if _meta(c).get("grade_id") == "answers"))
    test = _source(next(c for c in cells if _meta(c).get("grade_id") == "test_questions"))
    namespace = {}
    exec("import torch\nfrom zerokit.models import OddMLP\n" + answer, namespace)
    visible, hidden = test.split("### BEGIN HIDDEN TESTS")
    exec(visible, namespace)
    exec(hidden.split("### END HIDDEN TESTS")[0], namespace)
    assert capsys.readouterr().out.count("✓ all") == 2
