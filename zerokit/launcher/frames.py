"""Name what a rank was doing from its Python stack: the collective it was in, and the user's line.

Both sides use it: the worker on the traceback of an exception it caught, the launching
process on the stack dump of a rank that never finished. Frames are (filename, lineno,
function) tuples, innermost first.
"""

import os
import re
from pathlib import Path

# Public collectives a user calls; used to name what a stuck or failed rank was doing.
COLLECTIVES = (
    "all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter",
    "all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_object",
    "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "barrier",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "wait",
    "init_process_group", "destroy_process_group",
)

_TORCH = f"{os.sep}torch{os.sep}"
_ZEROKIT = f"{os.sep}zerokit{os.sep}"
_LAUNCHER = f"{os.sep}zerokit{os.sep}launcher{os.sep}"  # this package: never the user's line


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
        in_torch = _TORCH in filename
        if collective is None and in_torch and func in COLLECTIVES:
            collective = func
        if user is not None or in_torch or _LAUNCHER in filename:
            continue
        if "ipykernel" in filename or filename.startswith("<"):
            user = f"your cell, line {lineno}, in {func}"
        elif _ZEROKIT not in filename:
            user = f"{Path(filename).name}:{lineno}, in {func}"
        elif zerokit_frame is None:
            zerokit_frame = f"{Path(filename).name}:{lineno}, in {func}"
    return collective, user or zerokit_frame


def describe_stack_dump(text):
    """describe_frames for the main thread of a faulthandler dump (what a rank writes on SIGUSR1)."""
    # 'Current thread 0x... (most recent call first):\n  File "x.py", line 3 in f', one block
    # per thread; without a "Current thread" block, the first is the best guess.
    main = text.split("\n\n")[0] if text else ""
    for block in text.split("\n\n"):
        if "Current thread" in block:
            main = block
    frames = [(m.group(1), int(m.group(2)), m.group(3))
              for m in re.finditer(r'File "([^"]+)", line (\d+) in (\S+)', main)]
    return describe_frames(frames)
