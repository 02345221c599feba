"""Turning what the ranks left behind into one readable exception.

The rule of thumb: name the rank, say what it was doing (the collective, the user's line),
and hide the noise. When one rank fails, its peers usually fail too, with a transport error
("Connection closed by peer") that says nothing about the cause; those are left out
whenever a better explanation exists.
"""

import re

from .errors import LaunchError, LaunchTimeout, RemoteTraceback
from .frames import describe_stack_dump

_COMM_FAILURE = re.compile(
    r"Connection (closed|reset) by peer|Timed out|timed out|DistBackendError|NCCL (error|communicator)",
)
_SAME_ORDER = "every rank must call the same collectives in the same order"


def raise_rank_errors(ranks, world_size, outputs):
    """Raise for a job in which some rank raised; returns only if a vanished rank is the cause.

    The exception a rank raised comes back as itself (a ValueError stays a ValueError), with
    the rank named in a note and the worker's traceback as its cause.
    """
    vanished = [r for r in ranks if not r.result]
    errs = [r for r in ranks if r.result and r.result[0] == "error"]
    returned = [r.rank for r in ranks if r.result and r.result[0] == "ok"]
    only_comm = all(_is_comm_failure(r.result[1]) for r in errs)
    if only_comm and returned and not vanished:
        # a collective some ranks never called: the peers that returned closed the connection
        failures = {r.rank: f"was waiting in {_where(r.result[1])} when rank(s) {returned} had already "
                            f"returned: {_SAME_ORDER}"
                    for r in errs}
        raise LaunchError(_summary("deadlocked", failures, world_size), failures, outputs)
    if vanished and only_comm:
        return  # only transport errors, and a rank is gone: the vanished rank is the cause
    _raise_first_error(ranks, world_size, outputs)


def timeout_error(ranks, finished, world_size, timeout, stacks, outputs):
    """LaunchTimeout naming every rank that never finished and where its stack dump says it was."""
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


def memory_error(ranks, memory_limit_gb, world_size, outputs):
    limit = memory_limit_gb * 2**30
    failures = {r.rank: f"used {r.peak_rss / 2**30:.2f} GiB of memory, over the {memory_limit_gb} GiB limit"
                for r in ranks if r.peak_rss > limit}
    return LaunchError(_summary("stopped: out of memory", failures, world_size), failures, outputs)


def crash_error(ranks, exit_codes, world_size, outputs, launcher, launcher_log):
    """LaunchError for ranks that vanished without a result (a crash, os._exit, a signal)."""
    if not any(r.pid for r in ranks):  # none even started: the launcher's own log says why
        tail = "\n".join(launcher_log.strip().splitlines()[-15:])
        return LaunchError(f"{launcher} could not start the workers:\n{tail}", {}, outputs)
    failures = {}
    for r in ranks:
        if not r.result:
            code = exit_codes[r.rank]
            how = f"exit code {code}" if code is not None and code >= 0 else (
                f"killed by signal {-code}" if code is not None else "")
            failures[r.rank] = f"exited without returning{f' ({how})' if how else ''}: a crash, os._exit() or a signal"
    return LaunchError(_summary("failed", failures, world_size), failures, outputs)


def _summary(what, failures, world_size):
    lines = [f"{what} on {len(failures)} of {world_size} ranks:"]
    lines += [f"  rank {rank}: {why}" for rank, why in sorted(failures.items())]
    return "\n".join(lines)


def _raise_first_error(ranks, world_size, outputs):
    errs = [r for r in ranks if r.result and r.result[0] == "error"]
    finished = [r.rank for r in ranks if r.result and r.result[0] == "ok"]
    # A rank whose peer vanished fails with a transport error; the real cause is elsewhere.
    primary = [r for r in errs if not _is_comm_failure(r.result[1])] or errs
    primary.sort(key=lambda r: r.result[1]["time"])
    first = primary[0]
    info = first.result[1]
    exc = info.get("exception")
    if exc is None:  # it could not be pickled: the same text on a RuntimeError
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
            f"{finished} had already returned: {_SAME_ORDER}"
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


def _describe_stack(text):
    collective, user = describe_stack_dump(text)
    if collective:
        return f": inside torch.distributed.{collective}" + (f" ({user})" if user else "")
    if user:
        return f": running {user}"
    return ""
