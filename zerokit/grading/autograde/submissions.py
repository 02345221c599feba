"""Finding the submissions: nbgrader's layout, SUBMISSIONS/<student>/<lesson>/<lesson>.ipynb."""

from __future__ import annotations

from pathlib import Path

from ..lessons import lesson_ids


def find_submissions(submissions, lessons=None, students=None, echo=print):
    """[(student, lesson)] for every SUBMISSIONS/<student>/<lesson>/<lesson>.ipynb of a known lesson.

    Anything else is skipped with one line saying why (through `echo`): a misnamed lesson
    folder or notebook, or SUBMISSIONS one level off, would otherwise go ungraded unnoticed.
    Folders left out on purpose (--lesson, --student) and hidden ones are skipped quietly.
    """
    known = lesson_ids()
    unknown = set(lessons or ()) - set(known)
    if unknown:
        raise SystemExit(f"no such lesson in solutions/: {', '.join(sorted(unknown))}")
    wanted = set(lessons or known)
    found = []
    for sdir in sorted(Path(submissions).iterdir()):
        if sdir.name.startswith(".") or (students and sdir.name not in students):
            continue
        if not sdir.is_dir():
            echo(f"skipped {sdir}: not a student folder (expected <student>/<lesson>/<lesson>.ipynb)")
            continue
        for ldir in sorted(sdir.iterdir()):
            if ldir.name.startswith(".") or (ldir.name in known and ldir.name not in wanted):
                continue
            if not ldir.is_dir() or ldir.name not in known:
                # a lesson one level up or down means SUBMISSIONS itself is one level off
                off = ""
                if sdir.name in known:
                    off = " (SUBMISSIONS is one level too deep: give the folder holding the students)"
                elif ldir.is_dir() and any((ldir / lesson).is_dir() for lesson in known):
                    off = " (SUBMISSIONS is one level too high?)"
                echo(f"skipped {ldir}: {ldir.name} is not a lesson; lessons are {', '.join(known)}{off}")
            elif not (ldir / f"{ldir.name}.ipynb").is_file():
                others = sorted(p.name for p in ldir.glob("*.ipynb"))
                echo(f"skipped {ldir}: no {ldir.name}.ipynb in it"
                     + (f" (found {', '.join(others)}: rename it)" if others else ""))
            else:
                found.append((sdir.name, ldir.name))
    return found
