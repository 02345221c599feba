"""RestoreCells: nbgrader's OverwriteCells, which also puts deleted test cells back.

It replaces OverwriteCells in Autograde's sanitize preprocessors (course.py). nbgrader puts
edited test cells back from the gradebook (checksums); this also puts deleted ones back,
and marks each cell it restored, which GradingExecute turns into a note in the feedback.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbgrader import utils
from nbgrader.preprocessors import OverwriteCells
from traitlets import Bool, Unicode


class RestoreCells(OverwriteCells):
    """nbgrader's OverwriteCells, also restoring deleted test cells, and marking what it restored.

    nbgrader puts every locked cell back from the gradebook (that is also how a test cell's
    hidden tests come back), so its own change reports cannot tell an edited cell from an
    untouched one; the student version in the scratch release folder can.
    """

    add_missing_cells = Bool(True, help="Put deleted test cells back (nbgrader's default: score them 0).").tag(
        config=True)
    release_directory = Unicode(help="Where generate_assignment wrote the student version.").tag(config=True)

    def preprocess(self, nb, resources):
        info = resources["nbgrader"]
        path = Path(self.release_directory) / info["assignment"] / f"{info['notebook']}.ipynb"
        self._released = {}
        for cell in nbformat.read(str(path), as_version=4).cells:
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("locked") and meta.get("grade_id"):
                self._released[meta["grade_id"]] = utils.compute_checksum(cell)
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        edited = grade_id in self._released and utils.compute_checksum(cell) != self._released[grade_id]
        cell, resources = super().preprocess_cell(cell, resources, index)
        if edited and cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id:
            cell.metadata["zerokit_grading"] = {"restored": "edited"}
        return cell, resources

    def missing_cell_transform(self, source_cell, max_score, is_solution=False, is_task=False):
        cell = super().missing_cell_transform(source_cell, max_score, is_solution, is_task)
        if cell.cell_type == "code":
            cell.source = source_cell.source  # nbgrader comments out only its notice's first line
        cell.metadata["zerokit_grading"] = {"restored": "deleted"}
        return cell
