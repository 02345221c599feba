"""Grade a folder of submissions with nbgrader: scores, feedback HTML, grades.csv.

    python -m zerokit.grading.autograde SUBMISSIONS [--lesson ID] [--course-dir DIR] [--out DIR]

SUBMISSIONS is nbgrader's own layout, SUBMISSIONS/<student>/<lesson>/<lesson>.ipynb; the
lessons are the assignments of solutions/ (zerokit.grading.lessons.lesson_ids).

1. The course folder (default: the repository root, where .gitignore and `make clean`
   expect gradebook.db, release/, autograded/) gets a gradebook entry for every lesson with
   submissions: nbgrader's generate_assignment from solutions/ into the scratch release/
   (lessons/ is never touched). The checksums of the test cells come from here.
2. Each (student, lesson) is autograded by nbgrader, then gets its feedback HTML, in a
   process of its own forked from this one (nbgrader is imported once), --jobs at a time.
   Every process grading starts (the kernel, zerokit's fork server and ranks) carries a
   tag in its environment; when the notebook is done, any tagged process still alive is
   killed, so a hanging or crashing submission leaves nothing behind.
3. grades.csv: one row per student graded in this run, a column per lesson total and one per
   graded cell (`lesson:grade_id`). A line per notebook goes to stdout as it finishes, with
   the one-line reason of every test cell that lost points.

Two preprocessors replace nbgrader's own: GradingExecute (for Execute: per-cell timeouts, a
kernel that dies costs only the cells after it, a one-line reason first in every failed
test cell) and RestoreCells (for OverwriteCells: deleted test cells are put back too, and
the feedback says so). The feedback HTML leaves out the hidden tests' code. A submission
nbgrader cannot grade at all scores 0, with the reason on a feedback page of its own.

The modules, each importing only those listed above it (and zerokit.grading.lessons, harness):
    reasons       the one-line reason of a failed test cell: made, shown, read back
    execute       GradingExecute
    restore       RestoreCells
    course        the course folder's nbgrader config; running an nbgrader app there
    submissions   find_submissions: which (student, lesson) there are to grade
    processes     TAG, tagged_processes, kill_tagged: no process outlives its notebook
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
from .reasons import failure_reason
from .restore import RestoreCells
from .submissions import find_submissions

__all__ = ["grade", "find_submissions", "write_grades_csv", "failure_reason", "GradingExecute", "RestoreCells",
           "main"]
