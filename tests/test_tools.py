"""The instructor's tools: make's install stamps, and tools/notebook.py's text round trip."""

import difflib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _clone(dest):
    """What `make setup` reads of a checkout: the Makefile and pyproject.toml, freshly written."""
    dest.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, dest / name)
    return dest


def test_make_installs_again_only_when_pyproject_or_the_checkout_changes(tmp_path):
    # A virtual environment whose python does nothing: `make setup` then only runs its recipes
    # and leaves its stamps, which is what this test is about (no pip, no network).
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    first, second = _clone(tmp_path / "first"), _clone(tmp_path / "second")

    def make(clone, *args):
        return subprocess.run(["make", "-s", *args, f"VENV={venv}"], cwd=clone, capture_output=True, text=True)

    def up_to_date(clone):
        return make(clone, "-q", "setup").returncode == 0

    assert make(first, "setup").returncode == 0
    assert up_to_date(first)
    later = time.time() + 3600  # a fresh clone: its files newer than any stamp
    os.utime(first / "pyproject.toml", (later, later))
    os.utime(first / "Makefile", (later, later))
    assert up_to_date(first), "file times alone made make install again"
    # a second checkout sharing the venv: the editable install must point at it, once
    assert not up_to_date(second)
    assert make(second, "setup").returncode == 0
    assert up_to_date(second)
    assert not up_to_date(first)  # and back: the venv now holds the second checkout's install
    make(first, "setup")
    (first / "pyproject.toml").write_text((first / "pyproject.toml").read_text() + "\n# a new dependency\n")
    assert not up_to_date(first), "a changed pyproject.toml must install again"


def _notebook_tool(*args):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "notebook.py"), *map(str, args)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_notebook_text_round_trip_keeps_cell_ids(tmp_path):
    notebook, text = tmp_path / "03_zero1.ipynb", tmp_path / "03_zero1.py"
    shutil.copy(ROOT / "solutions" / "03_zero1" / "03_zero1.ipynb", notebook)
    original = notebook.read_text()
    _notebook_tool("to-py", notebook, text)
    _notebook_tool("to-ipynb", text, notebook)
    assert notebook.read_text() == original
    edited = text.read_text().replace("def shard_range(numel, world_size, rank):",
                                      "def shard_range(numel, world_size, rank):  # edited", 1)
    assert edited != text.read_text()
    text.write_text(edited)
    _notebook_tool("to-ipynb", text, notebook)
    diff = [line for line in difflib.unified_diff(original.splitlines(), notebook.read_text().splitlines(), n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(diff) == 2, diff  # the one line, out and in
