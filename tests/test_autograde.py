"""The instructor's grading flow, end to end, on the example submissions of tests/submissions.

Every example student of every lesson (tests/submissions/lessonNN.py: a correct one, the
untouched notebook, and one defect each) is written into a temporary folder in nbgrader's
layout and graded once with real nbgrader, kernels and ranks, as `make grade` does. Then:
each test cell's score is the one the student's module expects, a failed cell's one-line
reason names the problem, every student gets feedback HTML carrying those reasons, the CSV
has a row per student and a column per lesson and per test cell, no grading process
survives, and grading some of the same submissions again gives those students' rows of
the CSV byte for byte the same.
"""

import csv
import html
import time

import pytest

from tests import submissions
from zerokit.grading import autograde

# the first test pays for grading every example (the module fixture): minutes, not seconds
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1500)]

# Four graders at a time, on 2 cores too: most of a notebook's time is waiting (kernel start,
# rendezvous, timeouts). Measured on 2 cores: 4 min 16 s with 4, 6 min 3 s with 2, same CPU.
JOBS = 4
# Shorter than `make grade`'s defaults (check 60 s, cell 60 s, kernel 4 GiB), so that the
# deadlock, the endless cell and the memory hog cost less time; the flow is the same.
OPTIONS = {"check_timeout": 30, "cell_timeout": 40, "memory_limit_gb": 2.0}
# Graded a second time (lesson 00): failure modes whose grades zerokit writes (corrupt
# file, dead kernel), a restored test cell, and the plain untouched notebook.
REGRADE = ("corrupt_file", "kernel_memory", "deleted_test_cell", "untouched")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("grading")
    built = submissions.build(root / "submitted")
    t0 = time.monotonic()
    results = autograde.grade(root / "submitted", course_dir=root / "course", out=root / "out", jobs=JOBS,
                              echo=print, **OPTIONS)
    seconds = time.monotonic() - t0
    print(f"graded {len(results)} notebooks in {seconds:.0f} s")
    return root, built, results


def _students(built):
    return [(lesson, s) for lesson, students in built.items() for s in students]


def test_every_lesson_with_examples_was_graded(graded):
    _, built, results = graded
    assert set(built) == set(submissions.lesson_modules())
    assert {(s.id, lesson) for lesson, s in _students(built)} == set(results)


def test_each_student_gets_exactly_the_expected_points(graded):
    _, built, results = graded
    rows, wrong = [], []
    for lesson, student in _students(built):
        r = results[(student.id, lesson)]
        given = {name: score for name, (score, _) in r["cells"].items()}
        rows.append(f"{lesson:<20} {student.id:<24} expected {sum(student.expected.values()):>4g}  "
                    f"given {r['score']:>4g} of {r['max_score']:g}  ({student.defect})")
        if set(student.expected) != set(given):
            wrong.append(f"{lesson}/{student.id}: expects cells {sorted(student.expected)}, graded {sorted(given)}")
        for name, points in student.expected.items():
            if name in given and given[name] != points:
                wrong.append(f"{lesson}/{student.id}: {name} expected {points:g}, given {given[name]:g}: "
                             f"{r['reasons'].get(name, '(no reason)')}")
    print("\n".join(rows))
    assert not wrong, "\n".join(wrong)


def test_every_lost_point_comes_with_a_one_line_reason(graded):
    _, built, results = graded
    wrong = []
    for lesson, student in _students(built):
        r = results[(student.id, lesson)]
        for name, (score, max_score) in r["cells"].items():
            if score >= max_score:
                continue
            reason = r["reasons"].get(name, "")
            if not reason or "\n" in reason:
                wrong.append(f"{lesson}/{student.id}/{name}: no one-line reason: {reason!r}")
            elif student.reason not in reason:
                wrong.append(f"{lesson}/{student.id}/{name}: reason {reason!r} lacks {student.reason!r}")
    assert not wrong, "\n".join(wrong)


def test_feedback_html_for_every_student_shows_the_reasons_not_the_hidden_tests(graded):
    root, built, results = graded
    for lesson, student in _students(built):
        page = root / "out" / "feedback" / student.id / lesson / f"{lesson}.html"
        assert page.exists(), page
        text = html.unescape(page.read_text())
        assert "HIDDEN TESTS" not in text, f"{page} shows the hidden tests' code"
        for name, reason in results[(student.id, lesson)]["reasons"].items():
            assert reason in text, f"{page}: {name}'s reason is missing: {reason}"


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_grades_csv_has_a_row_per_student_and_a_column_per_lesson_and_cell(graded):
    root, built, results = graded
    rows = {row["student"]: row for row in _read_csv(root / "out" / "grades.csv")}
    assert set(rows) == {s.id for _, s in _students(built)}
    for (student, lesson), r in results.items():
        assert float(rows[student][lesson]) == r["score"]
        for name, (score, _) in r["cells"].items():
            assert float(rows[student][f"{lesson}:{name}"]) == score
    for student, row in rows.items():  # a lesson not submitted is empty, not 0
        for lesson in built:
            if (student, lesson) not in results:
                assert row[lesson] == ""


def test_no_grading_process_is_left_behind(graded):
    assert autograde.tagged_processes("") == []


def test_grading_again_gives_the_same_csv(graded):
    root, built, results = graded
    # grades.csv holds only the students graded in that run: compare the regraded students' rows
    # (and the header) of the full run's CSV with the regrade's CSV
    header, *rows = (root / "out" / "grades.csv").read_text().splitlines(keepends=True)
    before = header + "".join(row for row in rows if row.split(",", 1)[0] in REGRADE)
    again = autograde.grade(root / "submitted", lessons=["00_collectives"], students=REGRADE,
                            course_dir=root / "course", out=root / "out", jobs=JOBS, echo=print, **OPTIONS)
    assert again, "no example student to grade again"
    for key, r in again.items():
        assert (r["score"], r["cells"]) == (results[key]["score"], results[key]["cells"]), key
    assert (root / "out" / "grades.csv").read_text() == before
    assert autograde.tagged_processes("") == []


def test_find_submissions_says_why_it_skips_a_folder(tmp_path):
    """No grading: a misnamed lesson folder or notebook is reported, not silently dropped."""
    lesson = autograde.lesson_ids()[0]
    for path in (f"ok/{lesson}/{lesson}.ipynb", f"typo/03-zero1/{lesson}.ipynb", f"renamed/{lesson}/mine.ipynb"):
        (tmp_path / path).parent.mkdir(parents=True)
        (tmp_path / path).write_text("{}")
    (tmp_path / "notes.txt").write_text("")
    said = []
    assert autograde.find_submissions(tmp_path, echo=said.append) == [("ok", lesson)]
    assert len(said) == 3, said
    assert any("03-zero1 is not a lesson; lessons are " in line for line in said), said
    assert any(f"no {lesson}.ipynb" in line and "mine.ipynb" in line for line in said), said
    assert any("notes.txt" in line for line in said), said
    assert autograde.find_submissions(tmp_path, students=["nobody"], echo=said.append) == []
