"""The instructor's grading flow, end to end, on the example submissions of tests/submissions.

Every example student of every lesson (tests/submissions/lessonNN.py: a correct one, the
untouched notebook, one defect each, and lesson 00's hostile ones) is written into a
temporary folder in nbgrader's layout and graded once with real nbgrader, kernels and ranks,
behind bubblewrap, as `make grade` does. The same run is then read from every side:
- each test cell's score is the one the student's module expects, a failed cell's one-line
  reason names the problem, every student gets feedback HTML carrying those reasons;
- the hostile submissions' attempts (writes into zerokit, solutions/ and lessons/, reading
  the hidden tests, a detached process, connections out, killing the grader) all failed,
  nothing of theirs outlived grading, and the checkout is byte for byte what it was;
- a late submission scores what nbgrader's penalty leaves, in grades.csv, on the console,
  and in `nbgrader export` run in the course folder (the config written there works);
- nbgrader's own commands (generate_feedback, release_feedback, autograde) in the course
  folder behave as `make grade`: no hidden test in any feedback page, the course's execution;
- grades.csv is the whole gradebook, hand-entered scores included, and grading some of the
  same submissions again rewrites it byte for byte the same.
"""

import csv
import html
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import nbformat
import psutil
import pytest

from conftest import checkout_state, chromium, nbgrader
from tests import submissions
from tests.submissions import hostile, lesson00
from zerokit.grading import autograde
from zerokit.grading.autograde.integrity import Baseline

# the first test pays for grading every example (the module fixture): minutes, not seconds
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
# Four graders at a time, on 2 cores too: most of a notebook's time is waiting (kernel start,
# rendezvous, timeouts). Measured on 2 cores: 4 min 16 s with 4, 6 min 3 s with 2, same CPU.
JOBS = 4
# Shorter than `make grade`'s defaults (check 60 s and 4 GiB a rank, cell 60 s, kernel 4 GiB), so
# that the deadlock, the endless cell and the memory hogs cost less time; the flow is the same.
# A rank of a correct check peaks near 0.3 GiB. The rank cap matters under load: at 4 GiB the
# runaway rank page-faults ~12 CPU-seconds (measured, 2 cores) and a CI run at load 10 timed
# out at 30 s before reaching it; 1 GiB costs it ~2 CPU-seconds.
OPTIONS = {"check_timeout": 30, "check_memory_limit_gb": 1.0, "cell_timeout": 40, "memory_limit_gb": 2.0}
# The course's late policy in this run (nbgrader's default takes nothing off).
LATE_POLICY = [("LateSubmissionPlugin", "penalty_method", "zero")]
# Graded a second time (lesson 00): failure modes whose grades zerokit writes (corrupt
# file, dead kernel), a restored test cell, and the plain untouched notebook.
REGRADE = ("corrupt_file", "kernel_memory", "deleted_test_cell", "untouched")
HOSTILE = ("hostile_writes", "hostile_processes")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("grading")
    built = submissions.build(root / "submitted")
    # a listener on the grader's loopback: the hostile notebook tries to reach it
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    (root / "submitted" / "hostile_processes" / "00_collectives" / hostile.LISTENER_FILE).write_text(
        str(listener.getsockname()[1]))
    course = root / "course"
    course.mkdir()
    due = nbgrader("db", "assignment", "add", "00_collectives", f"--duedate={lesson00.DUE_DATE}",
                   f"--CourseDirectory.root={course}", "--CourseDirectory.course_id=zero-from-scratch", cwd=course)
    assert due.returncode == 0, due.stderr
    Baseline.course()  # compiled as grade() compiles it, so that `before` and `after` compare like with like
    before = checkout_state()
    lines = []
    t0 = time.monotonic()
    results = autograde.grade(root / "submitted", course_dir=course, out=root / "out", jobs=JOBS,
                              echo=lambda line: (print(line), lines.append(line)), settings=LATE_POLICY, **OPTIONS)
    seconds = time.monotonic() - t0
    print(f"graded {len(results)} notebooks in {seconds:.0f} s")
    accepted = 0
    while True:
        try:
            listener.accept()[0].close()
            accepted += 1
        except BlockingIOError:
            break
    listener.close()
    return SimpleNamespace(root=root, course=course, out=root / "out", built=built, results=results, lines=lines,
                           before=before, accepted=accepted)


def _students(built):
    return [(lesson, s) for lesson, students in built.items() for s in students]


def test_every_lesson_with_examples_was_graded(graded):
    assert set(graded.built) == set(submissions.lesson_modules())
    assert {(s.id, lesson) for lesson, s in _students(graded.built)} == set(graded.results)
    assert any(line.startswith("isolation: bubblewrap") for line in graded.lines), graded.lines[:5]


def test_each_student_gets_exactly_the_expected_points(graded):
    rows, wrong = [], []
    for lesson, student in _students(graded.built):
        r = graded.results[(student.id, lesson)]
        given = {name: score for name, (score, _) in r["cells"].items()}
        rows.append(f"{lesson:<20} {student.id:<24} expected {sum(student.expected.values()):>4g}  "
                    f"given {sum(given.values()):>4g} of {r['max_score']:g}  ({student.defect})")
        if set(student.expected) != set(given):
            wrong.append(f"{lesson}/{student.id}: expects cells {sorted(student.expected)}, graded {sorted(given)}")
        for name, points in student.expected.items():
            if name in given and given[name] != points:
                wrong.append(f"{lesson}/{student.id}: {name} expected {points:g}, given {given[name]:g}: "
                             f"{r['reasons'].get(name, '(no reason)')}")
    print("\n".join(rows))
    assert not wrong, "\n".join(wrong)


def test_every_lost_point_comes_with_a_one_line_reason(graded):
    wrong = []
    for lesson, student in _students(graded.built):
        r = graded.results[(student.id, lesson)]
        for name, (score, max_score) in r["cells"].items():
            if score >= max_score:
                continue
            reason = r["reasons"].get(name, "")
            if not reason or "\n" in reason:
                wrong.append(f"{lesson}/{student.id}/{name}: no one-line reason: {reason!r}")
            elif student.reason_for(name) not in reason:
                wrong.append(f"{lesson}/{student.id}/{name}: reason {reason!r} lacks {student.reason_for(name)!r}")
    assert not wrong, "\n".join(wrong)


def test_feedback_html_for_every_student_shows_the_reasons_not_the_hidden_tests(graded):
    for lesson, student in _students(graded.built):
        page = graded.out / "feedback" / student.id / lesson / f"{lesson}.html"
        assert page.exists(), page
        text = html.unescape(page.read_text())
        assert "HIDDEN TESTS" not in text, f"{page} shows the hidden tests' code"
        for name, reason in graded.results[(student.id, lesson)]["reasons"].items():
            assert reason in text, f"{page}: {name}'s reason is missing: {reason}"



@pytest.mark.browser
@pytest.mark.timeout(120)
def test_feedback_html_reads_right_offline_its_formulas_typeset_without_mathjax(graded):
    """Opened in Chromium with every request but the file itself refused (no CDN, no MathJax):
    the formulas show as typeset math, not as TeX."""
    lesson, student = next((lesson, s) for lesson, s in _students(graded.built) if lesson == "03_zero1")
    page_path = graded.out / "feedback" / student.id / lesson / f"{lesson}.html"
    refused = []

    def offline(route):
        if route.request.url.startswith("file:"):
            return route.continue_()
        refused.append(route.request.url)
        return route.abort()

    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.route("**/*", offline)
        page.goto(page_path.as_uri())
        text = page.inner_text("body")
        maths = page.locator("math")
        count = maths.count()
        boxes = [maths.nth(i).bounding_box() for i in range(min(count, 20))]
        artifacts = ROOT / "test-artifacts" / "browser"
        artifacts.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(artifacts / "feedback_offline.png"))
    assert any("mathjax" in url.lower() for url in refused), "the page no longer asks for MathJax: test the new setup"
    for tex in (r"\Psi", r"\lceil", r"\frac", "$$"):
        assert tex not in text, f"{page_path.name} shows raw TeX offline ({tex!r})"
    assert count > 20, f"only {count} <math> elements in {page_path.name}"
    assert all(b and b["width"] > 0 and b["height"] > 0 for b in boxes), boxes

# ---- the wall ------------------------------------------------------------------------------


def _hostile_lines(graded):
    """{'hostile write solutions/': 'failed (FileNotFoundError)', ...} printed by the hostile notebooks."""
    found = {}
    for student in HOSTILE:
        nb = nbformat.read(graded.course / "autograded" / student / "00_collectives" / "00_collectives.ipynb", 4)
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                for line in out.get("text", "").splitlines():
                    if line.startswith("hostile "):
                        what, _, outcome = line.partition(": ")
                        found[what] = outcome
    return found


def test_every_hostile_attempt_failed_behind_the_wall(graded):
    found = _hostile_lines(graded)
    attempts = {"hostile write zerokit/grading/compare.py", "hostile write solutions/", "hostile write lessons/",
                "hostile read solutions/", "hostile read other submissions", "hostile connect beyond this machine", "hostile connect the grader's loopback",
                "hostile kill parent", "hostile detached process"}
    assert set(found) == attempts, found
    assert found.pop("hostile detached process") == "started"
    assert all(outcome.startswith("failed") for outcome in found.values()), found
    assert graded.accepted == 0, "a notebook reached a listener on the grader's loopback"


def test_the_checkout_is_byte_for_byte_what_it_was(graded):
    files_before, status_before = graded.before
    files_after, status_after = checkout_state()
    changed = sorted(str(p) for p in set(files_before) | set(files_after) if files_before.get(p) != files_after.get(p))
    assert not changed, changed
    assert status_after == status_before


def test_no_grading_process_is_left_behind(graded):
    assert autograde.tagged_processes("") == []
    # the detached one cleared its environment (no tag): found by its command line
    survivors = [p.pid for p in psutil.process_iter(["cmdline"])
                 if hostile.DETACHED_MARKER in " ".join(p.info["cmdline"] or [])]
    assert survivors == []


# ---- grades as nbgrader computes them ----------------------------------------------------------


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_late_submission_scores_what_the_penalty_leaves(graded):
    r = graded.results[("late", "00_collectives")]
    full = sum(lesson00.FULL.values())  # the late student's notebook is correct: every point, then the penalty
    assert (r["score"], r["late"]["raw"], r["late"]["penalty"]) == (0, full, full)
    assert round(r["late"]["seconds_late"]) == 2 * 3600
    line = next(line for line in graded.lines if "] late / 00_collectives:" in line)
    assert f"0 of {full:g} points" in line and "late by 2.0 h" in line, line
    row = next(row for row in _read_csv(graded.out / "grades.csv") if row["student"] == "late")
    assert (row["00_collectives"], row["00_collectives:raw_score"], row["00_collectives:late_penalty"]) == \
        ("0", f"{full:g}", f"{full:g}")


def test_nbgrader_export_in_the_course_folder_agrees_with_grades_csv(graded):
    export = graded.root / "export.csv"
    done = nbgrader("export", f"--to={export}", cwd=graded.course)
    assert done.returncode == 0, done.stderr
    assert "is not absolute" not in done.stdout + done.stderr
    ours = {row["student"]: row for row in _read_csv(graded.out / "grades.csv")}
    theirs = _read_csv(export)
    assert {(r["student_id"], r["assignment"]) for r in theirs} >= set(graded.results)
    for r in theirs:
        if (r["student_id"], r["assignment"]) not in graded.results:
            continue  # nbgrader lists a lesson not submitted as 0; grades.csv leaves it empty
        row = ours[r["student_id"]]
        assert float(r["score"]) == float(row[r["assignment"]]), r
        assert float(r["raw_score"]) == float(row[f"{r['assignment']}:raw_score"]), r
        assert float(r["late_submission_penalty"]) == float(row[f"{r['assignment']}:late_penalty"]), r


def test_grades_csv_has_a_row_per_student_and_a_column_per_lesson_and_cell(graded):
    rows = {row["student"]: row for row in _read_csv(graded.out / "grades.csv")}
    assert set(rows) == {s.id for _, s in _students(graded.built)}
    for (student, lesson), r in graded.results.items():
        assert float(rows[student][lesson]) == r["score"]
        for name, (score, _) in r["cells"].items():
            assert float(rows[student][f"{lesson}:{name}"]) == score
    for student, row in rows.items():  # a lesson not submitted is empty, not 0
        for lesson in graded.built:
            if (student, lesson) not in graded.results:
                assert row[lesson] == ""


# ---- nbgrader's own commands, in the course folder ------------------------------------------


def _hidden_test_lines(lesson):
    """Every line of the hidden tests of `lesson` (solutions/), markers left out, that could only
    come from there: not a line students see in lessons/ too, nor one as short as `})`. Nor the
    text of a `questions.explain(...)`: the explanation of the answers, which the hidden tests
    print so that the feedback shows it (zerokit.grading.questions), is meant to be seen there."""
    nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
    released = json.loads((ROOT / "lessons" / lesson / f"{lesson}.ipynb").read_text())
    visible = {line.strip() for cell in released["cells"] for line in "".join(cell["source"]).splitlines()}
    lines = []
    for cell in nb["cells"]:
        inside = explaining = False
        for line in "".join(cell["source"]).splitlines():
            if "BEGIN HIDDEN TESTS" in line:
                inside = True
            elif "END HIDDEN TESTS" in line:
                inside = False
            elif explaining:
                explaining = not line.strip().startswith('""")')
            elif inside and "questions.explain(" in line:
                explaining = not line.rstrip().endswith('""")')
            elif inside and len(line.strip()) >= 8 and line.strip() not in visible:
                lines.append(line.strip())
    assert lines, f"{lesson} has no hidden tests to look for"
    return lines


def test_nbgrader_generate_and_release_feedback_never_show_hidden_tests(graded):
    exchange = graded.root / "exchange"
    exchange.mkdir()
    for args in (("generate_feedback", "03_zero1", "--force"),
                 ("release_feedback", "03_zero1", f"--Exchange.root={exchange}"),
                 ("release_feedback", "00_collectives", f"--Exchange.root={exchange}")):
        done = nbgrader(*args, cwd=graded.course)
        assert done.returncode == 0, f"nbgrader {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        assert "is not absolute" not in done.stdout + done.stderr
    pages = list((graded.out / "feedback").rglob("*.html")) + list(exchange.rglob("*.html"))
    released = list(exchange.rglob("*.html"))
    assert len(released) == len(graded.built["03_zero1"]) + len(graded.built["00_collectives"]), released
    hidden = {lesson: _hidden_test_lines(lesson) for lesson in graded.built}
    released_lessons = hidden["03_zero1"] + hidden["00_collectives"]  # the exchange names its pages by hash
    for page in pages:  # each page against its own lesson's hidden tests
        text = html.unescape(page.read_text())
        shown = [line for line in hidden.get(page.stem, released_lessons) if line in text]
        assert not shown, f"{page} shows hidden test lines: {shown[:3]}"


def test_nbgrader_autograde_in_the_course_folder_grades_as_make_grade_does(graded):
    done = nbgrader("autograde", "00_collectives", "--student=misnamed", "--force", cwd=graded.course)
    assert done.returncode == 0, done.stderr
    assert "is not absolute" not in done.stdout + done.stderr
    nb = nbformat.read(graded.course / "autograded" / "misnamed" / "00_collectives" / "00_collectives.ipynb", 4)
    reasons = autograde.reasons.reasons_from_notebook(
        graded.course / "autograded" / "misnamed" / "00_collectives" / "00_collectives.ipynb")
    assert reasons == graded.results[("misnamed", "00_collectives")]["reasons"], reasons
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


def test_the_formgrader_lists_a_corrupt_submission_as_autograded_with_its_reason(graded):
    from nbgrader.apps.api import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(graded.course)).load_config()
    api = NbGraderAPI(coursedir=CourseDirectory(config=cfg), config=cfg)
    assert "corrupt_file" in api.get_autograded_students("00_collectives")
    with api.gradebook as gb:
        sub = gb.find_submission("00_collectives", "corrupt_file")
        comments = {c.auto_comment for nb in sub.notebooks for c in nb.comments}
    assert len(comments) == 1 and "not a notebook" in comments.pop()


# ---- grades.csv: the whole gradebook ----------------------------------------------------------


def test_grading_again_gives_the_same_csv(graded):
    before = (graded.out / "grades.csv").read_text()
    again = autograde.grade(graded.root / "submitted", lessons=["00_collectives"], students=REGRADE,
                            course_dir=graded.course, out=graded.out, jobs=JOBS, echo=print, settings=LATE_POLICY,
                            **OPTIONS)
    assert again, "no example student to grade again"
    for key, r in again.items():
        assert (r["score"], r["cells"]) == (graded.results[key]["score"], graded.results[key]["cells"]), key
    # a --student/--lesson run rewrites the whole gradebook, not only its own rows
    assert (graded.out / "grades.csv").read_text() == before
    assert autograde.tagged_processes("") == []


def test_grades_csv_from_the_gradebook_keeps_hand_entered_scores(graded):
    from nbgrader.api import Gradebook

    db = f"sqlite:///{graded.course / 'gradebook.db'}"
    with Gradebook(db, "zero-from-scratch") as gb:  # what the formgrader does when a score is typed in
        grade = gb.find_grade("test_same_volume", "00_collectives", "00_collectives", "untouched")
        grade.manual_score = 1.5
        gb.db.commit()
    done = subprocess.run([sys.executable, "-m", "zerokit.grading.autograde", "--csv-only",
                           f"--course-dir={graded.course}", f"--out={graded.out}"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    row = next(r for r in _read_csv(graded.out / "grades.csv") if r["student"] == "untouched")
    assert (row["00_collectives:test_same_volume"], row["00_collectives"]) == ("1.5", "1.5")


# ---- refusing, and saying why ------------------------------------------------------------------


def test_grading_stops_when_solutions_drifted_from_what_students_received(tmp_path):
    solutions, released = tmp_path / "solutions", tmp_path / "lessons"
    shutil.copytree(ROOT / "solutions" / "00_collectives", solutions / "00_collectives")
    shutil.copytree(ROOT / "lessons" / "00_collectives", released / "00_collectives")
    path = solutions / "00_collectives" / "00_collectives.ipynb"
    text = path.read_text()
    visible = "lesson00.check_traffic(my_all_reduce, world_size=2, size=1001)"
    assert visible in text, "update this test: the visible test it edits is gone"
    path.write_text(text.replace(visible, visible.replace("size=1001", "size=1002"), 1))
    submissions.build(tmp_path / "submitted", ["00_collectives"])
    with pytest.raises(SystemExit) as stop:
        autograde.grade(tmp_path / "submitted", students=["correct"], course_dir=tmp_path / "course",
                        solutions=solutions, released=released, echo=print)
    message = str(stop.value)
    assert "differs from what solutions/00_collectives generates now" in message
    assert "size=1002" in message and "make lessons" in message
    assert not (tmp_path / "course" / "autograded" / "correct").exists()


def test_without_bubblewrap_grading_says_how_to_install_it_or_opt_out(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # bwrap cannot be found; nothing is graded
    submissions.build(tmp_path / "submitted", ["00_collectives"])
    with pytest.raises(SystemExit) as stop:
        autograde.grade(tmp_path / "submitted", students=["correct"], course_dir=tmp_path / "course", echo=print)
    message = str(stop.value)
    assert "apt-get install bubblewrap" in message and "--no-sandbox" in message, message


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
