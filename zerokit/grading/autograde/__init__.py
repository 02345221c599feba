"""Grade a folder of submissions with nbgrader: scores, feedback HTML, grades.csv.

    python -m zerokit.grading.autograde SUBMISSIONS [--lesson ID] [--course-dir DIR] [--out DIR]

SUBMISSIONS is nbgrader's own layout, SUBMISSIONS/<student>/<lesson>/<lesson>.ipynb; the
lessons are the assignments of solutions/ (zerokit.grading.lessons.lesson_ids).

1. The course folder (default: the repository root, where .gitignore and `make clean`
   expect gradebook.db, release/, autograded/) gets a gradebook entry for every lesson with
   submissions: nbgrader's generate_assignment from solutions/ into the scratch release/
   (lessons/ is never touched). The checksums of the test cells come from here.
2. Each (student, lesson) is autograded by nbgrader, then gets its feedback HTML, in a
   process of its own forked from this one (nbgrader is imported once), --jobs at a time.
   Every process grading starts (the kernel, zerokit's fork server and ranks) carries a
   tag in its environment; when the notebook is done, any tagged process still alive is
   killed, so a hanging or crashing submission leaves nothing behind.
3. grades.csv: one row per student graded in this run, a column per lesson total and one per
   graded cell (`lesson:grade_id`). A line per notebook goes to stdout as it finishes, with
   the one-line reason of every test cell that lost points.

Two preprocessors replace nbgrader's own:
- GradingExecute (for Execute): a short timeout for the student's own cells (an endless
  loop is interrupted and grading goes on), the full one for test cells (whose checks
  have their own, shorter ones; --check-timeout caps those); a kernel that dies (os._exit,
  a crash, over the memory limit) costs only the cells from there on, marked "not run";
  and the one-line reason of every failed test cell goes first in its output, where the
  feedback puts it in front of the student.
- RestoreCells (for OverwriteCells): nbgrader puts edited test cells back from the
  gradebook (checksums); this also puts deleted ones back, and says so in the feedback.
The feedback HTML leaves out the hidden tests' code (their outcome and reason stay; a
test cell's error shows its message, not IPython's traceback, which would quote them).

A submission nbgrader cannot grade at all (an unreadable file, a grader that outlived
--notebook-timeout) scores 0, with the reason on a feedback page of its own, so stale
grades from an earlier run never survive a regrade.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.converters import GenerateAssignment

from ..lessons import ROOT, SOLUTIONS, lesson_ids, nbgrader_env
from .course import course_config, run_app
from .execute import GradingExecute
from .job import Job
from .processes import TAG, kill_tagged, tagged_processes  # TAG and tagged_processes: part of the API
from .reasons import failure_reason, reasons_from_notebook
from .restore import RestoreCells
from .submissions import find_submissions

__all__ = ["grade", "find_submissions", "write_grades_csv", "failure_reason", "GradingExecute", "RestoreCells",
           "main"]

LOGS = ".logs"  # under the autograded folder: nbgrader's log of each student/lesson


# ---------------------------------------------------------------------------------------
# the driver


def default_jobs():
    # Most of a grader's time is waiting (kernel start, rendezvous, timeouts), not computing:
    # on 2 cores, 4 at a time graded the example submissions in 2/3 of the time 2 took.
    return max(4, (os.cpu_count() or 2) // 2)


def grade(submissions, lessons=None, students=None, course_dir=ROOT, out=None, jobs=None, cell_timeout=None,
          test_timeout=None, check_timeout=None, notebook_timeout=1800, memory_limit_gb=None, echo=print):
    """Autograde every (student, lesson) under `submissions`; write feedback and grades.csv.

    Returns {(student, lesson): {"score", "max_score", "cells": {grade_id: (score, max)},
    "reasons": {grade_id: one line}, "seconds", "strays": [killed process], "error": text or None}}.
    """
    submissions = Path(submissions).resolve()
    course_dir = Path(course_dir).resolve()
    out = Path(out).resolve() if out else course_dir
    if not submissions.is_dir():
        raise SystemExit(f"{submissions} is not a folder of submissions (<student>/<lesson>/<lesson>.ipynb)")
    # nbgrader's Gradebook runs `alembic` by name, here and in the graders
    os.environ["PATH"] = nbgrader_env()["PATH"]
    todo = find_submissions(submissions, lessons, students, echo)
    if not todo:
        raise SystemExit(f"nothing to grade in {submissions}: expected <student>/<lesson>/<lesson>.ipynb"
                         + (" for the --student/--lesson given" if students or lessons else "")
                         + f"; lessons are {', '.join(lesson_ids())}")
    options = {"cell_timeout": cell_timeout, "test_timeout": test_timeout, "memory_limit_gb": memory_limit_gb}
    graded_lessons = sorted({lesson for _, lesson in todo})
    course_dir.mkdir(parents=True, exist_ok=True)
    cfg = course_config(course_dir, submissions, out, options)
    for lesson in graded_lessons:
        ok, log = run_app(GenerateAssignment, cfg, lesson, force=True, create_assignment=True)
        if not ok:
            raise SystemExit(f"nbgrader generate_assignment {lesson} failed:\n{log}")
    with Gradebook(cfg.CourseDirectory.db_url, cfg.CourseDirectory.course_id) as gb:
        for student in sorted({s for s, _ in todo}):  # now: two graders creating one student collide
            gb.update_or_create_student(student)

    jobs = jobs or default_jobs()
    run_id = uuid.uuid4().hex[:12]
    logs = course_dir / "autograded" / LOGS
    pending = [Job(student, lesson,
                    {"course_dir": str(course_dir), "submissions": str(submissions), "out": str(out),
                     "options": options, "student": student, "lesson": lesson,
                     "result": str(logs / student / f"{lesson}.json")},
                    logs / student / f"{lesson}.log", f"{run_id}/{student}/{lesson}")
               for student, lesson in todo]
    echo(f"grading {len(todo)} notebook(s) of {len({s for s, _ in todo})} student(s), lessons "
         f"{', '.join(graded_lessons) or '(none)'}; {jobs} at a time")
    results, running = {}, []
    try:
        while pending or running:
            while pending and len(running) < jobs:
                running.append(pending.pop(0))
                running[-1].start(check_timeout)
            time.sleep(0.1)
            for job in list(running):
                overdue = time.monotonic() - job.started > notebook_timeout
                if job.running() and not overdue:
                    continue
                running.remove(job)
                error = None
                if job.running():
                    error = f"grading this notebook took longer than {notebook_timeout:g} s and was stopped"
                job.kill()
                strays = kill_tagged(job.tag)
                r = results[(job.student, job.lesson)] = _finish(cfg, job, error, strays)
                _report(echo, len(results), len(todo), job, r)
    finally:
        for job in running:
            job.kill()
        leftover = kill_tagged(run_id)
        if leftover:
            echo(f"killed {len(leftover)} leftover grading process(es)")
    csv_path = write_grades_csv(cfg, out / "grades.csv", {s for s, _ in todo})
    echo(f"wrote {csv_path} and feedback in {out / 'feedback'}")
    return results


def _finish(cfg, job, error, strays):
    """Scores and reasons of one graded notebook; a zero and a feedback page if nbgrader failed."""
    seconds = time.monotonic() - job.started
    try:
        result = json.loads(Path(job.spec["result"]).read_text())
    except (OSError, ValueError):
        result = {}
    if error is None and not result.get("autograde"):
        error = "nbgrader could not grade this submission: " + _nbgrader_error(job.log_path)
    reasons = {}
    if error is None:
        autograded = Path(cfg.CourseDirectory.autograded_directory) / job.student / job.lesson / f"{job.lesson}.ipynb"
        reasons = reasons_from_notebook(autograded)
        if not result.get("feedback"):
            reasons["(feedback)"] = f"the feedback HTML could not be generated: see {job.log_path}"
    with Gradebook(cfg.CourseDirectory.db_url, cfg.CourseDirectory.course_id) as gb:
        sub = gb.update_or_create_submission(job.lesson, job.student)
        if error is not None:  # also wipes the grades of an earlier run
            for nb in sub.notebooks:
                for g in nb.grades:
                    g.auto_score, g.manual_score, g.needs_manual_grade = 0, None, False
            gb.db.commit()
        cells = {g.name: (g.score, g.max_score) for nb in sub.notebooks for g in nb.grades}
        score, max_score = sub.score, sub.max_score
    if error is not None:
        reasons = {name: error for name in cells}
        _fallback_feedback(cfg, job.student, job.lesson, error)
    return {"score": score, "max_score": max_score, "cells": cells, "reasons": reasons, "seconds": seconds,
            "strays": strays, "error": error}


_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.+)$")


def _nbgrader_error(log_path):
    """The innermost exception in nbgrader's log, e.g. NotJSONError for a file that is not a notebook."""
    text = Path(log_path).read_text(errors="replace") if Path(log_path).exists() else ""
    found = [m for m in map(_EXCEPTION_LINE.match, text.splitlines())
             if m and not m.group(1).endswith("NbGraderException")]
    if not found:
        return f"see {log_path}"
    name, message = found[-1].groups()  # nbgrader logs the cause chain outermost last
    if name.endswith("NotJSONError"):
        return "the file is not a notebook (not valid JSON): open it in JupyterLab, save it, and submit again"
    return f"{name.rsplit('.', 1)[-1]}: {message[:300]}"


def _fallback_feedback(cfg, student, lesson, error):
    path = Path(cfg.CourseDirectory.feedback_directory) / student / lesson / f"{lesson}.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>"
        f"{html.escape(lesson)}: feedback</title></head><body>\n"
        f"<h1>{html.escape(lesson)}: 0 points</h1>\n"
        f"<p style='color:#b00020;font-weight:bold'>{html.escape(error)}</p>\n"
        "<p>Nothing in this notebook could be graded. Check that the file opens in JupyterLab "
        "and runs from top to bottom, then submit it again.</p>\n</body></html>\n")


def _report(echo, done, total, job, r):
    score = "?" if r["score"] is None else f"{r['score']:g}"
    line = (f"[{done:>{len(str(total))}}/{total}] {job.student} / {job.lesson}: {score} of {r['max_score']:g} "
            f"points ({r['seconds']:.0f} s)")
    if r["strays"]:
        line += f"; killed {len(r['strays'])} leftover process(es): {', '.join(r['strays'])}"
    echo(line)
    for name, (s, m) in r["cells"].items():
        if (s or 0) < m:
            echo(f"    {name} {s or 0:g}/{m:g}: {r['reasons'].get(name, '(no reason recorded)')}")
    if "(feedback)" in r["reasons"]:
        echo(f"    {r['reasons']['(feedback)']}")


# ---------------------------------------------------------------------------------------
# grades.csv


def _cell_order(lesson):
    """grade_ids of a lesson's graded cells in notebook order (solutions/)."""
    nb = json.loads((SOLUTIONS / lesson / f"{lesson}.ipynb").read_text())
    return [c["metadata"]["nbgrader"]["grade_id"] for c in nb["cells"]
            if c.get("metadata", {}).get("nbgrader", {}).get("grade")]


def _fmt(score):
    return "" if score is None else f"{float(score):g}"


def write_grades_csv(cfg, path, students):
    """One row per student in `students`, one column per lesson total and per graded cell
    (`lesson:grade_id`).

    Only this run's students get a row: the gradebook also holds every student of earlier
    runs (the examples of tests/submissions, a class from last term), who do not belong in
    this grading's CSV. A row still shows every lesson of that student in the gradebook.
    A lesson a student did not submit is left empty, not 0.
    """
    with Gradebook(cfg.CourseDirectory.db_url, cfg.CourseDirectory.course_id) as gb:
        header, rows = ["student"], []
        assignments = sorted(gb.assignments, key=lambda a: a.name)
        for a in assignments:
            order = _cell_order(a.name) if (SOLUTIONS / a.name).is_dir() else []
            names = sorted((gc.name for nb in a.notebooks for gc in nb.grade_cells),
                           key=lambda n: (order.index(n) if n in order else len(order), n))
            header += [a.name] + [f"{a.name}:{n}" for n in names]
        for student in sorted(students):
            row = {"student": student}
            for a in assignments:
                try:
                    sub = gb.find_submission(a.name, student)
                except MissingEntry:
                    continue
                row[a.name] = _fmt(sub.score)
                row.update({f"{a.name}:{g.name}": _fmt(g.score) for nb in sub.notebooks for g in nb.grades})
            rows.append(row)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return path


# ---------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m zerokit.grading.autograde", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", help="folder of <student>/<lesson>/<lesson>.ipynb")
    parser.add_argument("--lesson", action="append", help="grade only this lesson (repeatable)")
    parser.add_argument("--student", action="append", help="grade only this student (repeatable)")
    parser.add_argument("--course-dir", default=str(ROOT),
                        help="nbgrader's working folder: gradebook.db, release/, autograded/ (default: the repository)")
    parser.add_argument("--out", help="where grades.csv and feedback/ go (default: the course folder)")
    parser.add_argument("--jobs", type=int, help="notebooks graded at the same time (default: half the cores, "
                        "at least 4)")
    parser.add_argument("--cell-timeout", type=int, help="seconds for a cell that is not a test cell (default 60)")
    parser.add_argument("--test-timeout", type=int,
                        help="seconds for a test cell (default: Execute.timeout in nbgrader_config.py)")
    parser.add_argument("--check-timeout", type=float,
                        help="cap on each multi-rank check's own timeout, in seconds (default: the check's, 60)")
    parser.add_argument("--notebook-timeout", type=float, default=1800, help="seconds for a whole notebook")
    parser.add_argument("--memory-limit-gb", type=float, help="resident memory (GiB) of a notebook's kernel "
                        "(default 4)")
    args = parser.parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C does, so grade() stops its graders on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    grade(args.submissions, lessons=args.lesson, students=args.student, course_dir=args.course_dir, out=args.out,
          jobs=args.jobs, cell_timeout=args.cell_timeout, test_timeout=args.test_timeout,
          check_timeout=args.check_timeout, notebook_timeout=args.notebook_timeout,
          memory_limit_gb=args.memory_limit_gb, echo=lambda line: print(line, flush=True))
    # a submission that could not be graded is a result (0 points and its reason), not a failure
    return 0
