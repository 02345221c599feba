"""The course folder nbgrader works in: its configuration, and running an nbgrader app there.

The course folder (default: the repository root, where .gitignore and `make clean` expect
gradebook.db, release/, autograded/) takes its settings from the repository's
nbgrader_config.py (which applies settings.grade_as_the_course: our preprocessors, feedback
without hidden tests), with the folders of this grading run. A course folder other than the
repository gets an nbgrader_config.py of its own saying the same, so that nbgrader's own
commands run there (export, generate_feedback, release_feedback, the formgrader) see this
course, these submissions and this gradebook.
"""

from __future__ import annotations

from pathlib import Path

from traitlets.config.loader import PyFileConfigLoader

from ..lessons import CONFIG, ROOT, SOLUTIONS, run_app  # noqa: F401  (run_app: the graders' too)
# the first line of a course folder's config that this module wrote (and may rewrite)
WRITTEN_BY = "# Written by python -m zerokit.grading.autograde (make grade); rewritten by each grading run."


def _folders(course_dir, submissions, out, solutions=SOLUTIONS):
    course_dir = Path(course_dir).resolve()
    return {
        "root": str(course_dir),
        "source_directory": str(Path(solutions).resolve()),
        "release_directory": str(course_dir / "release"),
        "submitted_directory": str(Path(submissions).resolve()),
        "autograded_directory": str(course_dir / "autograded"),
        "feedback_directory": str(Path(out).resolve() / "feedback"),
        # several graders write to one SQLite file: wait for its lock instead of failing
        "db_url": f"sqlite:///{course_dir / 'gradebook.db'}?timeout=120",
    }


def _options(options):
    """(Class, trait, value) for the command line's grading options that were given."""
    names = {"cell_timeout": ("GradingExecute", "cell_timeout", int), "test_timeout": ("GradingExecute", "timeout", int),
             "memory_limit_gb": ("GradingExecute", "memory_limit_gb", float), "sandbox": ("GradingExecute", "sandbox", bool)}
    return [(cls, trait, kind(options[key])) for key, (cls, trait, kind) in names.items()
            if options.get(key) is not None]


def course_config(course_dir, submissions, out, options, settings=(), solutions=SOLUTIONS, released=None):
    """The repository's nbgrader_config.py, pointed at this course folder, with this run's options.

    settings: extra (Class, trait, value) triples, as nbgrader's own `--Class.trait=value`.
    solutions, released: the source notebooks and what students received (default: the
    repository's solutions/ and lessons/).
    """
    cfg = PyFileConfigLoader(CONFIG, path=str(ROOT)).load_config()
    for trait, value in _folders(course_dir, submissions, out, solutions).items():
        setattr(cfg.CourseDirectory, trait, value)
    if released is not None:
        cfg.RestoreCells.release_directory = str(Path(released).resolve())
    for cls, trait, value in _options(options) + list(settings):
        setattr(cfg[cls], trait, value)
    return cfg


def write_course_config(course_dir, submissions, out, options, settings=(), solutions=SOLUTIONS, released=None):
    """An nbgrader_config.py in a course folder other than the repository: nbgrader's commands run
    there see this course. Returns its path, or None for the repository (it has its own) and for a
    config an instructor wrote (left alone)."""
    course_dir = Path(course_dir).resolve()
    if course_dir == ROOT:
        return None
    path = course_dir / CONFIG
    if path.exists() and not path.read_text().startswith(WRITTEN_BY):
        return None
    lines = [WRITTEN_BY,
             "# nbgrader commands run in this folder (export, generate_feedback, release_feedback, the",
             "# formgrader) see the course below; its settings come from the repository's config.",
             "c = get_config()  # noqa: F821",
             f"load_subconfig({str(ROOT / CONFIG)!r})  # noqa: F821", ""]
    lines += [f"c.CourseDirectory.{trait} = {value!r}"
              for trait, value in _folders(course_dir, submissions, out, solutions).items()]
    if released is not None:
        lines.append(f"c.RestoreCells.release_directory = {str(Path(released).resolve())!r}")
    lines += [f"c.{cls}.{trait} = {value!r}" for cls, trait, value in _options(options) + list(settings)]
    path.write_text("\n".join(lines) + "\n")
    return path
