"""The course folder nbgrader works in: its configuration, and running an nbgrader app there.

The course folder (default: the repository root, where .gitignore and `make clean` expect
gradebook.db, release/, autograded/) takes its settings from the repository's
nbgrader_config.py, with the folders of this grading run and our two preprocessors in place
of nbgrader's own (execute.py, restore.py). The feedback HTML leaves out the hidden tests'
code (their outcome and reason stay; a test cell's error shows its message, not IPython's
traceback, which would quote them).
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.converters import Autograde
from nbgrader.coursedir import CourseDirectory
from nbgrader.preprocessors import ClearHiddenTests, Execute, GetGrades, OverwriteCells
from traitlets.config.loader import PyFileConfigLoader

from ..lessons import ROOT, SOLUTIONS
from .execute import GradingExecute
from .restore import RestoreCells


def course_config(course_dir, submissions, out, options):
    """The repository's nbgrader_config.py, pointed at this course folder, with our preprocessors."""
    cfg = PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()
    course_dir = Path(course_dir).resolve()
    cd = cfg.CourseDirectory
    cd.root = str(course_dir)
    cd.source_directory = str(SOLUTIONS)
    cd.release_directory = str(course_dir / "release")
    cd.submitted_directory = str(Path(submissions).resolve())
    cd.autograded_directory = str(course_dir / "autograded")
    cd.feedback_directory = str(Path(out).resolve() / "feedback")
    # several graders write to one SQLite file: wait for its lock instead of failing
    cd.db_url = f"sqlite:///{course_dir / 'gradebook.db'}?timeout=120"

    traits = Autograde.class_traits()
    cfg.Autograde.sanitize_preprocessors = [
        RestoreCells if p is OverwriteCells else p for p in traits["sanitize_preprocessors"].default()]
    cfg.Autograde.autograde_preprocessors = [
        GradingExecute if p is Execute else p for p in traits["autograde_preprocessors"].default()]
    if options.get("cell_timeout") is not None:
        cfg.GradingExecute.cell_timeout = int(options["cell_timeout"])
    if options.get("test_timeout") is not None:
        cfg.GradingExecute.timeout = int(options["test_timeout"])
    if options.get("memory_limit_gb") is not None:
        cfg.GradingExecute.memory_limit_gb = float(options["memory_limit_gb"])
    cfg.RestoreCells.release_directory = cd.release_directory
    cfg.HTMLExporter.template_name = "feedback"
    # the feedback shows each test's outcome and reason, not the hidden tests' code
    cfg.GenerateFeedback.preprocessors = [GetGrades, ClearHiddenTests, CSSHTMLHeaderPreprocessor]
    cfg.ClearHiddenTests.enforce_metadata = False  # a student's cell quoting the markers must not stop it
    return cfg


def run_app(app_class, cfg, lesson, student="*", **flags):
    """Run an nbgrader app for one lesson (and student); (ok, its log)."""
    coursedir = CourseDirectory(config=cfg)
    coursedir.assignment_id, coursedir.student_id = lesson, student
    app = app_class(coursedir=coursedir, config=cfg)
    for name, value in flags.items():
        setattr(app, name, value)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(f"[{record.levelname}] {record.getMessage()}")
    app.log.addHandler(handler)
    try:
        app.start()
        ok = True
    except Exception:  # nbgrader raises NbGraderException after logging each failure
        lines.append(traceback.format_exc())
        ok = False
    finally:
        app.log.removeHandler(handler)
    return ok, "\n".join(lines)
