"""The launching side of the fork server (forkserver.py): start it, wait until it is ready, ask it for ranks.

One server per Python process (a notebook kernel, a pytest run): the first forked launch
starts it, which takes a few seconds (it imports torch), and every later launch reuses it.
It needs no stopping: it reads its requests from a pipe, and when this process ends the
pipe closes and the server exits.
"""

import os
import select
import signal
import subprocess
import sys
import tempfile
import time

SERVER_MODULE = "zerokit.launcher.forkserver"

# Seconds a new server may take to say "ready". Importing torch on a loaded 2-core machine
# takes several; a server that says nothing for this long is stuck, and waiting longer
# would only leave a notebook cell hanging without a word.
READY_WITHIN = 90.0

# Where the server (and so each rank, until it moves to the caller's folder to run fn) works:
# a folder that exists everywhere, the grading sandbox included, and holds no one's modules.
NEUTRAL_CWD = "/"

# How much of the server's stderr an error message quotes.
_TAIL_BYTES = 4000


class ForkServer:
    """A running fork server: `fork(run_dir, rank, world_size)` starts a rank and returns its pid."""

    def __init__(self, process, stderr):
        self.process = process  # subprocess.Popen, text pipes on its stdin and stdout
        self.stderr = stderr  # the file its stderr goes to (see start)
        self.ready = True  # False for a server adopted before it said "ready" (see wait_ready)

    @property
    def pid(self):
        return self.process.pid

    @classmethod
    def start(cls, command, env, ready_within=READY_WITHIN, cwd=None):
        """Run `command` (in `cwd`) and wait for its "ready" line; RuntimeError, with its stderr, if none comes."""
        # Its stderr goes to a file, so that a server that fails can say why: not a pipe (no one
        # reads it while the server runs, and a full pipe would block the server), not
        # /dev/null. The file is unnamed: it vanishes with the last process holding it open,
        # even if this one is killed, so nothing is ever left in /tmp.
        stderr = tempfile.TemporaryFile()
        try:
            process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                env=env, text=True, start_new_session=True, cwd=cwd,
            )
        except OSError as exc:
            stderr.close()
            raise RuntimeError(f"the zerokit fork server could not be started: {exc}") from exc
        server = cls(process, stderr)
        try:
            line = server._first_line(ready_within)
        except BaseException:  # an interrupted cell: no half-started server left behind
            server.stop()
            raise
        if line == "ready":
            return server
        if line is None:
            why = f"did not say it was ready within {ready_within:g} s"
        else:
            try:
                code = process.wait(timeout=5)
                why = f"exited (exit code {code}) before it was ready"
            except subprocess.TimeoutExpired:
                why = f"answered {line!r} instead of 'ready'"
        tail = server.stderr_tail()
        server.stop()
        raise RuntimeError(f"the zerokit fork server {why}{tail}")

    def _first_line(self, seconds):
        """The server's first line of output without its newline; "" at EOF, None if too slow.

        Read straight from the pipe one byte at a time, so that nothing after the line is
        taken out of the pipe (the pid answers that come later are read with readline).
        """
        fd = self.process.stdout.fileno()
        line = b""
        end = time.monotonic() + seconds
        while not line.endswith(b"\n"):
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            byte = os.read(fd, 1)
            if not byte:  # EOF: it exited
                return line.decode(errors="replace").strip()
            line += byte
        return line.decode(errors="replace").strip()

    def fork(self, run_dir, rank, world_size):
        """Start one rank; OSError or ValueError if the server has died."""
        self.process.stdin.write(f"{run_dir} {rank} {world_size}\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())  # "" from a dead server: ValueError

    def running(self):
        return self.process.poll() is None

    def wait_ready(self, ready_within=READY_WITHIN):
        """For a server this process forked (adopt): read its "ready" line, once; RuntimeError if none comes."""
        if self.ready:
            return
        line = self._first_line(ready_within)
        if line != "ready":
            why = f"answered {line!r} instead of 'ready'" if line else "did not say it was ready"
            raise RuntimeError(f"the zerokit fork server {why}{self.stderr_tail()}")
        self.ready = True

    def stderr_tail(self):
        """The end of what the server wrote to stderr, as lines to append to a message; "" if nothing."""
        try:
            size = os.fstat(self.stderr.fileno()).st_size
            # pread, not seek + read: the server shares this file's offset and writes at it
            data = os.pread(self.stderr.fileno(), _TAIL_BYTES, max(0, size - _TAIL_BYTES))
        except (OSError, ValueError):  # closed
            return ""
        text = data.decode(errors="replace").strip()
        return f"; its stderr ends with:\n{text}" if text else ""

    def stop(self):
        """Kill the server (a process group of its own) and release its pipes and file."""
        # Only while it is unreaped: once reaped, its pid may already belong to another process.
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()
        for f in (self.process.stdin, self.process.stdout, self.stderr):
            try:
                f.close()
            except OSError:  # a broken pipe while flushing: nothing left to tell a dead server
                pass


class _Forked:
    """What ForkServer needs of a subprocess.Popen, for a server this process forked itself."""

    def __init__(self, pid, stdin, stdout):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None

    def poll(self):
        return self._reap(os.WNOHANG)

    def wait(self, timeout=None):
        return self._reap(0)

    def _reap(self, flags):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped by someone else: gone all the same
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


# ---- one server per Python process ----------------------------------------------------
# Why the handle is not simply a global of this module: the notebooks' hidden test cells
# delete every zerokit.grading.* and zerokit.launcher.* module from sys.modules and import
# them again, to undo anything the student's code did to them. A global here would be lost
# with the old module: the next launch would start a second server, and the first would
# live on, unreachable, until the kernel exits. The package `zerokit` itself is never
# deleted (everything else hangs from it), so the handle is kept there, under a name no
# other module uses. (Reaching into the parent package this way reads it from sys.modules,
# where it always is by now: importing zerokit.launcher imported zerokit first.)
_HANDLE = "_launcher_fork_server"


def adopt(pid, requests_fd, answers_fd, stderr):
    """Make the server this process forked (preforked.py) this process's fork server."""
    process = _Forked(pid, open(requests_fd, "w"), open(answers_fd, "r"))
    server = ForkServer(process, stderr)
    server.ready = False  # its "ready" line is read at the first launch (wait_ready)
    setattr(sys.modules["zerokit"], _HANDLE, server)


def running_server():
    """The fork server of this Python process if it is running, else None."""
    kept = getattr(sys.modules["zerokit"], _HANDLE, None)
    return kept if kept is not None and kept.running() else None


def server(pythonpath):
    """The fork server of this Python process, started on first use (and again if it died)."""
    current = running_server()
    if current is None:
        dead = getattr(sys.modules["zerokit"], _HANDLE, None)
        if dead is not None:
            dead.stop()  # reaped already; this closes its pipes and stderr file
        # Safe-path mode (-P) and a working directory of no one's: `-m` would otherwise put the
        # caller's folder first on sys.path, and a package named zerokit (or torch) planted beside
        # a notebook would be imported instead of the installed one, in the server and every rank.
        command = [sys.executable, "-P", "-m", SERVER_MODULE]
        env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONSAFEPATH": "1"}
        current = ForkServer.start(command, env, cwd=NEUTRAL_CWD)
        setattr(sys.modules["zerokit"], _HANDLE, current)
    try:
        current.wait_ready()
    except BaseException:
        current.stop()
        raise
    return current
