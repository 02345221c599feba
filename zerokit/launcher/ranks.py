"""The launching process's view of each rank, read from the files the rank leaves in RUN_DIR.

A worker writes rank<r>.pid first, its output to rank<r>.out as it runs, a stack dump to
rank<r>.stack when asked (SIGUSR1), and rank<r>.result last (see worker.py). Polling these
files is the whole conversation: it works the same whether torchrun or the fork server
started the rank.
"""

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

from .processes import alive, rss


@dataclass
class Rank:
    rank: int
    dir: Path
    pid: int | None = None
    result: tuple | None = None  # ("ok", value) or ("error", info-dict)
    printed: int = 0  # bytes of the output file already echoed
    peak_rss: int = 0

    def file(self, suffix):
        return self.dir / f"rank{self.rank}.{suffix}"


def read_text(path):
    """The file's text, or "" if it does not exist (yet)."""
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def update(ranks, echo):
    """Read what is new: pids, results, memory, and (if `echo`) the lines the ranks printed."""
    for r in ranks:
        if r.pid is None and r.file("pid").exists():
            try:
                r.pid = int(r.file("pid").read_text())
            except ValueError:
                pass  # half-written; next poll
        if r.result is None and r.file("result").exists():
            r.result = cloudpickle.loads(r.file("result").read_bytes())
        if r.pid:
            r.peak_rss = max(r.peak_rss, rss(r.pid))
        if echo:
            _echo_new_lines(r, echo)


def _echo_new_lines(r, echo):
    # On stdout, each line prefixed with its rank: nbgrader fails a cell that writes to stderr.
    path = r.file("out")
    try:
        with open(path, "rb") as f:
            f.seek(r.printed)
            chunk = f.read()
    except FileNotFoundError:
        return
    end = chunk.rfind(b"\n") + 1  # only complete lines; the rest waits for the next poll
    if r.result is not None or r.pid is None or not alive(r.pid):
        end = len(chunk)
    if end:
        text = chunk[:end].decode(errors="replace")
        if callable(echo):  # the caller shows the lines its own way (a progress bar)
            for line in text.splitlines():
                echo(r.rank, line)
        else:
            sys.stdout.write("".join(f"[rank {r.rank}] {line}\n" for line in text.splitlines()))
            sys.stdout.flush()
        r.printed += end


def wait_for(cond, seconds, poll):
    """Call `poll` until `cond()` holds or `seconds` have passed."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not cond():
        time.sleep(0.02)
        poll()


def dump_stacks(ranks):
    """Ask each unfinished rank for its Python stack (faulthandler answers even mid-collective)."""
    asked = [r for r in ranks if r.result is None and alive(r.pid)]
    for r in asked:
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    wait_for(lambda: all(r.file("stack").exists() and r.file("stack").stat().st_size > 0 for r in asked),
             2.0, lambda: None)
    time.sleep(0.1)  # let the dump finish writing
