"""The course's grading and feedback settings, for every nbgrader command alike.

nbgrader_config.py (the repository's, and the one `make grade` writes into a course folder
of its own) calls `grade_as_the_course(c)`, so that `nbgrader autograde`, `nbgrader
generate_feedback`, the formgrader's buttons and `make grade` grade and give feedback the
same way:
- autograde: nbgrader's own preprocessors, with GradingExecute for Execute (per-cell
  timeouts, a dead kernel costs only the cells after it, one-line reasons, the kernel in
  safe-path mode behind bubblewrap) and RestoreCells for OverwriteCells (deleted test cells
  put back, and edits judged against what students received: lessons/);
- feedback: the hidden tests' code never shown (their outcome and reason are), whoever
  generates it: HideTests (nbgrader's ClearHiddenTests) in GenerateFeedback's preprocessors;
  its formulas typeset as MathML when it is made (OfflineMath), so it reads right offline.

The lists are nbgrader's defaults with those two substitutions, read from nbgrader itself,
so a new nbgrader preprocessor is kept rather than silently dropped.
"""

from __future__ import annotations

from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
from nbgrader.converters import Autograde
from nbgrader.preprocessors import Execute, GetGrades, OverwriteCells

from ..lessons import LESSONS
from .execute import GradingExecute
from .feedback import HideTests
from .offline_math import OfflineMath
from .restore import RestoreCells

__all__ = ["grade_as_the_course", "FEEDBACK_PREPROCESSORS"]

# nbgrader's GenerateFeedback default is [GetGrades, CSSHTMLHeaderPreprocessor]: the hidden
# tests would be shown to the student as they ran. HideTests (ClearHiddenTests) removes them;
# OfflineMath typesets the formulas as MathML (MathJax comes from a CDN: none offline).
FEEDBACK_PREPROCESSORS = [GetGrades, HideTests, OfflineMath, CSSHTMLHeaderPreprocessor]


def grade_as_the_course(c):
    """Set, on the traitlets Config `c`, how this course autogrades and makes feedback."""
    traits = Autograde.class_traits()
    c.Autograde.sanitize_preprocessors = [
        RestoreCells if p is OverwriteCells else p for p in traits["sanitize_preprocessors"].default()]
    c.Autograde.autograde_preprocessors = [
        GradingExecute if p is Execute else p for p in traits["autograde_preprocessors"].default()]
    c.GenerateFeedback.preprocessors = list(FEEDBACK_PREPROCESSORS)
    # edited test cells are judged against what students received, not against a fresh
    # generation from solutions/ (which may have changed since the release)
    c.RestoreCells.release_directory = str(LESSONS)
    return c
