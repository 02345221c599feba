"""One rank of a `zerokit.launch` job; torchrun runs `python -m zerokit.launcher.worker RUN_DIR`.

The files it leaves in RUN_DIR are the whole protocol with the launching process:
rank<r>.pid (written first), rank<r>.out (stdout and stderr), rank<r>.stack (a stack dump
on SIGUSR1), rank<r>.result (("ok", value) or ("error", info), written last, atomically).
"""

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

from .frames import describe_frames


def _watch_parent(pid):
    """Exit if the process that called launch() dies, so a killed notebook leaves no orphans."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass


def _to_cpu(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _write_atomic(path, data):
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _error_info(exc, cloudpickle):
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    collective, user = describe_frames(list(reversed(frames)))  # it skips this file's frames
    try:
        pickled = cloudpickle.loads(cloudpickle.dumps(exc))
    except Exception:
        pickled = None  # re-raised as a RuntimeError carrying the same text
    where = ""
    if collective:
        where = f"inside torch.distributed.{collective}"
    if user:
        where = f"{where} ({user})" if where else f"at {user}"
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # start the traceback at the user's function, not at this file
    tb = "".join(traceback.format_exception(type(exc), exc, tb))
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": tb,
        "exception": pickled,
        "collective": collective,
        "where": where,
        "time": time.time(),
    }


def main(run_dir):
    run_dir = Path(run_dir)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    me = lambda suffix: run_dir / f"rank{rank}.{suffix}"  # noqa: E731

    # Everything this rank prints, Python or C++ (gloo, NCCL), goes to one file.
    out = open(me("out"), "ab", buffering=0)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    stack_file = open(me("stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _write_atomic(me("pid"), str(os.getpid()).encode())

    import json

    import cloudpickle

    # The caller's sys.path after ours, not before: fn may refer to the caller's own modules (a
    # test file, a package), but a name this process can import from its installed location
    # (zerokit, torch, ...) must keep coming from there, not from a folder the caller added.
    # Relative entries would depend on the working folder: left out.
    meta = json.loads((run_dir / "meta.json").read_text())
    sys.path.extend(p for p in meta["sys_path"] if os.path.isabs(p) and p not in sys.path)
    threading.Thread(target=_watch_parent, args=(meta["parent_pid"],), daemon=True).start()

    import torch
    import torch.distributed as dist

    ok = False
    try:
        spec = cloudpickle.loads((run_dir / "payload.pkl").read_bytes())
        backend = meta["backend"]
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        timeout = meta["timeout"]
        dist.init_process_group(
            backend,
            init_method=os.environ.get("ZEROKIT_INIT_METHOD", "env://"),
            rank=rank,
            world_size=world_size,
            # Longer than launch()'s own timeout, which should fire first and name the stuck
            # ranks; this one is the backstop if the launching process is gone.
            timeout=timedelta(seconds=(timeout + 30) if timeout else 300),
        )
        # Every rank has joined before any runs fn: otherwise a rank whose fn makes no
        # collective call can finish and tear the group down while another is still joining,
        # and that rank then reports a hang in init_process_group (seen once in 12 runs).
        dist.barrier()
        # the caller's folder (or the one it named): relative paths in fn mean what they mean there
        with contextlib.suppress(OSError):
            os.chdir(meta["cwd"])
        value = spec["fn"](rank, world_size, *spec["args"])
        result = ("ok", _to_cpu(value))
        ok = True
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: report, don't vanish
        result = ("error", _error_info(exc, cloudpickle))
    try:
        data = cloudpickle.dumps(result)
    except Exception as exc:
        result = ("error", _error_info(TypeError(f"the return value of fn could not be pickled: {exc}"), cloudpickle))
        data = cloudpickle.dumps(result)
        ok = False
    sys.stdout.flush()
    sys.stderr.flush()
    _write_atomic(me("result"), data)
    if ok and dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main(sys.argv[1])
