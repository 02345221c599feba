"""Generate lessons/ from solutions/ with nbgrader, and check the two have not drifted.

    python -m zerokit.grading.lessons generate [LESSON ...]   # make lessons
    python -m zerokit.grading.lessons check                    # exit 1 and a diff if they drifted

`generate` is `nbgrader generate_assignment --no-db` for each lesson (solutions removed,
hidden tests removed, cells locked and checksummed). `check` generates into a temporary
folder and compares, cell by cell, the cell type, source and nbgrader metadata with the
committed lessons/: what a student would get if we regenerated now must be what they get.
"""

import argparse
import difflib
import json
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
LESSONS = ROOT / "lessons"
CONFIG = "nbgrader_config.py"  # the course's nbgrader settings, at ROOT

__all__ = ["lesson_ids", "generate", "drift", "release_drift"]


def lesson_ids():
    """Assignment ids: the folders of solutions/ that hold a notebook of the same name."""
    return sorted(d.name for d in SOLUTIONS.iterdir() if (d / f"{d.name}.ipynb").exists())


def nbgrader_env():
    """nbgrader calls helper programs (alembic) by name: put this Python's bin/ on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def generate(ids=None, release_dir=LESSONS):
    """nbgrader generate_assignment --no-db for each lesson, into release_dir, as the course's
    nbgrader_config.py says. In this process, one lesson after another: `nbgrader` on the
    command line spends ~6 s of CPU importing itself, for a conversion of under a second."""
    from nbgrader.converters import GenerateAssignment  # here: nbgrader takes seconds to import
    from traitlets.config.loader import PyFileConfigLoader

    cfg = PyFileConfigLoader(CONFIG, path=str(ROOT)).load_config()
    cfg.CourseDirectory.root = str(ROOT)
    cfg.CourseDirectory.release_directory = str(release_dir)
    cfg.GenerateAssignment.no_database = True  # --no-db: these two
    cfg.SaveCells.enabled = False
    for lesson in ids or lesson_ids():
        ok, log = run_app(GenerateAssignment, cfg, lesson, force=True)
        if not ok:
            raise RuntimeError(f"nbgrader generate_assignment {lesson} failed:\n{log}")


def run_app(app_class, cfg, lesson, student="*", **flags):
    """Run an nbgrader app (a converter: GenerateAssignment, Autograde, ...) for one lesson and
    student, in this process; (ok, its log)."""
    from nbgrader.coursedir import CourseDirectory

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


def _cells(path):
    nb = json.loads(Path(path).read_text())
    return [
        {"type": c["cell_type"], "source": "".join(c["source"]), "nbgrader": c.get("metadata", {}).get("nbgrader")}
        for c in nb["cells"]
    ]


def _diff(a, b, lesson, fresh_label):
    diff = difflib.unified_diff(
        json.dumps(a, indent=1).splitlines(), json.dumps(b, indent=1).splitlines(),
        f"lessons/{lesson} (committed)", f"lessons/{lesson} ({fresh_label})", lineterm="", n=2)
    return "\n".join(list(diff)[:60])


def release_drift(release_dir, lesson, released=LESSONS):
    """"" if release_dir/<lesson> (just generated from solutions/) has the cells of the committed
    lessons/<lesson> (`released`), what students received; else a diff of the two."""
    committed = Path(released) / lesson / f"{lesson}.ipynb"
    if not committed.exists():
        return f"lessons/{lesson}/{lesson}.ipynb is missing: run `make lessons` (and release it) first"
    a, b = _cells(committed), _cells(Path(release_dir) / lesson / f"{lesson}.ipynb")
    return "" if a == b else _diff(a, b, lesson, "from solutions/ now")


def drift():
    """Differences between lessons/ and what nbgrader makes of solutions/ now ([] if none)."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        generate(release_dir=Path(tmp))
        for lesson in lesson_ids():
            fresh = Path(tmp) / lesson / f"{lesson}.ipynb"
            committed = LESSONS / lesson / f"{lesson}.ipynb"
            if not committed.exists():
                problems.append(f"{committed.relative_to(ROOT)} is missing: run `make lessons`")
                continue
            a, b = _cells(committed), _cells(fresh)
            if a != b:
                problems.append(_diff(a, b, lesson, "from solutions/"))
        extra = {d.name for d in LESSONS.iterdir() if d.is_dir()} - set(lesson_ids()) if LESSONS.exists() else set()
        problems += [f"lessons/{e} has no source in solutions/" for e in sorted(extra)]
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["generate", "check"])
    parser.add_argument("lessons", nargs="*")
    args = parser.parse_args(argv)
    if args.command == "generate":
        generate(args.lessons or None)
        print(f"regenerated {', '.join(args.lessons or lesson_ids())} in {LESSONS.relative_to(ROOT)}/")
        return 0
    problems = drift()
    for p in problems:
        print(p)
    print("lessons/ matches solutions/" if not problems else f"{len(problems)} lesson(s) drifted: run `make lessons`")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
