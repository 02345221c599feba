"""Example submissions for the grading flow, generated from lessons/ at test time.

Each lesson's module here (lesson00.py, ...) lists its example students: the student id
names the defect, and each student is the released notebook (lessons/<lesson>/) with a few
cells replaced, inserted or deleted, plus the score each test cell must get and a fragment
of the one-line reason the feedback must show. Generating them from lessons/ means they
can never drift from what students actually receive.

    python -m tests.submissions DEST [LESSON ...]     # write DEST/<student>/<lesson>/<lesson>.ipynb
    make grade SUBMISSIONS=DEST                        # then grade them
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = object()  # stands for "the instructor's solution of this cell" (from solutions/)


def solution_with(old, new):
    """A cell's source: the instructor's solution with `old` replaced by `new` (one planted bug)."""
    def edit(solution):
        if old not in solution:
            raise KeyError(f"the solution no longer contains {old!r}: update this example student")
        return solution.replace(old, new)

    return edit


@dataclass
class Student:
    """One example submission: the released notebook with `cells` edited; what it must score."""

    id: str
    defect: str  # one line, for the table in the report
    expected: dict  # grade_id -> points this submission must get
    # a fragment of the one-line reason every failed test cell must show; or {grade_id: fragment}, for a
    # notebook with one mistake per exercise, each costing its own test cell (one grading run for several)
    reason: str | dict = ""
    cells: dict = field(default_factory=dict)  # grade_id -> new source, SOLUTION, or solution_with(...)
    before: dict = field(default_factory=dict)  # grade_id -> source of a new cell inserted before it
    after: dict = field(default_factory=dict)  # grade_id -> source of a new cell inserted after it
    delete: tuple = ()  # grade_ids of cells removed
    files: dict = field(default_factory=dict)  # path beside the notebook -> text: other files submitted
    raw: str | None = None  # the file's whole content instead of a notebook
    full: bool = False  # keep every cell; otherwise only the lesson's KEEP cells besides graded ones

    def reason_for(self, grade_id):
        """The fragment the reason of test cell `grade_id` must contain, should it lose points."""
        return self.reason.get(grade_id, "") if isinstance(self.reason, dict) else self.reason


def lesson_modules():
    """{lesson id: module} for each lesson with example students here and a notebook in lessons/."""
    found = {}
    for path in sorted(Path(__file__).parent.glob("lesson[0-9]*.py")):
        mod = importlib.import_module(f"{__name__}.{path.stem}")
        if (ROOT / "lessons" / mod.LESSON / f"{mod.LESSON}.ipynb").exists():
            found[mod.LESSON] = mod
    return found


def method_replaced(method, replacement):
    """A cell's source: the instructor's solution with the method `method` (its decorators
    included) replaced by `replacement`, a whole `def` indented as in the class."""
    def edit(solution):
        lines = solution.splitlines(keepends=True)
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith(f"def {method}(")), None)
        if start is None:
            raise KeyError(f"the solution no longer has a method {method}: update this example student")
        while start > 0 and lines[start - 1].lstrip().startswith("@"):
            start -= 1
        end = start + 1
        while end < len(lines) and lines[end].lstrip().startswith("@"):
            end += 1
        end += 1
        while end < len(lines) and (not lines[end].strip() or lines[end].startswith(" " * 8)):
            end += 1
        return "".join(lines[:start]) + replacement.lstrip("\n") + "\n" + "".join(lines[end:])

    return edit


def full_marks(lesson):
    """grade_id -> points of every test cell of the lesson, as solutions/ (nbgrader's source) gives them."""
    nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
    return {m["grade_id"]: m["points"] for c in nb["cells"]
            if (m := c.get("metadata", {}).get("nbgrader", {})).get("grade") and "points" in m}


def correct(lesson, *exercises):
    """The instructor's solution in every exercise cell, every cell of the notebook kept: full marks."""
    return Student("correct", "the instructor's solution, every cell of the notebook kept", full_marks(lesson),
                   cells=dict.fromkeys(exercises, SOLUTION), full=True)


def untouched(lesson, reason):
    """The released notebook with nothing filled in: no points, and a reason that says why."""
    return Student("untouched", "the released notebook, nothing filled in", dict.fromkeys(full_marks(lesson), 0),
                   reason=reason)


_LEFT = object()  # an exercise cell left as released


def _changes(student, base):
    """{cell: its source} where `student` differs from `base` ({cell: source} most of its peers share)."""
    return {gid: student.cells.get(gid, _LEFT) for gid, common in base.items()
            if student.cells.get(gid, _LEFT) is not common}


def one_notebook(full, base, *students):
    """Several example students with mistakes in different cells as one submission: each cell from the one
    student that changes it (`base`'s where none does), each lost check (`full`: each check's points) with
    that student's reason. The checks grade each exercise with zerokit's versions of the others, so that
    each mistake costs its own checks in one notebook as it does alone, and one grading run shows several
    (tests/test_autograde.py grades every notebook whole: fewer notebooks, a shorter `make test`).
    The id joins the students' with "-"."""
    if len(students) == 1:
        return students[0]
    cells, reason, owner = dict(base), {}, {}
    for st in students:
        assert not (st.before or st.after or st.delete or st.files or st.raw or st.full), \
            f"{st.id}: only cell edits combine"
        assert set(st.expected) == set(full), f"{st.id}: another lesson's checks"
        for gid, source in _changes(st, base).items():
            assert gid not in owner, f"{st.id} and {owner.get(gid)} both change {gid}"
            owner[gid] = st.id
            cells[gid] = source
        for gid, points in st.expected.items():
            if points != full[gid]:
                assert gid not in reason, f"{st.id} loses {gid}, which another mistake here loses too"
                reason[gid] = st.reason_for(gid)
    expected = {gid: next((st.expected[gid] for st in students if st.expected[gid] != points), points)
                for gid, points in full.items()}
    return Student("-".join(st.id for st in students), "; ".join(st.defect for st in students), expected,
                   reason=reason, cells={gid: v for gid, v in cells.items() if v is not _LEFT})


def one_per_exercise(full, students):
    """The students as few notebooks as one_notebook allows: grouped by the cells they change from what most
    of them have there (the solution, or the cell as released), the i-th of each group in the i-th notebook."""
    ids = sorted({gid for st in students for gid in st.cells})
    base = {}
    for gid in ids:
        values = [st.cells.get(gid, _LEFT) for st in students]
        base[gid] = max((SOLUTION, _LEFT), key=lambda v: sum(w is v for w in values))
    groups = {}
    for st in students:
        groups.setdefault(frozenset(_changes(st, base)), []).append(st)
    keys = list(groups)
    assert all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1:]), \
        f"students change overlapping sets of cells: {[sorted(k) for k in keys]}"
    lists = list(groups.values())
    return [one_notebook(full, base, *(lst[i] for lst in lists if i < len(lst)))
            for i in range(max(map(len, lists)))]


def _solution_sources(lesson):
    """grade_id -> the solution cell's code with the BEGIN/END SOLUTION markers removed."""
    nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
    out = {}
    for cell in nb["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("solution") and meta.get("grade_id"):
            src = "".join(cell["source"])
            out[meta["grade_id"]] = re.sub(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n", "", src, flags=re.M)
    return out


def _code_cell(source):
    return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": source.splitlines(keepends=True)}


def notebook(lesson, student, keep=()):
    """The submission of `student` for `lesson`, as a notebook dict."""
    nb = json.loads((ROOT / "lessons" / lesson / f"{lesson}.ipynb").read_text())
    solutions = _solution_sources(lesson)
    unknown = (set(student.cells) | set(student.before) | set(student.after) | set(student.delete)) - {
        c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in nb["cells"]}
    if unknown:
        raise KeyError(f"{student.id}: no cell {sorted(unknown)} in lessons/{lesson}")
    cells = []
    for cell in nb["cells"]:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        source = "".join(cell["source"])
        if gid is None and cell["cell_type"] == "code" and not student.full and not any(k in source for k in keep):
            continue  # a demo cell the exercises do not need: leave it out to grade faster
        if gid in student.delete:
            continue
        if gid in student.before:
            cells.append(_code_cell(student.before[gid]))
        if gid in student.cells:
            new = student.cells[gid]
            cell = copy.deepcopy(cell)
            if new is SOLUTION:
                new = solutions[gid]
            elif callable(new):
                new = new(solutions[gid])
            cell["source"] = new.splitlines(keepends=True)
        cells.append(cell)
        if gid in student.after:
            cells.append(_code_cell(student.after[gid]))
    nb["cells"] = cells
    return nb


def build(dest, lessons=None):
    """Write DEST/<student>/<lesson>/<lesson>.ipynb for every example student; return {lesson: [Student]}."""
    built = {}
    for lesson, mod in lesson_modules().items():
        if lessons and lesson not in lessons:
            continue
        for student in mod.STUDENTS:
            path = Path(dest) / student.id / lesson / f"{lesson}.ipynb"
            path.parent.mkdir(parents=True, exist_ok=True)
            if student.raw is not None:
                path.write_text(student.raw)
            else:
                path.write_text(json.dumps(notebook(lesson, student, mod.KEEP), indent=1, ensure_ascii=False) + "\n")
            for name, text in student.files.items():
                (path.parent / name).parent.mkdir(parents=True, exist_ok=True)
                (path.parent / name).write_text(text)
        built[lesson] = list(mod.STUDENTS)
    return built
