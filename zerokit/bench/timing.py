"""How a step is timed: forward + backward + optimizer step + zero_grad.

Before every timed step all ranks meet at a barrier, and the device is synchronised before
and after it, so that a step's time is the slowest rank's whole step; the table shows the
median over the timed steps, which follow the warm-up steps and the instrumented one.

Timing on a shared machine: the two systems of a stage are timed in alternating chunks of
two steps (with the floor, see runs.run_stage), so a change in load falls on both alike;
the JSON also keeps each rank's CPU time per step and the load average before and after
the run.
"""

import time

import torch
import torch.distributed as dist


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_together(fn, device):
    """Seconds `fn()` takes on this rank, started together with the other ranks."""
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0
