"""The one-line reason of a failed test cell: worked out, shown to the student, read back.

GradingExecute (execute.py) puts `note`s first in a grade cell's output, where the feedback
shows them to the student; the "fail" one carries the reason in its metadata, and
`reasons_from_notebook` reads it back from the autograded notebook for the report and the
return value of grade(). Writer and reader of that mark live here, side by side.
"""

from __future__ import annotations

import html

import nbformat
from nbformat.v4 import new_output

# Our own error names (GradingExecute's): they say why a cell did not run properly, so they come first.
_OWN_ERRORS = ("KernelDied", "CellTimeout", "NotRun")


def _first_line(text):
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def failure_reason(outputs):
    """One line saying why a test cell failed, or None if its outputs show no failure."""
    errors = [o for o in outputs if o.get("output_type") == "error"]
    if errors:
        err = ([o for o in errors if o.get("ename") in _OWN_ERRORS] or errors)[0]
        ename, line = err.get("ename", "Error"), _first_line(err.get("evalue", ""))
        if ename in ("CheckFailed", "AssertionError") + _OWN_ERRORS:
            return line or ename
        if ename == "NameError":
            return (f"NameError: {line} (the test needs it: check the name, and that the cell "
                    "defining it ran without an error)")
        return f"{ename}: {line}" if line else ename
    stderr = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream"
                     and o.get("name") == "stderr")
    if stderr:
        return f"the cell wrote to stderr, which nbgrader counts as a failure: {_first_line(stderr)}"
    return None


def note(text, kind):
    """An output that shows `text` in bold ("fail": red, "note": grey) and keeps it in its metadata."""
    colour = {"fail": "#b00020", "note": "#555"}[kind]
    return new_output(
        "display_data",
        data={"text/plain": text,
              "text/html": f'<div style="color:{colour};font-weight:bold">{html.escape(text)}</div>'},
        metadata={"zerokit_grading": {"kind": kind, "text": text}},
    )


def reasons_from_notebook(path):
    """{grade_id: one-line reason} for the failed test cells of an autograded notebook."""
    reasons = {}
    for cell in nbformat.read(str(path), as_version=4).cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade"):
            continue
        for o in cell.get("outputs", []):
            info = o.get("metadata", {}).get("zerokit_grading")
            if info and info.get("kind") == "fail":
                # GradingExecute wrote "✗ 0 of <points> points: <reason>": keep the reason
                reasons[meta["grade_id"]] = info["text"].split(" points: ", 1)[-1]
    return reasons
