"""Asking the OS about a process (alive? how much memory?) and stopping process groups."""

import os
import signal
import time


def alive(pid):
    """Whether `pid` is running; a zombie (exited, not yet reaped) counts as dead."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


def rss(pid):
    """Resident memory of `pid` in bytes; 0 once it has exited."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:  # the process has exited between polls
        return 0


def signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_groups(pgids):
    """SIGKILL each process group, then wait (up to 5 s) until their leaders are gone.

    Every rank runs in a session of its own, so killing its group also takes whatever
    the rank started itself.
    """
    for pgid in pgids:
        signal_group(pgid, signal.SIGKILL)
    end = time.monotonic() + 5
    while time.monotonic() < end and any(alive(p) for p in pgids):
        time.sleep(0.01)
