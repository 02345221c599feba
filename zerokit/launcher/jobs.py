"""The two ways to start a job's ranks, behind one interface.

    job.start(ranks)      start every rank (raises LaunchError if it cannot)
    job.done(ranks)       whether every rank has exited
    job.kill(ranks)       stop whatever is left, and everything the ranks started
    job.exit_code(rank)   a rank's exit status, once it has one
    job.log()             what the launcher itself printed

Both run the same worker (worker.py) with the same RUN_DIR; only the way the processes
come to exist differs.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import forkclient
from .errors import LaunchError
from .processes import kill_groups, signal_group
from .ranks import read_text


def pythonpath():
    """PYTHONPATH for child processes: this package first, so `-m zerokit.launcher.worker` resolves."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


class TorchrunJob:
    """torchrun --standalone --nproc-per-node N -m zerokit.launcher.worker RUN_DIR

    The real tool, the one that also spans machines; it costs an agent process and one
    `import torch` per rank (seconds).
    """

    def __init__(self, run_dir, world_size, worker_env):
        self.run_dir, self.world_size = run_dir, world_size
        self.env = {**os.environ, **worker_env}  # PYTHONSAFEPATH=1 among them: the ranks' -m too
        self.agent = None

    def start(self, ranks):
        cmd = [
            # -P and a neutral folder: see forkclient.server (a planted package must not shadow ours)
            sys.executable, "-P", "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={self.world_size}", "--max-restarts=0",
            "--monitor-interval=0.1",
            "-m", "zerokit.launcher.worker", str(self.run_dir),
        ]
        with open(self.run_dir / "launcher.log", "wb") as log:
            try:
                self.agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                              start_new_session=True, cwd=forkclient.NEUTRAL_CWD)
            except OSError as exc:
                raise LaunchError(f"torchrun could not be started: {exc}") from exc

    def done(self, ranks):
        return self.agent.poll() is not None

    def kill(self, ranks):
        if self.agent is None:  # start() failed: nothing to stop, and its error must surface
            return
        # SIGTERM lets the agent stop its workers; then SIGKILL every process group,
        # the workers' too: torchrun starts each worker in a session of its own.
        if self.agent.poll() is None:
            signal_group(self.agent.pid, signal.SIGTERM)
            try:
                self.agent.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        kill_groups([self.agent.pid] + [r.pid for r in ranks if r.pid])
        try:
            self.agent.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def exit_code(self, r):
        # torchrun's failure summary has one block per failed rank: "rank : 1 ... exitcode : 7"
        for block in re.split(r"\n\[\d+\]:", self.log()):
            rank = re.search(r"^\s*rank\s*:\s*(\d+)", block, re.M)
            code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", block, re.M)
            if rank and code and int(rank.group(1)) == r.rank:
                return int(code.group(1))
        return None

    def log(self):
        return read_text(self.run_dir / "launcher.log")


class ForkedJob:
    """Ranks forked from the fork server (forkclient.py, forkserver.py); rendezvous through a file in RUN_DIR."""

    def __init__(self, run_dir, world_size, worker_env):
        self.run_dir, self.world_size = run_dir, world_size

    def start(self, ranks):
        try:
            server = forkclient.server(pythonpath())
        except RuntimeError as exc:
            raise LaunchError(str(exc)) from exc
        try:
            for r in ranks:
                r.pid = server.fork(self.run_dir, r.rank, self.world_size)
        except (OSError, ValueError) as exc:  # the server died: a broken pipe, or EOF ("")
            raise LaunchError(f"the zerokit fork server stopped answering: {exc!r}{server.stderr_tail()}") from exc

    def done(self, ranks):
        return all(r.result or r.file("exit").exists() for r in ranks)

    def kill(self, ranks):
        started = [r for r in ranks if r.pid]
        kill_groups([r.pid for r in started])
        # kill_groups counts a zombie as dead, but the fork server writes rank<r>.exit only
        # once it has reaped the child: wait for that, or the write lands in a run dir that
        # rmtree is removing and the dir is left behind in /tmp.
        end = time.monotonic() + 5
        while time.monotonic() < end and not all(r.file("exit").exists() for r in started):
            time.sleep(0.01)

    def exit_code(self, r):
        text = read_text(r.file("exit")).strip()
        return int(text) if text else None

    def log(self):
        return ""


JOBS = {"torchrun": TorchrunJob, "forkserver": ForkedJob}
