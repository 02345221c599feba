"""Edit a notebook as plain text, then turn it back (an authoring aid for instructors).

    python tools/notebook.py to-py solutions/03_zero1/03_zero1.ipynb   # -> /tmp/03_zero1.py
    python tools/notebook.py to-ipynb /tmp/03_zero1.py solutions/03_zero1/03_zero1.ipynb

The text form is jupytext's "percent" format; each cell's nbgrader metadata rides in its
`# %%` header, so solution regions, grade ids and points survive the round trip, and the
cells keep the ids they had in the notebook written over (keep_ids). The .ipynb in
solutions/ stays the source of truth: run `make lessons` after editing it.
Needs jupytext (`pip install jupytext`).
"""

import json
import sys
from pathlib import Path

import jupytext

KERNEL = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def to_ipynb(src, dst):
    nb = jupytext.read(src, fmt="py:percent")
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k == "nbgrader"}
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    old = json.loads(Path(dst).read_text())["cells"] if Path(dst).exists() else []
    jupytext.write(nb, dst, fmt="ipynb")
    # one stable byte layout, so diffs show content only
    data = json.loads(Path(dst).read_text())
    keep_ids(data["cells"], old)
    Path(dst).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def keep_ids(cells, old):
    """Give each cell the id it had in the notebook being replaced, so that a one-line edit is a
    one-line diff (the text form has no ids, and a new one for every cell would change them all).

    Matched by grade id, then by identical source, then by position for a cell of the same type
    (an edited cell keeps its id); a cell with no match keeps its new id.
    """
    used = set()

    def take(cell):
        if cell is None or cell.get("id") in used:
            return None
        used.add(cell.get("id"))
        return cell.get("id")

    def grade_id(cell):
        return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")

    by_grade_id = {grade_id(c): c for c in old if grade_id(c)}
    matches = [take(by_grade_id.get(grade_id(c))) if grade_id(c) else None for c in cells]
    for i, cell in enumerate(cells):
        if matches[i] is None:
            same = next((o for o in old if o.get("id") not in used and o["cell_type"] == cell["cell_type"]
                         and "".join(o["source"]) == "".join(cell["source"])), None)
            matches[i] = take(same)
    for i, cell in enumerate(cells):
        if matches[i] is None and i < len(old) and old[i]["cell_type"] == cell["cell_type"]:
            matches[i] = take(old[i])
    for cell, found in zip(cells, matches):
        if found:
            cell["id"] = found


def to_py(src, dst=None):
    nb = jupytext.read(src)
    dst = dst or f"/tmp/{Path(src).stem}.py"
    nb.metadata["jupytext"] = {"cell_metadata_filter": "nbgrader,-all", "notebook_metadata_filter": "-all"}
    jupytext.write(nb, dst, fmt="py:percent")
    print(dst)


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"to-ipynb": to_ipynb, "to-py": to_py}[command](*paths)
