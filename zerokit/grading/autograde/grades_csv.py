"""grades.csv: the whole gradebook, one row per student, as nbgrader computes the grades.

Every student and every lesson in gradebook.db, whichever were graded in this run (a
`--student` or `--lesson` run rewrites the whole file, not only its own rows), with the
scores the gradebook holds: hand-entered formgrader scores included (nbgrader's Grade.score
is the manual score where there is one). Per lesson:

    <lesson>              the score after late penalties, as `nbgrader export` gives it
    <lesson>:raw_score    before the penalty
    <lesson>:late_penalty what the penalty took off (0 when on time)
    <lesson>:<grade_id>   each test cell, in notebook order

A lesson a student did not submit is left empty, not 0. `python -m zerokit.grading.autograde
--csv-only` rewrites the file from the gradebook without grading.
"""

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


def write_grades_csv(cfg, path):
    """Write every student and lesson of the gradebook to `path`; return the path."""
    with Gradebook(cfg.CourseDirectory.db_url, cfg.CourseDirectory.course_id) as gb:
        header, rows = ["student"], []
        assignments = sorted(gb.assignments, key=lambda a: a.name)
        for a in assignments:
            order = _cell_order(a.name) if (SOLUTIONS / a.name).is_dir() else []
            names = sorted((gc.name for nb in a.notebooks for gc in nb.grade_cells),
                           key=lambda n: (order.index(n) if n in order else len(order), n))
            header += [a.name, f"{a.name}:raw_score", f"{a.name}:late_penalty"] + [f"{a.name}:{n}" for n in names]
        for student in sorted(s.id for s in gb.students):
            row = {"student": student}
            for a in assignments:
                try:
                    sub = gb.find_submission(a.name, student)
                except MissingEntry:
                    continue
                penalty = sub.late_submission_penalty or 0.0
                row[a.name] = _fmt(max(0.0, sub.score - penalty))
                row[f"{a.name}:raw_score"] = _fmt(sub.score)
                row[f"{a.name}:late_penalty"] = _fmt(penalty)
                row.update({f"{a.name}:{g.name}": _fmt(g.score) for nb in sub.notebooks for g in nb.grades})
            rows.append(row)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    return path
