"""A grading run leaves no process behind: tags, and a subreaper.

Every process grading starts (the kernel, zerokit's fork server and ranks) carries a tag in
its environment, "<run>/<student>/<lesson>"; when the notebook is done, any tagged process
still alive is killed, so a hanging or crashing submission leaves nothing behind. A tag in
the environment, rather than the grader's process group alone: children inherit it across
setsid and double forks, which take a process out of that group. A process that clears its
environment loses the tag; the subreaper (below) still finds it.
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
    return _kill_until_gone(lambda: tagged_processes(prefix), grace)


def _kill_until_gone(find, grace):
    """Wait `grace` s for what find() returns to exit, then kill it; again until find() finds
    nothing (a dying parent may fork once more). Describes each process killed."""
    killed = []
    if grace:
        psutil.wait_procs(find(), timeout=grace)
    for _ in range(5):
        procs = find()
        if not procs:
            break
        for p in procs:
            try:
                killed.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)  # also reaps our own (and adopted) children
    return killed


# ---- the subreaper: what a notebook starts stays a descendant of its grader --------------
# The tag above is in the environment, which a process can clear (`env -i`, a fresh
# environment for subprocess). A subreaper (prctl PR_SET_CHILD_SUBREAPER) catches what the
# tag cannot: an orphan (a double fork, a setsid'd daemon) is re-parented to the nearest
# subreaper instead of to init, so everything a notebook started is still below its grader,
# whatever it did to its environment, session or process group. Behind the sandbox the PID
# namespace does the same job; this holds with --no-sandbox too.

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _prctl(option, value):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if option == _PR_GET_CHILD_SUBREAPER:
        out = ctypes.c_int(0)
        if libc.prctl(option, ctypes.byref(out), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_GET_CHILD_SUBREAPER)")
        return out.value
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    return value


def set_subreaper(on=True):
    """Make this process a child subreaper (Linux); return whether it was one before."""
    before = bool(_prctl(_PR_GET_CHILD_SUBREAPER, 0))
    _prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0)
    return before


def kill_descendants(keep=(), grace=0.0):
    """Kill every descendant of this process except the pids in `keep` (and theirs); describe each.

    Repeats until none is left: a dying process may fork once more.
    """
    me = psutil.Process()
    return _kill_until_gone(lambda: _descendants(me, keep), grace)


def _descendants(me, keep):
    keep = set(keep)
    found = []
    try:
        children = me.children()
    except psutil.Error:
        return found
    for child in children:
        if child.pid in keep:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                child.wait(0)  # an adopted orphan that already exited: reap it
                continue
            found.append(child)
            found += [d for d in child.children(recursive=True) if d.pid not in keep]
        except psutil.Error:
            continue
    return found
