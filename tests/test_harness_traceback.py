"""What a student sees when a check fails: the reason first, then their own line.

In JupyterLab (and nbconvert, nbclient, nbmake) a failing check is an exception in a
notebook cell, and IPython prints its traceback: by default the grader harness's frames
(run_on_ranks, the line that raises CheckFailed) come before the one-line reason, which
sits at the very bottom. CheckFailed renders itself instead: the reason, then the line of
the student's notebook that ran the check; the grader's frames are left out. A check that
ran on one process does not speak of ranks, and a rank is named once.
"""

import json
import sys

import cloudpickle
import nbformat
import pytest
import torch
from nbclient import NotebookClient

from zerokit.grading.compare import assert_close
from zerokit.grading.harness import CheckFailed, run_on_ranks

pytestmark = pytest.mark.distributed

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _differs(rank, world_size):
    """The last rank's thing differs."""
    assert_close(torch.zeros(3) + float(rank == world_size - 1), torch.zeros(3), "the thing")


@pytest.mark.timeout(60)
def test_one_process_checks_do_not_speak_of_ranks_and_a_rank_is_named_once():
    with pytest.raises(CheckFailed) as one:
        run_on_ranks(_differs, 1)
    assert "rank" not in str(one.value), str(one.value)
    with pytest.raises(CheckFailed) as two:
        run_on_ranks(_differs, 2)
    assert str(two.value).count("rank 1") == 1, str(two.value)


def _failing(message):
    def inner():
        __tracebackhide__ = True
        raise CheckFailed(message)

    try:
        inner()
    except CheckFailed as exc:
        return exc


def test_the_rendered_traceback_starts_with_the_reason():
    stb = _failing("your step is wrong: do it right\n  (details)")._render_traceback_()
    assert "CheckFailed" in stb[0] and "your step is wrong: do it right" in stb[0]
    assert "(details)" in stb[1]
    # the frame that raised hides itself (as the harness's do); the code that called it is shown
    assert not any("raise CheckFailed" in line for line in stb), stb
    assert any("inner()" in line for line in stb[2:]), stb


CELLS = [
    'import os\nos.environ["ZEROKIT_LAUNCHER"] = "forkserver"\nimport torch\nimport torch.distributed as dist\n'
    "from zerokit.grading import lesson00",
    "def my_all_reduce(t):\n    raise ValueError('boom')\n",
    "x = 1\nlesson00.check_numerics(my_all_reduce, world_size=2, sizes=[8, 7])",
]


@pytest.mark.timeout(120)
def test_in_a_notebook_the_reason_and_the_students_line_come_first(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in CELLS]
    NotebookClient(nb, timeout=90, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for o in nb.cells[-1].outputs if o.output_type == "error"]
    assert len(errors) == 1, json.dumps(nb.cells[-1].outputs, indent=1)
    tb = errors[0]["traceback"]
    text = "\n".join(tb)
    assert "CheckFailed" in tb[0] and "your code raised ValueError: boom" in tb[0], text
    assert "harness.py" not in text and "lesson00.py" not in text, text
    # the student's own line: the cell and the call that ran the check, after the reason
    student = [i for i, line in enumerate(tb) if "lesson00.check_numerics(my_all_reduce" in line]
    assert student and student[0] > 0, text
    assert "In[3]" in text and "line 2" in text, text
