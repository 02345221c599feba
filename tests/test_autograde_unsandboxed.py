"""Grading without the wall (--no-sandbox, an explicit choice): what still protects the grades.

Lesson 00's two hostile submissions are graded without bubblewrap by `python -m
zerokit.grading.autograde --no-sandbox`, run on a throwaway copy of the course (zerokit,
solutions/, lessons/, the nbgrader config; PYTHONPATH points every process there), so that
what their writes reach is the copy, never this checkout. Then:
- the one that rewrites the checks' comparison, the hidden tests' source and lessons/ gets
  its writes through; the integrity check finds them, puts the files back, grades each
  notebook that was being graded at the time again on its own, and the culprit scores 0
  with the reason "modified the grader's files";
- the one that kills its grader's process group and parent takes that grader down: it
  scores 0 with that reason, and the run goes on;
- the detached process it started (its own session, an empty environment) does not
  survive: the subreaper adopted it; no temporary file of the run is left either;
- the copy's files are exactly the checkout's again, and the checkout never changed.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from conftest import checkout_state
from tests import submissions
from tests.submissions import hostile, lesson00

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ("hostile_writes", "hostile_processes")
COURSE = ("zerokit", "solutions", "lessons")
NOTHING = f"0 of {sum(lesson00.FULL.values()):g} points"  # lesson 00's points, none scored
SKIP = shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints")


@pytest.fixture(scope="module")
def unsandboxed(tmp_path_factory):
    root = tmp_path_factory.mktemp("unsandboxed")
    copy = root / "course-copy"
    for name in COURSE:
        shutil.copytree(ROOT / name, copy / name, ignore=SKIP)
    shutil.copy(ROOT / "nbgrader_config.py", copy)
    submissions.build(root / "all", ["00_collectives"])
    for student in HOSTILE:
        shutil.copytree(root / "all" / student, root / "submitted" / student)
    before = checkout_state()
    tmp = root / "tmp"  # every temporary file of the run goes here, to be looked for afterwards
    tmp.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "zerokit.grading.autograde", str(root / "submitted"), "--course-dir",
         str(root / "course"), "--no-sandbox", "--jobs=2", "--check-timeout=30", "--check-memory-limit-gb=1",
         "--cell-timeout=40"],
        cwd=copy, env={**os.environ, "PYTHONPATH": str(copy), "TMPDIR": str(tmp)}, capture_output=True, text=True,
        timeout=840)
    print(done.stdout, done.stderr)
    return SimpleNamespace(root=root, copy=copy, tmp=tmp, done=done, lines=done.stdout.splitlines(), before=before)


def _line(unsandboxed, student):
    return next(line for line in unsandboxed.lines if f"] {student} / 00_collectives:" in line)


def test_the_run_says_it_has_no_isolation_and_finishes(unsandboxed):
    assert unsandboxed.done.returncode == 0, unsandboxed.done.stderr
    assert any(line.startswith("isolation: none (--no-sandbox, chosen)") for line in unsandboxed.lines)
    assert "wrote" in unsandboxed.lines[-1] and "grades.csv" in unsandboxed.lines[-1]


def test_a_notebook_that_changed_the_graders_files_scores_0_with_that_reason(unsandboxed):
    line = _line(unsandboxed, "hostile_writes")
    assert NOTHING in line and "graded alone" in line, line
    reasons = [r for r in unsandboxed.lines if "modified the grader's files (put back)" in r]
    assert reasons, unsandboxed.lines
    for changed in ("zerokit/grading/compare.py (changed)", "solutions/00_collectives/00_collectives.ipynb (changed)",
                    "lessons/00_collectives/planted.txt (added)"):
        assert changed in reasons[0], reasons[0]


def test_a_notebook_that_killed_its_grader_scores_0_and_the_run_goes_on(unsandboxed):
    line = _line(unsandboxed, "hostile_processes")
    assert NOTHING in line, line
    assert any("the process grading this notebook was killed (SIGKILL)" in r for r in unsandboxed.lines)


def test_the_course_copy_is_put_back_exactly(unsandboxed):
    for name in COURSE:
        ours = {p.relative_to(ROOT / name): p.read_bytes() for p in (ROOT / name).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts}
        theirs = {p.relative_to(unsandboxed.copy / name): p.read_bytes() for p in (unsandboxed.copy / name).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts}
        assert sorted(set(ours) ^ set(theirs)) == []
        assert [str(p) for p in ours if ours[p] != theirs[p]] == []


def test_nothing_the_notebooks_started_survives(unsandboxed):
    survivors = [p.pid for p in psutil.process_iter(["cmdline"])
                 if hostile.DETACHED_MARKER in " ".join(p.info["cmdline"] or [])]
    assert survivors == []
    # nor their temporary files, nor the scratch folders of the graders they killed (torch keeps a
    # cache of its own there, torchinductor_<user>, meant to persist)
    left = sorted(p.name for p in unsandboxed.tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == []


def test_the_checkout_never_changed(unsandboxed):
    assert checkout_state() == unsandboxed.before
