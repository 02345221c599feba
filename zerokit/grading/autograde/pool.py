"""grade(): the driver. Set up the course, grade every notebook in a pool of forked graders,
--jobs at a time, collect each outcome, and write grades.csv.

Around every notebook the grader's own files are verified (integrity.py). A change found
means some notebook graded at that time wrote them: they are put back, and each of the
notebooks being graded then is graded again alone, so that the one that did it is known
(it scores 0, "modified the grader's files") and the others get their own grades.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from nbgrader.api import Gradebook
from nbgrader.converters import GenerateAssignment

from ...widgets import progress
from ..harness import MEMORY_ENV, TIMEOUT_ENV
from ..lessons import LESSONS, ROOT, SOLUTIONS, lesson_ids, nbgrader_env, release_drift
from . import sandbox
from .course import course_config, run_app, write_course_config
from .feedback import warm_up
from .grades_csv import write_grades_csv
from .integrity import Baseline
from .job import Job
from .outcome import finish
from .processes import kill_descendants, kill_tagged, set_subreaper
from .report import report
from .submissions import find_submissions

LOGS = ".logs"  # under the autograded folder: nbgrader's log of each student/lesson


def default_jobs():
    # Most of a grader's time is waiting (kernel start, rendezvous, timeouts), not computing:
    # on 2 cores, 4 at a time graded the example submissions in 2/3 of the time 2 took.
    return max(4, (os.cpu_count() or 2) // 2)


def isolation(use_sandbox):
    """The line `make grade` prints about how submissions are kept apart; SystemExit if the sandbox
    was asked for (the default) and cannot be had."""
    if not use_sandbox:
        return ("isolation: none (--no-sandbox, chosen): submissions run with your permissions and can read "
                "solutions/ and write your files; only the integrity check of the grader's files and the "
                "process sweep (subreaper) protect the grades")
    try:
        version = sandbox.probe()
    except sandbox.SandboxUnavailable as exc:
        raise SystemExit(str(exc)) from None
    return (f"isolation: bubblewrap ({version}): each kernel sees the course read-only and nothing else, no "
            "network, its own PID namespace; plus the integrity check of the grader's files and a subreaper")


def grade(submissions, lessons=None, students=None, course_dir=ROOT, out=None, jobs=None, cell_timeout=None,
          test_timeout=None, check_timeout=None, check_memory_limit_gb=None, notebook_timeout=1800,
          memory_limit_gb=None, echo=print, sandbox=True, settings=(), solutions=SOLUTIONS, released=LESSONS):
    """Autograde every (student, lesson) under `submissions`; write feedback and grades.csv.

    check_timeout, check_memory_limit_gb: caps on every multi-rank check's own timeout and memory
    limit per rank (defaults 60 s and 4 GiB), so that a hang or a runaway rank costs less.
    sandbox: run each kernel behind bubblewrap (False: --no-sandbox, an explicit choice).
    settings: (Class, trait, value) for nbgrader's config, as its `--Class.trait=value`.
    solutions, released: nbgrader's source notebooks, and what students received (the
    repository's solutions/ and lessons/); grading stops if the two have drifted apart.

    Returns {(student, lesson): {"score", "max_score", "cells": {grade_id: (score, max)},
    "reasons": {grade_id: one line}, "seconds", "strays": [killed process], "error": text or None,
    "late": {"raw", "penalty", "seconds_late"} or None}}.
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
    walled = isolation(sandbox)
    check_caps = {name: str(value) for name, value in ((TIMEOUT_ENV, check_timeout),
                                                       (MEMORY_ENV, check_memory_limit_gb)) if value is not None}
    options = {"cell_timeout": cell_timeout, "test_timeout": test_timeout, "memory_limit_gb": memory_limit_gb,
               "sandbox": bool(sandbox)}
    graded_lessons = sorted({lesson for _, lesson in todo})
    course_dir.mkdir(parents=True, exist_ok=True)
    cfg = course_config(course_dir, submissions, out, options, settings, solutions, released)
    written = write_course_config(course_dir, submissions, out, options, settings, solutions, released)
    for lesson in graded_lessons:
        ok, log = run_app(GenerateAssignment, cfg, lesson, force=True, create_assignment=True)
        if not ok:
            raise SystemExit(f"nbgrader generate_assignment {lesson} failed:\n{log}")
        drift = release_drift(Path(cfg.CourseDirectory.release_directory), lesson, released)
        if drift:
            raise SystemExit(_drift_message(lesson, drift))
    with Gradebook(cfg.CourseDirectory.db_url, cfg.CourseDirectory.course_id) as gb:
        for student in sorted({s for s, _ in todo}):  # now: two graders creating one student collide
            gb.update_or_create_student(student)

    jobs = jobs or default_jobs()
    run_id = uuid.uuid4().hex[:12]
    logs = course_dir / "autograded" / LOGS
    pending = [Job(student, lesson,
                   {"course_dir": str(course_dir), "submissions": str(submissions), "out": str(out),
                    "options": options, "settings": list(settings), "student": student, "lesson": lesson,
                    "result": str(logs / student / f"{lesson}.json")},
                   logs / student / f"{lesson}.log", f"{run_id}/{student}/{lesson}")
               for student, lesson in todo]
    release = Path(cfg.CourseDirectory.release_directory)
    warm_up(release / graded_lessons[0] / f"{graded_lessons[0]}.ipynb")  # once here, not in every grader
    baseline = Baseline.course()
    echo(walled)
    echo(f"grader's files verified around every notebook: {baseline.fingerprint()}")
    if written:
        echo(f"nbgrader's own commands work in {course_dir} (wrote {written.name} there)")
    echo(f"grading {len(todo)} notebook(s) of {len({s for s, _ in todo})} student(s), lessons "
         f"{', '.join(graded_lessons) or '(none)'}; {jobs} at a time")
    bar = progress(total=len(todo), desc="grading")  # the lines below print above it, not through it
    if echo is print and not bar.disable:
        echo = bar.write
    scratch_root = tempfile.mkdtemp(prefix="zerokit-grading-run-")  # each grader's temporary files, below
    was_subreaper = set_subreaper()  # a grader killed mid-notebook leaves its orphans to us
    elders = {p.pid for p in psutil.Process().children()}  # this process's own children from before: not ours to kill
    results, running, alone = {}, [], []
    try:
        while pending or running or alone:
            _start_more(pending, running, alone, jobs, check_caps, baseline, echo, scratch_root)
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
                if error is None and job.killed_by():
                    error = (f"the process grading this notebook was killed ({job.killed_by()}) by the notebook's "
                             "code; nothing it computed can be trusted")
                strays = kill_tagged(job.tag)
                strays += kill_descendants(keep={j.pid for j in running} | elders)
                job.cleanup()
                changed = baseline.changes()
                if changed and job.overlapped:  # who did it? each suspect again, alone
                    _regrade_alone([job] + running, alone, echo, changed)
                    running.clear()
                    kill_descendants(keep=elders)  # their kernels too, before putting the files back
                    baseline.restore()
                    break  # the others in this sweep were among the suspects
                if changed:
                    baseline.restore()
                    error = "modified the grader's files (put back): " + ", ".join(changed)
                r = results[(job.student, job.lesson)] = finish(cfg, job, error, strays)
                report(echo, len(results), len(todo), job, r)
                bar.update()
    finally:
        bar.close()
        for job in running:
            job.kill()
        leftover = kill_tagged(run_id) + kill_descendants(keep=elders)
        if leftover:
            echo(f"killed {len(leftover)} leftover grading process(es)")
        if not was_subreaper:
            set_subreaper(False)
        shutil.rmtree(scratch_root, ignore_errors=True)
        changed = baseline.changes()
        if changed:  # e.g. interrupted while a suspect was running
            baseline.restore()
            echo(f"put back the grader's files a notebook changed: {', '.join(changed)}")
    csv_path = write_grades_csv(cfg, out / "grades.csv")
    echo(f"wrote {csv_path} (every student and lesson in the gradebook) and feedback in {out / 'feedback'}")
    return results


def _start_more(pending, running, alone, jobs, check_caps, baseline, echo, scratch_root):
    """Start graders while there is room; a suspect runs only with nothing else running."""
    if any(job.alone for job in running):
        return
    if alone:
        if not running:
            job = alone.pop(0)
            job.alone = True
            running.append(job)
            job.start(check_caps, scratch_root)
        return
    while pending and len(running) < jobs:
        changed = baseline.changes()  # before each notebook too: a running one may have changed them
        if changed and running:
            return  # the next grader to finish sees the same change and deals with it
        if changed:  # nothing of ours is running: not a notebook's doing (someone edited them?)
            baseline.restore()
            echo(f"the grader's files changed while no notebook was being graded: put back {', '.join(changed)}")
        job = pending.pop(0)
        if running:
            job.overlapped = True
            for other in running:
                other.overlapped = True
        running.append(job)
        job.start(check_caps, scratch_root)


def _regrade_alone(suspects, alone, echo, changed):
    for job in suspects:
        job.kill()
        kill_tagged(job.tag)
        job.cleanup()
        job.reset()
        alone.append(job)
    echo(f"the grader's files were changed ({', '.join(changed)}) while {len(suspects)} notebook(s) were being "
         f"graded: put back; grading each of them again, alone: "
         + ", ".join(f"{j.student}/{j.lesson}" for j in suspects))


def _drift_message(lesson, drift):
    return (f"lessons/{lesson} (what students received) differs from what solutions/{lesson} generates now:\n"
            f"{drift}\n"
            f"Grading now would tell every student that they edited these cells. Either:\n"
            f"  - students got lessons/{lesson} as committed: undo the change to the visible cells in solutions/"
            f"{lesson} (hidden tests may change after a release, what students see may not), or\n"
            f"  - students got the new version (you released it again): run `make lessons` so that lessons/ "
            f"records what they received, then grade.")
