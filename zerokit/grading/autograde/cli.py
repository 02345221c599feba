"""The command line, `python -m zerokit.grading.autograde`: main() parses it and calls grade().

Besides its own options it takes nbgrader's `--Class.trait=value` settings (as every
nbgrader command does), e.g. `--LateSubmissionPlugin.penalty_method=zero`; they apply to
this run and are written into a course folder's nbgrader_config.py.
"""

from __future__ import annotations

import argparse
import ast
import re
import signal
import sys
from pathlib import Path

from ..lessons import ROOT
from .course import course_config
from .grades_csv import write_grades_csv
from .pool import grade

_SETTING = re.compile(r"^--([A-Z]\w*)\.(\w+)=(.*)$")


def _settings(extra, parser):
    """[(Class, trait, value)] from nbgrader-style `--Class.trait=value` arguments."""
    out = []
    for arg in extra:
        m = _SETTING.match(arg)
        if not m:
            parser.error(f"unrecognized argument: {arg} (nbgrader settings are written --Class.trait=value)")
        cls, trait, text = m.groups()
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare word, as traitlets' command line takes it: penalty_method=zero
        out.append((cls, trait, value))
    return out


def main(argv=None):
    # --help shows the package docstring, the flow an instructor needs. It is looked up, not
    # imported: the package imports this module (and is always loaded before it).
    overview = sys.modules[__package__].__doc__
    parser = argparse.ArgumentParser(
        prog="python -m zerokit.grading.autograde", description=overview,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", nargs="?", help="folder of <student>/<lesson>/<lesson>.ipynb")
    parser.add_argument("--lesson", action="append", help="grade only this lesson (repeatable)")
    parser.add_argument("--student", action="append", help="grade only this student (repeatable)")
    parser.add_argument("--course-dir", default=str(ROOT),
                        help="nbgrader's working folder: gradebook.db, release/, autograded/ (default: the repository)")
    parser.add_argument("--out", help="where grades.csv and feedback/ go (default: the course folder)")
    parser.add_argument("--jobs", type=int, help="notebooks graded at the same time (default: half the cores, "
                        "at least 4)")
    parser.add_argument("--cell-timeout", type=int, help="seconds for a cell that is not a test cell (default 60)")
    parser.add_argument("--test-timeout", type=int,
                        help="seconds for a test cell (default: Execute.timeout in nbgrader_config.py)")
    parser.add_argument("--check-timeout", type=float,
                        help="cap on each multi-rank check's own timeout, in seconds (default: the check's, 60)")
    parser.add_argument("--check-memory-limit-gb", type=float,
                        help="cap on each multi-rank check's memory per rank, in GiB (default: the check's, 4)")
    parser.add_argument("--notebook-timeout", type=float, default=1800, help="seconds for a whole notebook")
    parser.add_argument("--memory-limit-gb", type=float, help="resident memory (GiB) of a notebook's kernel "
                        "(default 4)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run the notebooks without bubblewrap (an explicit choice: they can then read the hidden "
                             "tests and change your files; only the integrity check and the process sweep remain)")
    parser.add_argument("--csv-only", action="store_true",
                        help="grade nothing: rewrite grades.csv from the course folder's gradebook (e.g. after "
                             "entering scores in the formgrader)")
    args, extra = parser.parse_known_args(argv)
    settings = _settings(extra, parser)
    if args.csv_only:
        out = Path(args.out or args.course_dir)
        cfg = course_config(args.course_dir, args.submissions or ROOT / "submitted", out, {}, settings)
        print(f"wrote {write_grades_csv(cfg, out / 'grades.csv')}")
        return 0
    if args.submissions is None:
        parser.error("the folder of submissions is required (or --csv-only)")
    # `kill` (SIGTERM) unwinds like Ctrl-C does, so grade() stops its graders on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    grade(args.submissions, lessons=args.lesson, students=args.student, course_dir=args.course_dir, out=args.out,
          jobs=args.jobs, cell_timeout=args.cell_timeout, test_timeout=args.test_timeout,
          check_timeout=args.check_timeout,
          check_memory_limit_gb=args.check_memory_limit_gb, notebook_timeout=args.notebook_timeout,
          memory_limit_gb=args.memory_limit_gb, echo=lambda line: print(line, flush=True),
          sandbox=not args.no_sandbox, settings=settings)
    # a submission that could not be graded is a result (0 points and its reason), not a failure
    return 0
