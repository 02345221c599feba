"""launch(): run a Python callable on N ranks and hand back what each rank returned.

    results = zerokit.launch(fn, world_size=4)       # fn(rank, world_size, *args) -> value

How it works, in the order things happen:
1. `fn` and `args` are pickled *by value* with cloudpickle, so a function or class defined
   in a notebook cell reaches the workers (plain pickle would look it up by name in
   `__main__` and fail). They go into a fresh RUN_DIR with the job's settings.
2. A job (jobs.py) starts the ranks: torchrun, or forks of the fork server. Each worker
   (worker.py) initialises the process group (gloo on CPU, NCCL with one GPU per rank),
   calls `fn`, and writes `rank<r>.result` (the value, or the exception and its traceback).
   Its stdout and stderr go to files that this process prints with a `[rank r]` prefix on
   *stdout* (nbgrader marks a cell that writes to stderr as failed).
3. This process polls (ranks.py): results, exit codes, memory, the clock. A rank that raises
   ends the job; its exception is re-raised here with the rank named (report.py). A job that
   outlives `timeout` is killed, and the error names the ranks that never finished and the
   collective each was inside (read from a `faulthandler` stack dump the worker writes on
   SIGUSR1; frames.py names it).
4. Every worker is killed as a process group at the end, whatever happened, so no orphans
   are left behind, and RUN_DIR is removed.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
import time
import types
from collections import ChainMap
from pathlib import Path

import cloudpickle

from . import report
from .backend import resolve_backend
from .jobs import JOBS, pythonpath
from .processes import alive
from .ranks import Rank, dump_stacks, read_text, update, wait_for

LAUNCHERS = tuple(JOBS)  # ("torchrun", "forkserver")


def launch(
    fn,
    world_size: int = 2,
    *,
    args: tuple = (),
    backend: str = "auto",
    timeout: float | None = 90.0,
    launcher: str | None = None,
    memory_limit_gb: float | None = None,
    echo=True,
    env: dict | None = None,
    cwd: str | None = None,
):
    """Run `fn(rank, world_size, *args)` on `world_size` ranks and return the list of results.

    Results are indexed by rank; tensors in them come back on the CPU.

    backend: "auto" (NCCL with one GPU per rank if there are enough GPUs, else gloo),
        "gloo" or "nccl".
    timeout: seconds for the whole job, start-up included; the process group's own
        timeout is set to the same value so a stuck collective also errors out.
    launcher: "torchrun" (default; the real tool, the one that also spans machines) or
        "forkserver" (the same worker, forked from a process that imported torch once:
        about 0.1 s to start instead of several). The environment variable
        ZEROKIT_LAUNCHER sets the default.
    memory_limit_gb: kill the job if one rank's resident memory grows beyond this.
    echo: print what the ranks print (on stdout, each line prefixed with its rank); or a
        function echo(rank, line) to hand each line to instead.
    env: extra environment variables for the workers.
    cwd: the folder fn runs in (default: this process's current folder).

    Raises the exception a rank raised (the first, if several did), with the rank named
    in a note and the worker's traceback as its cause; LaunchTimeout if the job hangs;
    LaunchError if a rank dies without raising (a crash, os._exit, memory limit).
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a callable fn(rank, world_size, ...), got {type(fn).__name__}")
    if int(world_size) < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    world_size = int(world_size)
    launcher = launcher or os.environ.get("ZEROKIT_LAUNCHER") or "torchrun"
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, not {launcher!r}")
    backend = resolve_backend(backend, world_size)

    worker_env = {
        # one intra-op thread per rank unless asked otherwise: N ranks already share the cores
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": pythonpath(),
        # safe-path mode in every process the job starts: no folder of the caller's on sys.path
        "PYTHONSAFEPATH": "1",
    }
    worker_env.update({k: str(v) for k, v in (env or {}).items()})
    run_dir = _make_run_dir(fn, args, backend, timeout, worker_env, os.path.abspath(cwd or os.getcwd()))

    ranks = [Rank(r, run_dir) for r in range(world_size)]
    job = JOBS[launcher](run_dir, world_size, worker_env)
    try:
        outcome, finished = _run(job, ranks, timeout, memory_limit_gb, echo)
    finally:
        try:
            job.kill(ranks)
            update(ranks, echo)
            outputs = {r.rank: read_text(r.file("out")) for r in ranks}
            stacks = {r.rank: read_text(r.file("stack")) for r in ranks}
            exit_codes = {r.rank: job.exit_code(r) for r in ranks}
            launcher_log = job.log()
        finally:  # even if the last update() cannot unpickle a result: no run dir left in /tmp
            shutil.rmtree(run_dir, ignore_errors=True)

    if outcome == "ok":
        return [r.result[1] for r in ranks]
    if outcome == "error":
        report.raise_rank_errors(ranks, world_size, outputs)
        outcome = "crash"  # it returned: a rank that vanished is the cause
    if outcome == "timeout":
        raise report.timeout_error(ranks, finished, world_size, timeout, stacks, outputs)
    if outcome == "memory":
        raise report.memory_error(ranks, memory_limit_gb, world_size, outputs)
    raise report.crash_error(ranks, exit_codes, world_size, outputs, launcher, launcher_log)


def _code_with_its_file(code):
    """cloudpickle's reduction of a code object, with its co_filename in place of "<dynamic-code>"."""
    rebuild, fields = cloudpickle.cloudpickle._code_reduce(code)
    return rebuild, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)


def _make_run_dir(fn, args, backend, timeout, worker_env, cwd):
    """A private folder holding everything a worker needs: settings, fn and args, environment."""
    run_dir = Path(tempfile.mkdtemp(prefix="zerokit-launch-"))
    meta = {
        "backend": backend,
        "timeout": timeout,
        "sys_path": [p for p in sys.path if p],
        "parent_pid": os.getpid(),
        "cwd": cwd,
    }
    (run_dir / "meta.json").write_text(json.dumps(meta))
    try:
        (run_dir / "payload.pkl").write_bytes(_dumps({"fn": fn, "args": tuple(args)}))
    except Exception as exc:  # an unpicklable argument: say which, not a pickle stack
        shutil.rmtree(run_dir, ignore_errors=True)
        raise TypeError(f"launch() could not send fn/args to the workers: {exc}") from exc
    # The whole environment, not just the extras: a forked rank inherits the fork server's
    # environment, which predates anything the caller set since (torchrun ranks see it).
    (run_dir / "env.json").write_text(json.dumps({**os.environ, **worker_env}))
    return run_dir


def _failed(ranks):
    return any(r.result and r.result[0] == "error" for r in ranks)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, except that code sent by value keeps its file's name.

    cloudpickle sends by value what a rank cannot import: a notebook cell's functions, a script's
    (`python job.py`, `python -m pkg.job`: its `__main__`), lambdas and nested functions; and it
    names all that code "<dynamic-code>". A rank's traceback would then name every such line "your
    cell", a script's too. With the file's name kept, frames.py names a cell's line "your cell, line
    7" (its file is the kernel's) and a script's "job.py:440", and the traceback shows the source."""

    dispatch_table = ChainMap({types.CodeType: _code_with_its_file}, cloudpickle.Pickler.dispatch_table)


def _dumps(obj):
    with io.BytesIO() as f:
        _Pickler(f).dump(obj)
        return f.getvalue()


def _run(job, ranks, timeout, memory_limit_gb, echo):
    """Start the job and poll it until it ends one way or another.

    Returns (outcome, finished): outcome is "ok", "error" (a rank raised), "memory",
    "crash" (a rank vanished) or "timeout"; finished lists the ranks that had returned
    when the clock ran out.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    poll = lambda: update(ranks, echo)  # noqa: E731
    job.start(ranks)
    while True:
        time.sleep(0.02)
        poll()
        if _failed(ranks):
            # give the other ranks a moment to report their own errors, then stop
            wait_for(lambda: job.done(ranks) or all(r.result for r in ranks), 1.0, poll)
            return "error", None
        if all(r.result for r in ranks):
            return "ok", None
        if memory_limit_gb and any(r.peak_rss > memory_limit_gb * 2**30 for r in ranks):
            return "memory", None
        if job.done(ranks):
            # the ranks may have written their results and exited between the poll above and now:
            # what they wrote decides, an error included (read as "ok", a rank's error record was
            # once handed back as its return value, and a failing check passed)
            wait_for(lambda: all(r.result or not alive(r.pid) for r in ranks), 1.0, poll)
            poll()
            if _failed(ranks):
                return "error", None
            return ("ok" if all(r.result for r in ranks) else "crash"), None
        if deadline is not None and time.monotonic() > deadline:
            finished = [r.rank for r in ranks if r.result]  # before the kill changes it
            dump_stacks(ranks)
            return "timeout", finished
