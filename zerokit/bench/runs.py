"""Running one configuration inside a worker, and a stage's configurations in rotation.

A configuration is built fresh, warmed up, measured over one instrumented step (collectives
counted, memory sampled after every operation), then timed; at the end its loss on an
evaluation batch is what the table compares with DDP + AdamW's, which every configuration
should match to float rounding (they all compute AdamW on the mean gradient of the same
global batch).
"""

import gc
import resource
import time
from functools import partial

import torch
import torch.distributed as dist

from zerokit.comm import WireCounter

from .accounting import Instrument, allocated_bytes
from .floor import Floor
from .systems import build, micro_batches
from .timing import sync
from .workload import accumulate_step, eval_batch, loss_of, rank_batch, train_step


def _minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Run:
    """One live configuration: its model, optimizer, step counter and measurements.

    builder(config, model_cfg, device, seed) -> (model, optimizer): systems.build, or the FSDP2
    bench's (fsdp2.py), which builds its two systems on one mesh."""

    def __init__(self, config, rank, world_size, opts, device, builder=build):
        self.config, self.rank, self.world_size, self.opts, self.device = config, rank, world_size, opts, device
        gc.collect()
        self.baseline = allocated_bytes(device)  # what the process held before this config
        self.model, self.opt = builder(config, opts["model"], device, opts["seed"])
        micro = micro_batches(config)
        self.train_step = train_step if micro == 1 else partial(accumulate_step, micro=micro)
        self.step, self.losses, self.times, self.cpu_times, self.faults = 0, [], [], [], []

    def batch(self):
        return rank_batch(self.opts["model"], self.step, self.rank, self.world_size, self.device)

    def train(self, timed=False):
        x, y = self.batch()
        if timed:
            dist.barrier()
            sync(self.device)
        t0, c0, f0 = time.perf_counter(), time.process_time(), _minor_faults()
        loss = self.train_step(self.model, self.opt, x, y, self.opts["model"])
        sync(self.device)
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.cpu_times.append(time.process_time() - c0)  # all threads of this rank
            self.faults.append(_minor_faults() - f0)  # pages the kernel mapped in during the step
        self.losses.append(loss.item())
        self.step += 1

    def prepare(self):
        """Warm-up, then one instrumented step (collectives counted, memory sampled after every
        operation)."""
        for _ in range(self.opts["warmup"]):
            self.train()
        x, y = self.batch()
        self.inst = Instrument(self.model, self.opt, self.device, self.baseline)
        with WireCounter() as self.wire, self.inst:
            loss = self.train_step(self.model, self.opt, x, y, self.opts["model"])
        self.losses.append(loss.item())
        self.step += 1

    def result(self):
        ex, ey = eval_batch(self.opts["model"], self.device)
        with torch.no_grad():
            final = loss_of(self.opts["model"], self.model(ex), ey).item()
        inst = self.inst
        return {
            "name": self.config.name,
            "step_times_s": self.times,
            "step_cpu_s": self.cpu_times,
            "step_page_faults": self.faults,
            "train_losses": self.losses,
            "final_loss": final,
            "memory": {**inst.peak, "samples": inst.samples, "at_peak": inst.at_peak},
            "comm": {"table": inst.table(), "volume_bytes": inst.volume_bytes(), "sent_bytes": inst.sent_bytes(),
                     "calls": inst.count(), "wire_bytes": self.wire.sent_bytes,
                     # all-gather volume inside and across "nodes" of node_size consecutive ranks
                     "all_gather_nodes": inst.node_split(self.opts["node_size"], "all_gather")},
        }


def run_stage(configs, rank, world_size, opts, device, psi):
    """Measure the configurations of one stage (zerokit and its peer).

    Each is built and measured for memory and communication on its own (the other, if
    already built, sits idle: its memory is below this one's baseline). Then both, and the
    stage's floor, are timed in alternating chunks of steps, so that a change in the
    machine's load (other processes) falls on all of them alike.
    """
    runs = []
    for config in configs:
        run = Run(config, rank, world_size, opts, device)
        run.prepare()
        runs.append(run)
    floor = Floor(configs[0].stage, rank, world_size, opts, device, psi)
    chunk = opts["chunk"]
    for start in range(0, opts["steps"], chunk):
        for run in runs + [floor]:
            for _ in range(min(chunk, opts["steps"] - start)):
                run.train(timed=True)
    results = [run.result() for run in runs]
    floor_times = {**floor.times, "update_impl": floor.update_impl, "collectives": floor.collectives}
    del runs, run, floor
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results, floor_times
