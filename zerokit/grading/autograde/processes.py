"""Process tagging: a grading run leaves no process behind.

Every process grading starts (the kernel, zerokit's fork server and ranks) carries a tag in
its environment, "<run>/<student>/<lesson>"; when the notebook is done, any tagged process
still alive is killed, so a hanging or crashing submission leaves nothing behind. A tag in
the environment, rather than the grader's process group alone: children inherit it across
setsid and double forks, which take a process out of that group.
"""

from __future__ import annotations

import os

import psutil

TAG = "ZEROKIT_GRADING_TAG"  # environment variable every process of a grading run inherits


def tagged_processes(prefix):
    """Live processes whose environment carries a grading tag starting with `prefix`."""
    found = []
    for p in psutil.process_iter():
        try:
            tag = p.environ().get(TAG)
            if tag is not None and tag.startswith(prefix) and p.pid != os.getpid() \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def kill_tagged(prefix, grace=3.0):
    """Kill every process tagged `prefix*` still alive after `grace` s; describe each one killed.

    The grace lets a fork server whose kernel just shut down see EOF and exit by itself.
    """
    killed = []
    psutil.wait_procs(tagged_processes(prefix), timeout=grace)
    for _ in range(5):  # a dying parent may fork once more: sweep until nothing is left
        procs = tagged_processes(prefix)
        if not procs:
            break
        for p in procs:
            try:
                killed.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
    return killed
