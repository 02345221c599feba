"""GradingExecute: nbgrader's Execute preprocessor, made to survive a bad submission.

It replaces Execute in Autograde's preprocessors (course.py):
- a short timeout for the student's own cells (an endless loop is interrupted and grading
  goes on), the full one for test cells (whose checks have their own, shorter ones;
  --check-timeout caps those);
- a kernel that dies (os._exit, a crash, over the memory limit) costs only the cells from
  there on, marked "not run";
- the one-line reason of every failed test cell (reasons.py) goes first in its output,
  where the feedback puts it in front of the student;
- the kernel (kernel.py) runs in safe-path mode in a scratch copy of the notebook's folder,
  behind bubblewrap (sandbox.py) unless `sandbox` is turned off on purpose (--no-sandbox);
- a measurement cell (its first line is MEASUREMENT) is not run: no grade reads what it
  computes (the lessons' measured tables, figures and try-it runs), and about half of a
  whole notebook's grading time went to such cells. A student sees which cells they are.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import psutil
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat.v4 import new_output
from nbgrader import utils
from nbgrader.preprocessors import Execute
from traitlets import Bool, Float, Integer

from ..lessons import SOLUTIONS
from . import sandbox as walls
from .kernel import GradingKernelManager
from .reasons import failure_reason, note


MEASUREMENT = "# measurement: not run while grading"


def is_measurement(cell):
    """A code cell that only measures or shows (its first line says so): grading skips it."""
    return cell.cell_type == "code" and not utils.is_grade(cell) and \
        cell.source.lstrip().split("\n", 1)[0].strip() == MEASUREMENT


def _error_output(ename, evalue):
    return new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


class GradingExecute(Execute):
    """nbgrader's Execute with per-cell timeouts, a memory watchdog and one-line reasons."""

    cell_timeout = Integer(
        60, help="Seconds a cell that is not a test cell may run before the kernel is interrupted."
    ).tag(config=True)
    memory_limit_gb = Float(4.0, help="The kernel is killed beyond this resident memory (GiB).").tag(config=True)
    child_memory_limit_gb = Float(
        8.0, help="A process the kernel started is killed beyond this resident memory (GiB); above the "
                  "4 GiB per rank of zerokit's checks, so that a check reports first."
    ).tag(config=True)

    sandbox = Bool(
        True, help="Run each kernel (and all it starts) behind bubblewrap: read-only course, no network, a PID "
                   "namespace of its own. False only when chosen (--no-sandbox); a missing bwrap is an error."
    ).tag(config=True)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("kernel_manager_class", GradingKernelManager)
        super().__init__(*args, **kwargs)
        self.timeout_func = self._timeout_for
        self._scratch = None

    def _timeout_for(self, cell):
        return self.timeout if utils.is_grade(cell) and utils.is_locked(cell) else self.cell_timeout

    def preprocess(self, nb, resources=None, km=None):
        self._dead = None  # why the remaining cells cannot run
        self._memory_kill = None
        self._watch_stop = threading.Event()
        self._watcher = None
        folder = (resources or {}).get("metadata", {}).get("path") or os.getcwd()
        self._scratch = tempfile.mkdtemp(prefix="zerokit-grading-")
        try:
            walls.scratch_copy(folder, os.path.join(self._scratch, "work"))
            os.mkdir(os.path.join(self._scratch, "kernel"), 0o700)
            self._wall = None
            if self.sandbox:
                walls.probe_once()
                # hidden: what a read-only bind of this Python or zerokit must not drag in with it
                self._wall = walls.Wall(self._scratch, hidden=[SOLUTIONS, folder, Path.home()])
            return super().preprocess(nb, resources, km)
        finally:
            self._watch_stop.set()
            shutil.rmtree(self._scratch, ignore_errors=True)  # what the kernel wrote goes with it

    def create_kernel_manager(self):
        km = super().create_kernel_manager()
        if isinstance(km, GradingKernelManager):
            km.wall, km.socket_dir = self._wall, os.path.join(self._scratch, "kernel")
            km.workdir = os.path.join(self._scratch, "work")
        return km

    def _kernel_pid(self):
        if isinstance(self.km, GradingKernelManager):
            return self.km.kernel_pid()
        return getattr(getattr(self.km, "provisioner", None), "pid", None)

    def _watch(self):
        """Kill the kernel, or a process it started, that outgrows its memory limit.

        The kernel's pid is looked up here, again until found: behind the wall it is a process
        below bwrap, which may not be listed yet when the first cell starts.
        """
        kernel = None
        while not self._watch_stop.wait(0.1):
            try:
                if kernel is None or not kernel.is_running():
                    pid = self._kernel_pid()
                    if pid is None:
                        continue
                    kernel = psutil.Process(pid)
                procs = [kernel] + kernel.children(recursive=True)
            except psutil.Error:
                kernel = None
                continue
            for p in procs:
                limit = self.memory_limit_gb if p.pid == kernel.pid else self.child_memory_limit_gb
                try:
                    rss = p.memory_info().rss
                    if rss > limit * 2**30:
                        p.kill()
                        if p.pid == kernel.pid:
                            self._memory_kill = (f"the kernel (the Python process running your notebook) used "
                                                 f"{rss / 2**30:.1f} GiB of memory, over the {limit:g} GiB limit, "
                                                 "and was stopped")
                except psutil.Error:
                    continue

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type != "code" or not cell.source.strip():
            return cell, resources
        if is_measurement(cell):
            cell.outputs = [new_output("stream", name="stdout",
                                       text="(not run while grading: a measurement cell, which no grade reads)\n")]
            return cell, resources
        if self._dead:
            cell.outputs = [_error_output("NotRun", f"not run: {self._dead}")]
            return self._annotate(cell), resources
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True)
            self._watcher.start()
        limit = self._timeout_for(cell)
        # nbclient interrupts the kernel on a timeout and records this as the cell's error
        self.error_on_timeout = {
            "ename": "CellTimeout",
            "evalue": f"this cell did not finish within {limit} s and was interrupted (an endless loop?)",
            "traceback": [f"CellTimeout: this cell did not finish within {limit} s and was interrupted"],
        }
        try:
            cell, resources = super().preprocess_cell(cell, resources, index)
        except DeadKernelError:
            why = self._memory_kill or ("the kernel (the Python process running your notebook) died while "
                                        "running this cell: os._exit(), exit(), a crash, or out of memory")
            cell.outputs.append(_error_output("KernelDied", why))
            self._dead = f"the kernel died in an earlier cell: {why}"
        except CellTimeoutError:  # the interrupt did not stop it: nothing more can run here
            pid = self._kernel_pid()
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            cell.outputs.append(_error_output(
                "CellTimeout", f"this cell did not finish within {limit} s and did not stop when interrupted"))
            self._dead = "an earlier cell never finished"
        return self._annotate(cell), resources

    def _annotate(self, cell):
        """Put the one-line reason (and a note on a restored test cell) first in a grade cell's output."""
        if not utils.is_grade(cell):
            return cell
        notes = []
        restored = cell.metadata.get("zerokit_grading", {}).get("restored")
        if restored:
            notes.append(note(f"note: this test cell was {restored} in your notebook; it was put back and "
                               "graded as originally written", "note"))
        reason = failure_reason(cell.outputs)
        if reason:
            notes.append(note(f"✗ 0 of {cell.metadata['nbgrader'].get('points', 0):g} points: {reason}", "fail"))
        for o in cell.outputs:
            if o.get("output_type") == "error":
                # the message says it all; IPython's traceback would quote the hidden tests' code
                o["traceback"] = [f"{o.get('ename', 'Error')}: {o.get('evalue', '')}"]
        cell.outputs = notes + list(cell.outputs)
        return cell
