"""HideTests: the feedback never shows the hidden tests, and a student's own cell cannot stop it.

nbgrader's ClearHiddenTests removes "BEGIN HIDDEN TESTS" ... "END HIDDEN TESTS" regions; in
GenerateFeedback's preprocessors (settings.py) it keeps them from the feedback HTML whoever
makes it (make grade, nbgrader generate_feedback, the formgrader). nbgrader looks at every
cell, and a student's cell that merely mentions the marker (a string, a comment) stops the
feedback with "No end hidden tests statement found". The hidden tests live only in test
cells (the autograder put them back from the gradebook), so only those are cleared here.
"""

from __future__ import annotations

from nbgrader import utils
from nbgrader.preprocessors import ClearHiddenTests


class HideTests(ClearHiddenTests):
    """ClearHiddenTests on test cells (grade cells) only; what a student wrote is left as written."""

    def preprocess_cell(self, cell, resources, cell_index):
        if not utils.is_grade(cell):
            return cell, resources
        return super().preprocess_cell(cell, resources, cell_index)
