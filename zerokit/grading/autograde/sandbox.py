"""The wall around a submission: its kernel, and everything the kernel starts, in bubblewrap.

A notebook's code runs with the grader's permissions; nbgrader does not isolate it. Inside
the wall (bwrap, Debian package `bubblewrap`) the kernel, zerokit's fork server and ranks,
and anything they start:
- see a filesystem built from read-only binds of what Python needs (the system's /usr, this
  Python and its site-packages, the installed zerokit package) and nothing else: not
  solutions/ (the hidden tests), lessons/, the gradebook, other submissions, feedback or
  anyone's home; they can write only to their own scratch folder and a private /tmp;
- have a network namespace of their own (a loopback for the ranks' gloo, nothing beyond):
  the kernel protocol runs over unix sockets in the scratch folder (kernel.py);
- have a PID namespace of their own: the grader's processes are invisible, so they cannot be
  signalled or traced, and when the kernel exits every process left inside is killed,
  whatever it did to its environment, session or process group;
- die with the grader (--die-with-parent), run without capabilities, in a session of their
  own, with a clean environment (no instructor secrets inherited).

Why bubblewrap, not a container runtime: one small program, no daemon, works as root and
unprivileged where user namespaces are enabled, and gives exactly these binds and
namespaces in one command.

    probe()            the bwrap version, or SandboxUnavailable saying how to get it
    Wall(...)          the command line that starts a program behind the wall
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["SandboxUnavailable", "probe", "probe_once", "Wall", "scratch_copy", "INSTALL", "NO_SANDBOX"]

INSTALL = "apt-get install bubblewrap"  # Debian/Ubuntu; other systems ship the same package name
NO_SANDBOX = "--no-sandbox"

# What the system part of the filesystem is: the usual merged-/usr layout, and files of /etc
# that programs read (users, the dynamic linker's cache, time zone). Not the whole of /etc:
# it may hold secrets, and the kernel runs as the same user as the grader.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("passwd", "group", "nsswitch.conf", "localtime", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
             "alternatives", "fonts")  # fonts: matplotlib's fontconfig writes an error to stderr without it
# The sandbox's own host name, and an /etc/hosts that resolves it: torchrun's rendezvous and gloo
# look their host name up, and with no network to ask they would retry for minutes.
HOSTNAME = "grading"
HOSTS = f"127.0.0.1\tlocalhost {HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"

# Environment variables a kernel may see from the grader's; everything else is cleared.
PASS_ENV_PREFIXES = ("NBGRADER_", "ZEROKIT_", "LC_")
PASS_ENV = ("LANG", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces here; the message says what to do."""


def _how_to_proceed(why):
    return (f"{why}. Grading runs each notebook behind a bubblewrap sandbox: install it with "
            f"`{INSTALL}` (as root), or grade without isolation by saying so: `make grade NO_SANDBOX=1` or "
            f"`python -m zerokit.grading.autograde ... {NO_SANDBOX}` (a submission's code can then change "
            "the course's files, read the hidden tests and outlive its notebook; only the integrity check "
            "and the process sweep remain)")


def probe():
    """The bwrap version line if bubblewrap can create its namespaces here; else SandboxUnavailable."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(_how_to_proceed("bubblewrap (bwrap) is not installed"))
    try:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        trial = subprocess.run([bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(_how_to_proceed(f"bwrap could not be run: {exc}")) from exc
    if trial.returncode != 0:
        raise SandboxUnavailable(_how_to_proceed(
            f"bwrap cannot create its namespaces here ({trial.stderr.strip() or f'exit code {trial.returncode}'}; "
            "are user namespaces disabled, e.g. kernel.unprivileged_userns_clone=0 or "
            "user.max_user_namespaces=0?)"))
    return version or "bwrap"


@functools.lru_cache(maxsize=1)
def probe_once():
    """probe(), once per process (a grader checks before its first kernel, not before each)."""
    return probe()


def _python_dirs():
    """Where this Python, its standard library and its packages live (read-only in the sandbox)."""
    dirs = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
            os.path.dirname(os.path.realpath(sys.executable))}
    return {os.path.realpath(d) for d in dirs if d}


def _course_dir():
    """The installed zerokit package (an editable install's is the checkout's zerokit/ alone)."""
    import zerokit

    return os.path.realpath(os.path.dirname(zerokit.__file__))


class Wall:
    """The bwrap command line for one notebook's kernel.

    scratch: the notebook's own folder on the host: its working copy (work/) and the kernel's
    sockets (kernel/) live there, the only places the code inside can write to that outlive a
    process; and the sandbox's /etc/hosts (read-only inside).
    hidden: folders that must not be visible inside (solutions/, the submissions, the course
    and output folders); building the wall fails if a read-only bind would expose one of them.
    """

    def __init__(self, scratch, hidden=()):
        self.scratch = os.path.realpath(scratch)
        self.hidden = [os.path.realpath(h) for h in hidden]
        self.readable = self._readable()
        self.writable = [os.path.join(self.scratch, d) for d in ("work", "kernel")]
        self.hosts = os.path.join(self.scratch, "hosts")
        Path(self.hosts).write_text(HOSTS)

    def _readable(self):
        paths = {p for p in SYSTEM_DIRS if os.path.lexists(p)} | _python_dirs() | {_course_dir()}
        for p in sorted(paths):
            real = os.path.realpath(p)
            for h in self.hidden:
                if h == real or h.startswith(real + os.sep):
                    raise SandboxUnavailable(
                        f"the sandbox would have to show {real} to the notebooks (it holds this Python or "
                        f"zerokit), and with it {h}, which they must not see. Keep the virtual environment and "
                        "the course's Python outside the checkout's solutions/ and the grading folders")
        return sorted(paths, key=lambda p: (p.count(os.sep), p))  # a parent before what is inside it

    def command(self, argv, env, cwd):
        """The bwrap command line that runs `argv` in `cwd` (inside the scratch folder) with `env`
        filtered to what a kernel may see."""
        args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
                "--hostname", HOSTNAME]
        # a private /tmp first: a checkout, a virtual environment or a scratch folder under /tmp
        # (a CI clone, pytest's folders) is bound on top of it below, not hidden by it
        args += ["--tmpfs", "/tmp"]
        for p in self.readable:
            if os.path.islink(p) and p in SYSTEM_DIRS:
                args += ["--symlink", os.readlink(p), p]  # /bin -> usr/bin: the same layout inside
            else:
                args += ["--ro-bind", p, p]
        for name in ETC_FILES:
            path = f"/etc/{name}"
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        args += ["--ro-bind", self.hosts, "/etc/hosts"]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm", "--dir", "/tmp/home"]
        for d in self.writable:
            args += ["--bind", d, d]
        # the root bwrap builds is a writable tmpfs: read-only, so that a write outside the
        # scratch folder and /tmp fails instead of landing in a throwaway copy
        args += ["--remount-ro", "/", "--chdir", str(cwd)]
        args += ["--clearenv"]
        for key, value in sorted(self.environment(env).items()):
            args += ["--setenv", key, value]
        return args + ["--"] + list(argv)

    def environment(self, env):
        """What the kernel's environment holds: a few of the grader's variables, and the sandbox's own."""
        kept = {k: v for k, v in env.items() if k.startswith(PASS_ENV_PREFIXES) or k in PASS_ENV}
        bindir = os.path.dirname(sys.executable)
        kept.update({
            "PATH": os.pathsep.join([bindir, "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": "/tmp/home",  # not the instructor's
            "PYTHONSAFEPATH": "1",  # no folder of the notebook's on sys.path (issue: planted packages)
            # the zerokit bound read-only here, whichever way it is installed (and the grader's own if
            # it runs from another copy through PYTHONPATH)
            "PYTHONPATH": os.path.dirname(_course_dir()),
            "PYTHONDONTWRITEBYTECODE": "1",  # the course's files are read-only here anyway
            "GLOO_SOCKET_IFNAME": "lo",  # the ranks' only network; gloo would warn looking for another
        })
        return kept


def scratch_copy(src, dest):
    """A working copy of the notebook's folder: the kernel works there, and what it writes is thrown
    away with it (the grader writes the graded notebook from outside, never into this folder)."""
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return Path(dest)
