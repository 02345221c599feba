"""What every rank runs: warm the process up, then measure each selected stage in turn.

`worker` is what `zerokit.launch` sends to the ranks. It lives in an importable module so
that cloudpickle sends it by reference (a function of `__main__` would travel by value,
with its globals).
"""

import statistics
import time

import torch
import torch.distributed as dist

import zerokit
from zerokit import collectives, comm
from zerokit.stages import by_stage

from .runs import run_stage
from .systems import CONFIGS
from .workload import loss_of, make_model, rank_batch


def warm_process(rank, world_size, opts, device):
    """Pay one-time costs before anything is measured: kernels' first-use caches, the
    autograd engine, gloo's buffers for each collective. Otherwise the first configuration
    would carry a few MiB and milliseconds that belong to the process, not to it."""
    model = make_model(opts["model"], device, opts["seed"])
    for step in range(2):
        x, y = rank_batch(opts["model"], step, rank, world_size, device)
        loss_of(opts["model"], model(x), y).backward()
    full = torch.zeros(world_size * 1024, device=device)
    part = torch.zeros(1024, device=device)
    dist.all_reduce(full)
    for impl in (comm, collectives):  # torch's (the peers') and zerokit's (direct on gloo)
        impl.reduce_scatter(part, full)
        impl.reduce_scatter(part, full, op=dist.ReduceOp.AVG)
        impl.all_gather(full, part)
    dist.broadcast(full, 0)
    dist.barrier()


def worker(rank, world_size, opts):
    device = zerokit.rank_device()
    psi = sum(p.numel() for p in make_model(opts["model"], "cpu", opts["seed"]).parameters())
    warm_process(rank, world_size, opts, device)
    results, floors = [], {}
    selected = [c for c in CONFIGS if c.name in opts["configs"]]
    for stage_configs in by_stage(selected, lambda c: c.stage).values():  # the stages in order
        t0 = time.perf_counter()
        stage_results, floors[stage_configs[0].stage] = run_stage(stage_configs, rank, world_size, opts, device, psi)
        for r in stage_results:
            results.append(r)
            if rank == 0:
                label = next(c.label for c in selected if c.name == r["name"])
                med = statistics.median(r["step_times_s"]) * 1e3 if r["step_times_s"] else float("nan")
                print(f"[{len(results)}/{len(selected)}] {label:32s} {med:8.1f} ms/step (rank 0), "
                      f"peak {r['memory']['total'] / 2**20:7.1f} MiB "
                      f"(stage {stage_configs[0].stage}: {time.perf_counter() - t0:5.1f} s)", flush=True)
    return {"rank": rank, "psi": psi, "floors": floors, "configs": results,
            "backend": dist.get_backend(), "device": str(device)}
