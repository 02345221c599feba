"""One (student, lesson), graded in a process of its own forked from the driver.

The grader is forked, not spawned: nbgrader (and everything it pulls in) is imported once,
in the driver, and each child starts grading at once; nothing is pickled or looked up by
module path. The child autogrades the notebook with nbgrader, then makes its feedback HTML,
and writes the outcome as JSON for the driver (pool.py). It leads a process group of its
own, writes everything to its log, and tags its environment (processes.py), which the
kernel and everything it starts inherit. It is a child subreaper: whatever the notebook
started and orphaned is re-parented to it, and killed before it exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from nbgrader.converters import Autograde, GenerateFeedback

from .course import course_config, run_app
from .processes import TAG, kill_descendants, set_subreaper


def _grade_one(spec):
    """In the forked grader: autograde one notebook, then its feedback; write the outcome as JSON."""
    cfg = course_config(spec["course_dir"], spec["submissions"], spec["out"], spec["options"], spec["settings"])
    result = {"feedback": False}
    result["autograde"], log = run_app(Autograde, cfg, spec["lesson"], spec["student"], force=True,
                                    create_student=True)
    print(log, flush=True)
    if result["autograde"]:
        result["feedback"], log = run_app(GenerateFeedback, cfg, spec["lesson"], spec["student"], force=True)
        print(log, flush=True)
    Path(spec["result"]).write_text(json.dumps(result))


def _exit_with_parent(parent):
    """A grader whose driver is gone exits; its kernel (ipykernel watches its parent), the
    fork server (EOF) and the ranks (they watch the kernel) follow."""
    while os.getppid() == parent:
        time.sleep(1.0)
    kill_descendants()
    os._exit(1)


class Job:
    """One (student, lesson), graded in a forked child that leads a process group of its own."""

    def __init__(self, student, lesson, spec, log_path, tag):
        self.student, self.lesson, self.spec, self.log_path, self.tag = student, lesson, spec, log_path, tag
        self.pid = self.status = self.started = None
        self.overlapped = False  # another notebook was being graded at some time while this one was
        self.alone = False  # graded with nothing else running (after the grader's files were found changed)

    def start(self, check_caps, scratch_root):
        """Fork the grader. Its temporary files (the kernel's scratch folder among them) go in a
        folder of its own under `scratch_root`, which cleanup() removes even if the grader was killed."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        Path(self.spec["result"]).unlink(missing_ok=True)
        # no names in the path: the kernel's unix sockets live below it, and those paths are
        # limited to 107 bytes
        self.scratch = tempfile.mkdtemp(dir=scratch_root)
        sys.stdout.flush()
        sys.stderr.flush()
        self.started = time.monotonic()
        self.pid = os.fork()
        if self.pid:
            return
        code = 1
        try:  # the child: never returns into the caller's code
            os.setsid()
            set_subreaper()
            tempfile.tempdir = self.scratch
            threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            # the caller's sys.stdout may be a capture object (pytest's): write to the log itself
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.environ[TAG] = self.tag  # the kernel and everything it starts inherit it
            # and the scratch folder as theirs: what a killed kernel leaves (a launch's run folder)
            # goes with it, instead of staying in the instructor's $TMPDIR (behind the wall the
            # kernel has a private /tmp anyway)
            os.environ["TMPDIR"] = self.scratch
            os.environ.update(check_caps)  # the harness reads them: caps on each check's time and memory
            _grade_one(self.spec)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            try:
                strays = kill_descendants(grace=3.0)  # the grace: a fork server exits by itself on EOF
                if strays:
                    print(f"killed {len(strays)} process(es) the notebook left: {', '.join(strays)}")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def cleanup(self):
        """Remove the grader's temporary folder (once it has stopped)."""
        if getattr(self, "scratch", None):
            shutil.rmtree(self.scratch, ignore_errors=True)

    def reset(self):
        """Ready to be started again (graded again alone, see pool.py)."""
        self.pid = self.status = self.started = None
        self.overlapped = False

    def killed_by(self):
        """The signal that ended the grader, if one did (a notebook may kill its grader without the wall)."""
        if self.status is not None and os.WIFSIGNALED(self.status):
            return signal.Signals(os.WTERMSIG(self.status)).name
        return None

    def running(self):
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is None

    def kill(self):
        """Stop a grader still running (only then: a reaped child's group id may be reused)."""
        if self.running():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.status = os.waitpid(self.pid, 0)[1]
