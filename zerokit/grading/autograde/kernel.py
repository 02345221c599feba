"""GradingKernelManager: how a submission's kernel is started, with or without the wall.

nbclient starts the kernel through this manager (GradingExecute sets it up). Always:
- this Python's ipykernel in safe-path mode (`-P`, PYTHONSAFEPATH=1), whatever kernel name
  the notebook carries: the notebook's folder is never on sys.path, so a package named
  zerokit or torch beside it cannot stand in for the installed one (the fork server and the
  ranks inherit PYTHONSAFEPATH, and pass -P themselves);
- in a working copy of the notebook's folder (the scratch folder), so nothing the kernel
  writes lands where the grader writes the graded notebook and feedback.
Behind the wall (sandbox.py), also:
- the kernel protocol over unix sockets in the scratch folder: the kernel has no network
  (its namespace has only a loopback of its own), and sockets are files it can reach;
- interrupts as a message (ipykernel's interrupt_request), not a signal to the process
  group: the kernel leads a session of its own inside the wall, and the signal would reach
  only bwrap, which would take the kernel down with it.
"""

from __future__ import annotations

import os
import sys

import psutil
from jupyter_client.manager import AsyncKernelManager
from traitlets import Any, Unicode


class GradingKernelManager(AsyncKernelManager):
    """This Python's ipykernel, in safe-path mode, in the scratch folder; behind `wall` if one is given."""

    wall = Any(None, help="sandbox.Wall, or None for --no-sandbox")
    workdir = Unicode(help="where the kernel runs: the working copy of the notebook's folder")
    socket_dir = Unicode(help="where the connection file (and behind the wall the unix sockets) go")
    _kernel_argv = None  # the command line of the kernel itself, once launched

    async def _async_pre_start_kernel(self, **kw):
        # in the scratch folder, not jupyter's runtime folder: it goes with the scratch folder, even
        # when the grader is killed
        self.connection_file = os.path.join(self.socket_dir, "kernel.json")
        if self.wall is not None:
            self.transport = "ipc"
            self.cache_ports = False  # LocalPortCache binds TCP ports; ipc ports are file names
            self.ip = os.path.join(self.socket_dir, "k")  # sockets k-<port>: a unix socket path has 107 bytes
        return await super()._async_pre_start_kernel(**kw)

    def format_kernel_cmd(self, extra_arguments=None):
        # The kernel spec's argv is ignored on purpose: grading runs the course's Python, in
        # safe-path mode, whatever kernel name the notebook was saved with.
        # zerokit.launcher.preforked: ipykernel, with its fork server forked from it (one torch import)
        return [sys.executable, "-P", "-m", "zerokit.launcher.preforked", "-f", self.connection_file,
                *(extra_arguments or [])]

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        env = dict(kw.get("env") or os.environ)
        env["PYTHONSAFEPATH"] = "1"
        # JPY_PARENT_PID: ipykernel exits when its parent is not that pid, and behind the wall its
        # parent is bwrap's init (the wall's --die-with-parent does that job there)
        env.pop("JPY_PARENT_PID", None)
        kw["cwd"] = self.workdir
        self._kernel_argv = list(kernel_cmd)
        if self.wall is None:
            kw["env"] = env
        else:
            kernel_cmd = self.wall.command(kernel_cmd, env, self.workdir)
            kw["env"] = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # bwrap's own; the kernel's is set inside
        return await super()._async_launch_kernel(kernel_cmd, **kw)

    async def interrupt_kernel(self):
        if self.wall is None:
            return await super().interrupt_kernel()
        if not self.has_kernel:
            raise RuntimeError("Cannot interrupt kernel. No kernel is running!")
        self._connect_control_socket()
        self.session.send(self._control_socket, self.session.msg("interrupt_request", content={}))

    def kernel_pid(self):
        """The pid (as the grader sees it) of the Python process running the notebook, or None.

        Behind the wall the process nbclient started is bwrap, which starts another bwrap (the
        PID namespace's init; its command line holds the kernel's too); the kernel is the process
        below them whose command line is exactly the one launched.
        """
        pid = getattr(self.provisioner, "pid", None)
        if pid is None or self.wall is None or self._kernel_argv is None:
            return pid if self.wall is None else None
        try:
            for p in psutil.Process(pid).children(recursive=True):
                # the fork server, forked from the kernel (preforked.py), has its command line too
                if p.cmdline() == self._kernel_argv and p.parent().cmdline() != self._kernel_argv:
                    return p.pid
        except psutil.Error:
            pass
        return None
