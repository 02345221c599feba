"""The graded checks of lessons 01 to 09 on a device, with the reference answers (gpu-check).

The checks launch the ranks they grade on, and each rank computes on `zerokit.rank_device()`: with
`ZEROKIT_DEVICE=cuda` the same checks grade numerics, memory and traffic with the ranks' tensors
on the GPU (gloo moving CUDA tensors), which `make test` never does. The answers are the instructor's
solutions: each lesson's notebook in solutions/, run as nbgrader's autograder runs it (every code
cell in order but the measurement cells, which no grade reads), with the graded cells' visible
checks only (the hidden ones repeat them on other sizes, several times the time) and without the
question cells (answers checked against digests: nothing runs on a device).
"""

import contextlib
import io
import json
import os
import re
import tempfile
import time
from pathlib import Path

from zerokit.launcher.backend import DEVICE_ENV

ROOT = Path(__file__).resolve().parents[2]
LESSONS = ("01_adam", "02_distributed_adam", "03_zero1", "04_zero2", "05_zero3", "06_mixed_precision",
           "07_checkpoints", "08_beyond_model_states", "09_muon")
MEASUREMENT = "# measurement: not run while grading"  # zerokit.grading.autograde.execute.MEASUREMENT
HIDDEN = re.compile(r"^### BEGIN HIDDEN TESTS$.*?^### END HIDDEN TESTS$\n?", re.M | re.S)


def _cells(lesson):
    """(grade_id or None, graded, source) of each code cell the autograder runs, hidden tests removed."""
    nb = json.loads((ROOT / "solutions" / lesson / f"{lesson}.ipynb").read_text())
    out = []
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.lstrip().startswith(MEASUREMENT):
            continue
        meta = cell.get("metadata", {}).get("nbgrader", {})
        source = "\n".join(line for line in HIDDEN.sub("", source).splitlines()
                           if not line.lstrip().startswith("%"))  # IPython's magics (%matplotlib inline)
        out.append((meta.get("grade_id"), bool(meta.get("grade")), source))
    return out


def run_lesson(lesson, device):
    """Run `lesson`'s solution notebook with its ranks on `device`; for each graded cell that calls a check of
    the lesson (questions aside): (grade_id, passed, the reason it failed or None, seconds)."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    namespace = {"__name__": f"lesson_{lesson}"}
    results = []
    with tempfile.TemporaryDirectory(prefix=f"zerokit-{lesson}-") as scratch:
        os.chdir(scratch)  # what a notebook writes lands in a scratch folder, as the autograder's copy
        os.environ[DEVICE_ENV] = device
        try:
            for grade_id, graded, source in _cells(lesson):
                if graded and "questions.check" in source:
                    continue
                t0 = time.perf_counter()
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        exec(compile(source, f"<{lesson}:{grade_id or 'cell'}>", "exec"), namespace)
                    failed = None
                except Exception as exc:
                    failed = (f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0])[:200]
                    if not graded:  # a definition or setup cell failed: the lesson cannot be graded
                        results.append((grade_id or "setup", False, failed, time.perf_counter() - t0))
                        break
                if graded:
                    results.append((grade_id, failed is None, failed, time.perf_counter() - t0))
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
    return results
