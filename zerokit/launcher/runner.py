"""Run a Python callable on N ranks under torchrun and hand back what each rank returned.

    results = zerokit.launch(fn, world_size=4)       # fn(rank, world_size, *args) -> value

How it works, in the order things happen:
1. `fn` and `args` are pickled *by value* with cloudpickle, so a function or class defined
   in a notebook cell reaches the workers (plain pickle would look it up by name in
   `__main__` and fail).
2. `torchrun --standalone --nproc-per-node N -m zerokit.launcher.worker RUN_DIR` starts the ranks.
   Each worker initialises the process group (gloo on CPU, NCCL with one GPU per rank),
   calls `fn`, and writes `rank<r>.result` (the value, or the exception and its traceback).
   Its stdout and stderr go to files that this process prints with a `[rank r]` prefix on
   *stdout* (nbgrader marks a cell that writes to stderr as failed).
3. This process polls: results, exit codes, memory, the clock. A rank that raises ends the
   job; its exception is re-raised here with the rank named. A job that outlives `timeout`
   is killed, and the error names the ranks that never finished and the collective each was
   inside (read from a `faulthandler` stack dump the worker writes on SIGUSR1).
4. Every worker is killed as a process group at the end, whatever happened, so no orphans
   are left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import cloudpickle

__all__ = ["launch", "LaunchError", "LaunchTimeout", "resolve_backend", "rank_device", "describe_frames"]

# Public collectives a user calls; used to name what a stuck or failed rank was doing.
COLLECTIVES = (
    "all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter",
    "all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_object",
    "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "wait",
    "init_process_group", "destroy_process_group",
)
_COMM_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Timed out|timed out|DistBackendError|NCCL (error|communicator)",
)


class LaunchError(RuntimeError):
    """The job failed as a whole: a rank crashed, ran out of memory, or could not start.

    `failures` maps rank -> one-line reason; `outputs` maps rank -> what the rank printed.
    """

    def __init__(self, message, failures=None, outputs=None):
        super().__init__(message)
        self.failures = failures or {}
        self.outputs = outputs or {}


class LaunchTimeout(LaunchError, TimeoutError):
    """The job did not finish within `timeout` seconds (a deadlock, or a loop that never ends)."""


class RemoteTraceback(Exception):
    """Carries a worker's formatted traceback as the `__cause__` of a re-raised exception."""

    def __str__(self):
        return self.args[0]


def resolve_backend(backend: str, world_size: int) -> str:
    """"auto" means NCCL when there is one CUDA device per rank, gloo (CPU) otherwise."""
    if backend != "auto":
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
        return backend
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device():
    """The device this rank should put its tensors on: cuda:<local rank> under NCCL, else cpu."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@dataclass
class _Rank:
    rank: int
    dir: Path
    pid: int | None = None
    result: tuple | None = None  # ("ok", value) or ("error", info-dict)
    printed: int = 0  # bytes of the output file already echoed
    peak_rss: int = 0
    notes: list = field(default_factory=list)

    def file(self, suffix):
        return self.dir / f"rank{self.rank}.{suffix}"


LAUNCHERS = ("torchrun", "forkserver")


def launch(
    fn,
    world_size: int = 2,
    *,
    args: tuple = (),
    backend: str = "auto",
    timeout: float | None = 90.0,
    launcher: str | None = None,
    memory_limit_gb: float | None = None,
    echo: bool = True,
    env: dict | None = None,
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
    echo: print what the ranks print (on stdout, each line prefixed with its rank).
    env: extra environment variables for the workers.

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

    run_dir = Path(tempfile.mkdtemp(prefix="zerokit-launch-"))
    meta = {
        "backend": backend,
        "timeout": timeout,
        "sys_path": [p for p in sys.path if p],
        "parent_pid": os.getpid(),
    }
    (run_dir / "meta.json").write_text(json.dumps(meta))
    try:
        (run_dir / "payload.pkl").write_bytes(cloudpickle.dumps({"fn": fn, "args": tuple(args)}))
    except Exception as exc:  # an unpicklable argument: say which, not a pickle stack
        shutil.rmtree(run_dir, ignore_errors=True)
        raise TypeError(f"launch() could not send fn/args to the workers: {exc}") from exc

    worker_env = {
        # one intra-op thread per rank unless asked otherwise: N ranks already share the cores
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": _pythonpath(),
    }
    worker_env.update({k: str(v) for k, v in (env or {}).items()})
    # The whole environment, not just the extras: a forked rank inherits the fork server's
    # environment, which predates anything the caller set since (torchrun ranks see it).
    (run_dir / "env.json").write_text(json.dumps({**os.environ, **worker_env}))

    ranks = [_Rank(r, run_dir) for r in range(world_size)]
    job = (_TorchrunJob if launcher == "torchrun" else _ForkedJob)(run_dir, world_size, worker_env)
    deadline = None if timeout is None else time.monotonic() + timeout
    poll = lambda: _poll(ranks, echo)  # noqa: E731
    outcome = None
    try:
        job.start(ranks)
        while outcome is None:
            time.sleep(0.02)
            poll()
            if any(r.result and r.result[0] == "error" for r in ranks):
                # give the other ranks a moment to report their own errors, then stop
                _wait_for(lambda: job.done(ranks) or all(r.result for r in ranks), 1.0, poll)
                outcome = "error"
            elif all(r.result for r in ranks):
                outcome = "ok"
            elif memory_limit_gb and any(r.peak_rss > memory_limit_gb * 2**30 for r in ranks):
                outcome = "memory"
            elif job.done(ranks):
                _wait_for(lambda: all(r.result or not _alive(r.pid) for r in ranks), 1.0, poll)
                poll()
                outcome = "ok" if all(r.result for r in ranks) else "crash"
            elif deadline is not None and time.monotonic() > deadline:
                outcome = "timeout"
                finished = [r.rank for r in ranks if r.result]  # before the kill changes it
                _dump_stacks(ranks)
    finally:
        try:
            job.kill(ranks)
            poll()
            outputs = {r.rank: _read(r.file("out")) for r in ranks}
            stacks = {r.rank: _read(r.file("stack")) for r in ranks}
            exit_codes = {r.rank: job.exit_code(r) for r in ranks}
            job_log = job.log()
        finally:  # even if the last poll() cannot unpickle a result: no run dir left in /tmp
            shutil.rmtree(run_dir, ignore_errors=True)

    if outcome == "ok":
        return [r.result[1] for r in ranks]
    if outcome == "error":
        vanished = [r for r in ranks if not r.result]
        errs = [r for r in ranks if r.result and r.result[0] == "error"]
        returned = [r.rank for r in ranks if r.result and r.result[0] == "ok"]
        only_comm = all(_is_comm_failure(r.result[1]) for r in errs)
        if only_comm and returned and not vanished:
            # a collective some ranks never called: the peers that returned closed the connection
            failures = {r.rank: (f"was waiting in {_where(r.result[1])} when rank(s) {returned} had already "
                                 "returned: every rank must call the same collectives in the same order")
                        for r in errs}
            raise LaunchError(_summary("deadlocked", failures, world_size), failures, outputs)
        if not (vanished and only_comm):
            _raise_rank_error(ranks, world_size, outputs)
        # only transport errors, and a rank is gone: the vanished rank is the cause
    if outcome == "timeout":
        raise _timeout_error(ranks, finished, world_size, timeout, stacks, outputs)
    if outcome == "memory":
        failures = {r.rank: f"used {r.peak_rss / 2**30:.2f} GiB of memory, over the {memory_limit_gb} GiB limit"
                    for r in ranks if r.peak_rss > memory_limit_gb * 2**30}
        raise LaunchError(_summary("stopped: out of memory", failures, world_size), failures, outputs)
    # a crash: ranks that vanished without a result
    if not any(r.pid for r in ranks):
        tail = "\n".join(job_log.strip().splitlines()[-15:])
        raise LaunchError(f"{launcher} could not start the workers:\n{tail}", {}, outputs)
    failures = {}
    for r in ranks:
        if not r.result:
            code = exit_codes[r.rank]
            how = f"exit code {code}" if code is not None and code >= 0 else (
                f"killed by signal {-code}" if code is not None else "")
            failures[r.rank] = f"exited without returning{f' ({how})' if how else ''}: a crash, os._exit() or a signal"
    raise LaunchError(_summary("failed", failures, world_size), failures, outputs)


def _pythonpath():
    """PYTHONPATH for child processes: this package first, so `-m zerokit.launcher.worker` resolves."""
    root = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


class _TorchrunJob:
    """torchrun --standalone --nproc-per-node N -m zerokit.launcher.worker RUN_DIR"""

    def __init__(self, run_dir, world_size, worker_env):
        self.run_dir, self.world_size = run_dir, world_size
        self.env = {**os.environ, **worker_env}
        self.agent = None

    def start(self, ranks):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--standalone", f"--nproc-per-node={self.world_size}", "--max-restarts=0",
            "--monitor-interval=0.1",
            "-m", "zerokit.launcher.worker", str(self.run_dir),
        ]
        with open(self.run_dir / "launcher.log", "wb") as log:
            try:
                self.agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                              start_new_session=True)
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
            _signal_group(self.agent.pid, signal.SIGTERM)
            try:
                self.agent.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        _kill_groups([self.agent.pid] + [r.pid for r in ranks if r.pid])
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
        return _read(self.run_dir / "launcher.log")


class _ForkedJob:
    """Ranks forked from zerokit.launcher.forkserver; rendezvous through a file in RUN_DIR."""

    def __init__(self, run_dir, world_size, worker_env):
        self.run_dir, self.world_size = run_dir, world_size

    def start(self, ranks):
        from . import forkserver

        try:
            server = forkserver.server(_pythonpath())
        except RuntimeError as exc:
            raise LaunchError(str(exc)) from exc
        try:
            for r in ranks:
                server.stdin.write(f"{self.run_dir} {r.rank} {self.world_size}\n")
                server.stdin.flush()
                r.pid = int(server.stdout.readline())
        except (OSError, ValueError) as exc:  # the server died: a broken pipe, or EOF ("")
            raise LaunchError(f"the zerokit fork server stopped answering: {exc!r}") from exc

    def done(self, ranks):
        return all(r.result or r.file("exit").exists() for r in ranks)

    def kill(self, ranks):
        started = [r for r in ranks if r.pid]
        _kill_groups([r.pid for r in started])
        # _kill_groups counts a zombie as dead, but the fork server writes rank<r>.exit only
        # once it has reaped the child: wait for that, or the write lands in a run dir that
        # rmtree is removing and the dir is left behind in /tmp.
        end = time.monotonic() + 5
        while time.monotonic() < end and not all(r.file("exit").exists() for r in started):
            time.sleep(0.01)

    def exit_code(self, r):
        text = _read(r.file("exit")).strip()
        return int(text) if text else None

    def log(self):
        return ""


def _signal_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_groups(pgids):
    for pgid in pgids:
        _signal_group(pgid, signal.SIGKILL)
    end = time.monotonic() + 5
    while time.monotonic() < end and any(_alive(p) for p in pgids):
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------
# polling and cleanup


def _poll(ranks, echo):
    for r in ranks:
        if r.pid is None and r.file("pid").exists():
            try:
                r.pid = int(r.file("pid").read_text())
            except ValueError:
                pass  # half-written; next poll
        if r.result is None and r.file("result").exists():
            r.result = cloudpickle.loads(r.file("result").read_bytes())
        if r.pid:
            r.peak_rss = max(r.peak_rss, _rss(r.pid))
        if echo:
            _echo_new_lines(r)


def _echo_new_lines(r):
    path = r.file("out")
    try:
        with open(path, "rb") as f:
            f.seek(r.printed)
            chunk = f.read()
    except FileNotFoundError:
        return
    end = chunk.rfind(b"\n") + 1  # only complete lines; the rest waits for the next poll
    if r.result is not None or r.pid is None or not _alive(r.pid):
        end = len(chunk)
    if end:
        text = chunk[:end].decode(errors="replace")
        sys.stdout.write("".join(f"[rank {r.rank}] {line}\n" for line in text.splitlines()))
        sys.stdout.flush()
        r.printed += end


def _wait_for(cond, seconds, poll):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not cond():
        time.sleep(0.02)
        poll()


def _rss(pid):
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:  # the process has exited between polls
        return 0


def _alive(pid):
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purposes
    try:
        import psutil

        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


def _dump_stacks(ranks):
    """Ask each unfinished rank for its Python stack (faulthandler answers even mid-collective)."""
    asked = [r for r in ranks if r.result is None and _alive(r.pid)]
    for r in asked:
        try:
            os.kill(r.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    _wait_for(lambda: all(r.file("stack").exists() and r.file("stack").stat().st_size > 0 for r in asked),
              2.0, lambda: None)
    time.sleep(0.1)  # let the dump finish writing


def _read(path):
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------------------------------
# turning what the ranks left behind into one readable exception


def _summary(what, failures, world_size):
    lines = [f"{what} on {len(failures)} of {world_size} ranks:"]
    lines += [f"  rank {rank}: {why}" for rank, why in sorted(failures.items())]
    return "\n".join(lines)


def _raise_rank_error(ranks, world_size, outputs):
    errs = [r for r in ranks if r.result and r.result[0] == "error"]
    finished = [r.rank for r in ranks if r.result and r.result[0] == "ok"]
    # A rank whose peer vanished fails with a transport error; the real cause is elsewhere.
    primary = [r for r in errs if not _is_comm_failure(r.result[1])] or errs
    primary.sort(key=lambda r: r.result[1]["time"])
    first = primary[0]
    info = first.result[1]
    exc = info.get("exception")
    if exc is None:
        exc = RuntimeError(_one_line(info["type"], info["message"]))
    remote = RemoteTraceback(f"\n\nTraceback on rank {first.rank}:\n{info['traceback']}")
    if not isinstance(exc, Exception):
        # SystemExit or KeyboardInterrupt raised again here would end the caller's own
        # process (the notebook kernel, pytest) instead of reporting a failed job.
        if isinstance(exc, SystemExit):
            why = f"called sys.exit({'' if exc.code is None else repr(exc.code)})"
        else:
            why = f"raised {_one_line(info['type'], info['message'])}"
        failures = {first.rank: why}
        error = LaunchError(f"rank {first.rank} of {world_size} {why}", failures, outputs)
        error.rank = first.rank
        raise error from remote
    note = f"raised on rank {first.rank} of {world_size}"
    if info.get("where"):
        note += f", {info['where']}"
    exc.add_note(note)
    if _is_comm_failure(info) and finished:
        exc.add_note(
            f"rank {first.rank} was waiting in {info.get('collective') or 'a collective'} when rank(s) "
            f"{finished} had already returned: every rank must call the same collectives in the same order"
        )
    # Ranks that failed only because a peer went away add noise, not information.
    others = [r for r in errs if r is not first and not _is_comm_failure(r.result[1])]
    for r in others:
        exc.add_note(f"rank {r.rank} also raised {_one_line(r.result[1]['type'], r.result[1]['message'])}")
    exc.rank = first.rank
    exc.outputs = outputs
    raise exc from remote


def _where(info):
    """'torch.distributed.barrier (your cell, line 10, in f)' from a worker's error info."""
    if not info.get("collective"):
        return "a collective"
    where = info.get("where", "")
    user = where[where.index("("):] if "(" in where else ""
    return f"torch.distributed.{info['collective']} {user}".rstrip()


def _one_line(type_name, message):
    # `raise NotImplementedError()` has no message at all: the type alone must do
    first = next((line.strip() for line in str(message).splitlines() if line.strip()), "")
    return f"{type_name}: {first[:200]}" if first else type_name


def _is_comm_failure(info):
    return bool(_COMM_FAILURE.search(info["message"])) or info["type"] == "DistBackendError"


def _timeout_error(ranks, finished, world_size, timeout, stacks, outputs):
    failures = {}
    for r in ranks:
        if r.rank in finished:
            continue
        if r.pid is None:
            failures[r.rank] = "never started (start-up is slow on a busy machine: try a longer timeout)"
            continue
        failures[r.rank] = "never finished" + _describe_stack(stacks.get(r.rank, ""))
    msg = _summary(f"timed out after {timeout:g} s", failures, world_size)
    if finished:
        msg += f"\n  ranks {finished} had already returned."
    if any("inside" in why for why in failures.values()):
        msg += "\n  A rank waiting inside a collective usually means another rank skipped it or called a different one."
    return LaunchTimeout(msg, failures, outputs)


def describe_frames(frames):
    """Name the collective (innermost torch.distributed frame) and the user's line in `frames`.

    `frames` is a list of (filename, lineno, function), innermost first.
    """
    collective = None
    user = None
    # zerokit's own helpers (comm.all_gather, ...) sit between the user's line and torch: name
    # one of them only when the stack holds no frame of the user's at all.
    zerokit_frame = None
    for filename, lineno, func in frames:
        in_torch = f"{os.sep}torch{os.sep}" in filename
        in_zerokit = f"{os.sep}zerokit{os.sep}" in filename
        if collective is None and in_torch and func in COLLECTIVES:
            collective = func
        if user is not None or in_torch or f"{os.sep}zerokit{os.sep}launcher{os.sep}" in filename:
            continue
        if "ipykernel" in filename or filename.startswith("<"):
            user = f"your cell, line {lineno}, in {func}"
        elif not in_zerokit:
            user = f"{Path(filename).name}:{lineno}, in {func}"
        elif zerokit_frame is None:
            zerokit_frame = f"{Path(filename).name}:{lineno}, in {func}"
    return collective, user or zerokit_frame


def _describe_stack(text):
    # faulthandler: 'Current thread 0x... (most recent call first):\n  File "x.py", line 3 in f'
    main = text.split("\n\n")[0] if text else ""
    for block in text.split("\n\n"):
        if "Current thread" in block:
            main = block
    frames = [(m.group(1), int(m.group(2)), m.group(3))
              for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', main)]
    collective, user = describe_frames(frames)
    if collective:
        return f": inside torch.distributed.{collective}" + (f" ({user})" if user else "")
    if user:
        return f": running {user}"
    return ""
