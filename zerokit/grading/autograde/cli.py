"""The command line, `python -m zerokit.grading.autograde`: main() parses it and calls grade()."""

from __future__ import annotations

import argparse
import signal
import sys

from ..lessons import ROOT
from .pool import grade


def main(argv=None):
    # --help shows the package docstring, the flow an instructor needs. It is looked up, not
    # imported: the package imports this module (and is always loaded before it).
    overview = sys.modules[__package__].__doc__
    parser = argparse.ArgumentParser(
        prog="python -m zerokit.grading.autograde", description=overview,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("submissions", help="folder of <student>/<lesson>/<lesson>.ipynb")
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
    parser.add_argument("--notebook-timeout", type=float, default=1800, help="seconds for a whole notebook")
    parser.add_argument("--memory-limit-gb", type=float, help="resident memory (GiB) of a notebook's kernel "
                        "(default 4)")
    args = parser.parse_args(argv)
    # `kill` (SIGTERM) unwinds like Ctrl-C does, so grade() stops its graders on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    grade(args.submissions, lessons=args.lesson, students=args.student, course_dir=args.course_dir, out=args.out,
          jobs=args.jobs, cell_timeout=args.cell_timeout, test_timeout=args.test_timeout,
          check_timeout=args.check_timeout, notebook_timeout=args.notebook_timeout,
          memory_limit_gb=args.memory_limit_gb, echo=lambda line: print(line, flush=True))
    # a submission that could not be graded is a result (0 points and its reason), not a failure
    return 0
