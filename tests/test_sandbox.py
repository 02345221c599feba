"""The wall itself (zerokit.grading.autograde.sandbox), without a notebook: what a program
behind it sees. tests/test_autograde.py grades notebooks behind it end to end."""

import subprocess
import sys

import pytest

from zerokit.grading.autograde import sandbox

pytestmark = pytest.mark.timeout(60)


def _run(wall, code, cwd):
    argv = wall.command([sys.executable, "-c", code], env={}, cwd=cwd)
    return subprocess.run(argv, capture_output=True, text=True, timeout=50)


@pytest.fixture
def wall(tmp_path):
    sandbox.probe()  # fails with the command to install bubblewrap: make test installs it
    scratch = tmp_path / "scratch"
    for d in ("work", "kernel"):
        (scratch / d).mkdir(parents=True)
    return sandbox.Wall(scratch, hidden=[tmp_path / "hidden"])


def test_what_lives_under_tmp_stays_visible_behind_the_private_tmp(wall, tmp_path):
    """A CI clone, its virtual environment and pytest's folders are often under /tmp, which the
    wall replaces with a private one: the binds must land on top of it, not under it."""
    course = tmp_path / "course-under-tmp"  # stands for a checkout in /tmp: bound read-only like zerokit
    course.mkdir()
    (course / "module.py").write_text("VALUE = 42\n")
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "answers.txt").write_text("secret")
    wall.readable.append(str(course))
    code = f"""
import os, pathlib, sys, zerokit
sys.path.insert(0, {str(course)!r})
import module
print("module", module.VALUE)
print("zerokit", zerokit.__file__)
try:
    (pathlib.Path({str(course)!r}) / "x").write_text("x")
    print("course write: done")
except OSError as exc:
    print("course write: failed", type(exc).__name__)
pathlib.Path("note.txt").write_text("mine")
print("scratch write: done")
print("hidden visible:", os.path.exists({str(tmp_path / 'hidden' / 'answers.txt')!r}))
"""
    done = _run(wall, code, cwd=wall.writable[0])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "module 42" in lines
    assert any(line.startswith("zerokit ") for line in lines)
    assert "course write: failed OSError" in lines or "course write: failed PermissionError" in lines
    assert "scratch write: done" in lines and (tmp_path / "scratch" / "work" / "note.txt").read_text() == "mine"
    assert "hidden visible: False" in lines


def test_a_readable_bind_that_would_show_a_hidden_folder_is_refused(tmp_path):
    scratch = tmp_path / "scratch"
    (scratch / "work").mkdir(parents=True)
    with pytest.raises(sandbox.SandboxUnavailable, match="must not see"):
        sandbox.Wall(scratch, hidden=[sys.prefix + "/lib"])
