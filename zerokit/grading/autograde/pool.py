"""grade(): the driver. Set up the course, grade every notebook in a pool of forked graders,
--jobs at a time, collect each outcome, and write grades.csv.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from nbgrader.api import Gradebook
from nbgrader.converters import GenerateAssignment

from ..lessons import ROOT, lesson_ids, nbgrader_env
from .course import course_config, run_app
from .grades_csv import write_grades_csv
from .job import Job
from .outcome import finish
from .processes import kill_tagged
from .report import report
from .submissions import find_submissions

LOGS = ".logs"  # under the autograded folder: nbgrader's log of each student/lesson


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
                r = results[(job.student, job.lesson)] = finish(cfg, job, error, strays)
                report(echo, len(results), len(todo), job, r)
    finally:
        for job in running:
            job.kill()
        leftover = kill_tagged(run_id)
        if leftover:
            echo(f"killed {len(leftover)} leftover grading process(es)")
    csv_path = write_grades_csv(cfg, out / "grades.csv", {s for s, _ in todo})
    echo(f"wrote {csv_path} and feedback in {out / 'feedback'}")
    return results
