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


def warm_up(notebook):
    """Make one HTML page of `notebook` here, in the driver, before any grader is forked.

    Every grader makes a feedback page, and the first page a process makes costs it about
    twice what the next one does (lesson 01's examples: 0.9-1.3 s of CPU per page without
    this, 0.3-0.5 s with it): nbconvert imports BeautifulSoup, soupsieve, Pygments and
    mistune, and compiles their regular expressions (BeautifulSoup's entity tables, the CSS
    selectors, Pygments' lexer tables), all kept in module and class state for the life of
    the process. Graders forked after this inherit them: that work is done once per run, not
    once per notebook. The page itself is thrown away; outputs of the kinds graded notebooks
    carry (printed lines, an error with its coloured traceback) make it take the same paths.
    """
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook), as_version=4)
    code = next((c for c in nb.cells if c.cell_type == "code"), None)
    if code is not None:
        code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ checked\n"),
                        nbformat.v4.new_output("error", ename="AssertionError", evalue="✗ differs",
                                               traceback=["\x1b[0;31mAssertionError\x1b[0m: ✗ differs"])]
    HTMLExporter().from_notebook_node(nb)
