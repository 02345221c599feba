"""A notebook kernel whose fork server is forked from it before the kernel starts: one `import torch` for both.

    python -P -m zerokit.launcher.preforked -f kernel.json    # instead of -m ipykernel_launcher

The grader starts every notebook's kernel this way (grading/autograde/kernel.py). A kernel
otherwise imports torch in its first cell, and its first launch starts a fork server that
imports torch again: two imports of about 2 s of CPU each, per graded notebook, on a
machine that grades several notebooks at a time and is bound by its cores. Here torch is
imported once, before ipykernel starts any thread, and the process forks: the child becomes
the fork server (forkserver.main, talking over two pipes instead of stdin and stdout), the
parent becomes the kernel and leaves the server's handle where forkclient.server() finds it.
The child has run no torch operation and holds no thread, as a server started by
forkclient would; the kernel's first launch then only waits for its "ready" line.
"""

import os
import sys
import tempfile

import torch  # noqa: F401  (the point: imported once, before the fork, for both sides)
import torch.distributed  # noqa: F401


def _serve(requests, answers, stderr, kernel_ends):
    """In the child: become the fork server, reading requests on fd 0, answering on fd 1."""
    os.setsid()  # a process group of its own, as forkclient's servers (ForkServer.stop kills the group)
    os.dup2(requests, 0)
    os.dup2(answers, 1)
    os.dup2(stderr, 2)
    for fd in (requests, answers, *kernel_ends):  # holding the kernel's write end, it would never see EOF
        os.close(fd)
    from . import forkserver

    forkserver.main()  # ends with os._exit


def main():
    stderr = tempfile.TemporaryFile()  # unnamed, as forkclient's: the kernel reads its tail on errors
    requests_r, requests_w = os.pipe()  # not inheritable: the kernel's subprocesses do not hold them
    answers_r, answers_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _serve(requests_r, answers_w, stderr.fileno(), (requests_w, answers_r))
        finally:
            os._exit(70)
    os.close(requests_r)
    os.close(answers_w)
    from . import forkclient

    forkclient.adopt(pid, requests_w, answers_r, stderr)
    from ipykernel import kernelapp  # what `python -m ipykernel_launcher` runs

    kernelapp.launch_new_instance()


if __name__ == "__main__":
    main()
