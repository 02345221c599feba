"""Run a Python callable on N ranks and hand back what each rank returned: `zerokit.launch`.

The files, from the entry point down (each imports only the ones below it):

    runner.py      launch(): check the arguments, write the run folder, start a job, poll
                   it, hand back the results or raise
    report.py      what the ranks left behind -> one readable exception naming the rank
    jobs.py        the two ways to start the ranks: torchrun, or forks of the fork server
    forkclient.py  the launching side of the fork server: start it, ask it for ranks; one
                   per Python process, even when this package is imported afresh
    forkserver.py  the fork server process: imports torch once, forks each rank from it
    preforked.py   a grading kernel that forks its own fork server first: one torch import for both
    ranks.py       the launching side's view of each rank, read from the files it writes
    processes.py   is a process alive, how much memory it holds, killing process groups
    worker.py      what runs inside each rank: the process group, fn, the result file
    frames.py      naming the collective and the user's line in a stack (both sides use it)
    backend.py     gloo or NCCL, and the device a rank's tensors go on
    errors.py      LaunchError and LaunchTimeout
"""

from .backend import rank_device, resolve_backend
from .errors import LaunchError, LaunchTimeout
from .frames import describe_frames
from .runner import launch

__all__ = ["launch", "LaunchError", "LaunchTimeout", "resolve_backend", "rank_device", "describe_frames"]
