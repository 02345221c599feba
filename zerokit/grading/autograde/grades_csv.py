"""grades.csv: one row per student graded in this run, a column per lesson total and one per
graded cell (`lesson:grade_id`), from the gradebook."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from nbgrader.api import Gradebook, MissingEntry

from ..lessons import SOLUTIONS


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
