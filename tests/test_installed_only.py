"""Checks run on installed code only: safe-path mode in every process, and the harness's
verification that zerokit, torch and the rest were loaded from their installed files.

A module planted where a check's process would look first (the notebook's folder, a folder a
cell put on sys.path) must never stand in for the installed one; if one gets loaded all the
same, the check fails and its message names the module and where it came from.
"""

import os
import sys
import tempfile

import pytest

from conftest import fails, run_ranks
from zerokit.grading.harness import run_on_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _where_am_i(rank, world_size):
    return sys.flags.safe_path, os.getcwd()


def test_ranks_run_in_safe_path_mode_in_the_callers_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_where_am_i, 2) == [(True, str(tmp_path))] * 2


def test_a_checks_ranks_work_outside_the_notebooks_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = run_on_ranks(_where_am_i, 2, forbid_adam=False)
    assert results == [(True, tempfile.gettempdir())] * 2


def _imports_a_planted_module(rank, world_size, folder):
    sys.path.insert(0, folder)  # what a student's code could do inside a check
    import pandocfilters  # noqa: F401  (installed, never loaded in a rank: the planted one is found first)

    return True


def test_a_check_that_ran_on_a_planted_module_fails_naming_it(tmp_path):
    (tmp_path / "pandocfilters.py").write_text("PLANTED = True\n")
    message = fails(run_on_ranks, _imports_a_planted_module, 2, (str(tmp_path),), forbid_adam=False,
                    match="not the installed `pandocfilters`")
    assert str(tmp_path / "pandocfilters.py") in message, message
