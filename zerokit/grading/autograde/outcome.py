"""What one graded notebook comes to: its scores and reasons, or 0 and why.

A submission nbgrader cannot grade at all (an unreadable file, a grader that outlived
--notebook-timeout or was killed, a notebook that changed the grader's files) scores 0,
with the reason on a feedback page of its own and in the gradebook (each cell's comment), so
stale grades from an earlier run never survive a regrade. The formgrader lists it as
autograded: its autograded folder holds the released notebook headed by the reason.

The score is nbgrader's after late penalties (as `nbgrader export` computes it: raw score
minus the penalty, at least 0); the raw score and the penalty are kept beside it.
"""

from __future__ import annotations

import html
import json
import re
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook

from ..lessons import LESSONS
from .reasons import reasons_from_notebook


def finish(cfg, job, error, strays):
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
                for c in nb.comments:  # the formgrader shows these beside each cell
                    c.auto_comment = error
            gb.db.commit()
        cells = {g.name: (g.score, g.max_score) for nb in sub.notebooks for g in nb.grades}
        raw, penalty, max_score = sub.score, sub.late_submission_penalty or 0.0, sub.max_score
        seconds_late = sub.total_seconds_late
    if error is not None:
        reasons = {name: error for name in cells}
        _fallback_feedback(cfg, job.student, job.lesson, error)
        _placeholder_autograded(cfg, job.student, job.lesson, error)
    _feedback_receipt(cfg, job.student, job.lesson)
    late = {"raw": raw, "penalty": penalty, "seconds_late": seconds_late} if seconds_late > 0 else None
    return {"score": max(0.0, raw - penalty), "max_score": max_score, "cells": cells, "reasons": reasons,
            "seconds": seconds, "strays": strays, "error": error, "late": late}


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


def _placeholder_autograded(cfg, student, lesson, error):
    """The released notebook headed by the reason, where nbgrader would have put the graded one (if it
    did not): the formgrader lists a submission as autograded only when that folder exists."""
    path = Path(cfg.CourseDirectory.autograded_directory) / student / lesson / f"{lesson}.ipynb"
    if path.exists():
        return
    nb = nbformat.read(str(LESSONS / lesson / f"{lesson}.ipynb"), as_version=4)
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(f"**Not graded, 0 points: {error}**"))
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def _feedback_receipt(cfg, student, lesson):
    """timestamp.txt and submission_secret.txt beside the graded notebook and its feedback, which
    `nbgrader release_feedback` reads. nbgrader's exchange writes them at submission; a submission
    copied in by hand has none, and release_feedback would stop with FileNotFoundError. The
    timestamp is then the notebook's modification time, and the secret a fresh random one (it
    names the released file). In autograded/ too: nbgrader generate_feedback copies them from
    there, so they survive a regeneration of the feedback."""
    submitted = Path(cfg.CourseDirectory.submitted_directory) / student / lesson
    folders = [Path(cfg.CourseDirectory.autograded_directory) / student / lesson,
               Path(cfg.CourseDirectory.feedback_directory) / student / lesson]
    folders = [f for f in folders if f.is_dir()]
    found = {}  # what the exchange (or an earlier run) wrote wins
    for name in ("timestamp.txt", "submission_secret.txt"):
        for folder in [submitted, *folders]:
            if (folder / name).is_file():
                found[name] = (folder / name).read_text()
                break
    if "timestamp.txt" not in found:
        when = datetime.fromtimestamp((submitted / f"{lesson}.ipynb").stat().st_mtime, timezone.utc)
        found["timestamp.txt"] = when.strftime("%Y-%m-%d %H:%M:%S.%f %Z")
    found.setdefault("submission_secret.txt", secrets.token_hex(16))
    for folder in folders:
        for name, text in found.items():
            if not (folder / name).exists():
                (folder / name).write_text(text)
