"""Grade a folder of submissions with nbgrader: scores, feedback HTML, grades.csv.

    python -m zerokit.grading.autograde SUBMISSIONS [--lesson ID] [--course-dir DIR] [--out DIR]
                                        [--no-sandbox] [--Class.trait=value ...]
    python -m zerokit.grading.autograde --csv-only [--course-dir DIR] [--out DIR]

SUBMISSIONS is nbgrader's own layout, SUBMISSIONS/<student>/<lesson>/<lesson>.ipynb; the
lessons are the assignments of solutions/ (zerokit.grading.lessons.lesson_ids).

1. The course folder (default: the repository root, where .gitignore and `make clean`
   expect gradebook.db, release/, autograded/) gets a gradebook entry for every lesson with
   submissions: nbgrader's generate_assignment from solutions/ into the scratch release/
   (lessons/ is never touched). The checksums of the test cells come from here. If that
   release differs from lessons/ (what students received), grading stops and says why.
   A course folder other than the repository gets an nbgrader_config.py, so that nbgrader's
   own commands work there too.
2. Each (student, lesson) is autograded by nbgrader, then gets its feedback HTML, in a
   process of its own forked from this one (nbgrader is imported once), --jobs at a time.
   Its kernel runs in safe-path mode in a scratch copy of its folder, behind bubblewrap
   (unless --no-sandbox): the course read-only, solutions/ and everyone else's files out of
   sight, no network, a PID namespace of its own. Every process grading starts carries a
   tag in its environment, and each grader is a child subreaper: when the notebook is done,
   anything left alive is killed. The grader's own files are verified before and after
   every notebook, and put back if changed (that notebook scores 0).
3. grades.csv: every student and lesson in the gradebook (scores after late penalties, raw
   score and penalty beside them, hand-entered scores included), a column per lesson and
   per graded cell (`lesson:grade_id`). A line per notebook goes to stdout as it finishes,
   with the one-line reason of every test cell that lost points.

Every nbgrader command grades as this one does: nbgrader_config.py applies
settings.grade_as_the_course (our two preprocessors; feedback without the hidden tests).
GradingExecute replaces Execute (per-cell timeouts, a kernel that dies costs only the cells
after it, a one-line reason first in every failed test cell, the kernel behind the wall) and
RestoreCells replaces OverwriteCells (deleted test cells are put back too, and the feedback
says so). A submission nbgrader cannot grade at all scores 0, with the reason on a feedback
page of its own and in the gradebook.

The modules, each importing only those listed above it (and zerokit.grading.lessons, harness):
    reasons       the one-line reason of a failed test cell: made, shown, read back
    sandbox       the wall: the bubblewrap command line, probing that it works here
    kernel        GradingKernelManager: this Python's ipykernel, -P, scratch folder, behind the wall
    execute       GradingExecute
    restore       RestoreCells
    feedback      HideTests: nbgrader's ClearHiddenTests for test cells only
    settings      grade_as_the_course: the preprocessors every nbgrader command uses
    course        the course folder's nbgrader config (and the one written there); running an app
    submissions   find_submissions: which (student, lesson) there are to grade
    processes     TAG, tagged_processes, kill_tagged, the subreaper: no process outlives its notebook
    integrity     Baseline: the grader's files, verified and put back
    job           Job: one (student, lesson) graded in a forked child
    outcome       one graded notebook's scores and reasons, or 0 and a fallback feedback page
    report        the line printed per notebook
    grades_csv    write_grades_csv
    pool          grade() and default_jobs: the driver, --jobs graders at a time
    cli           main(): the command line (__main__ runs it)
"""

# What `from zerokit.grading import autograde` offered as one module, it still offers: the
# tests and instructors' scripts call these as autograde.<name>.
from ..lessons import lesson_ids
from .cli import main
from .course import course_config
from .execute import GradingExecute
from .grades_csv import write_grades_csv
from .pool import LOGS, default_jobs, grade
from .processes import TAG, kill_tagged, tagged_processes
from .sandbox import SandboxUnavailable
from .reasons import failure_reason
from .restore import RestoreCells
from .submissions import find_submissions

__all__ = ["grade", "find_submissions", "write_grades_csv", "failure_reason", "GradingExecute", "RestoreCells",
           "main"]
