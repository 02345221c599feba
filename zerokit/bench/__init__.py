r"""zerokit against PyTorch's own ZeRO implementations, on one model, one data stream, one run.

    python -m zerokit.bench                          # world size 2, the small transformer
    python -m zerokit.bench --world-size 4 --model medium --steps 50

Eight configurations, four stages, each stage run by zerokit and by its PyTorch peer:

| stage | PyTorch peer | zerokit |
|---|---|---|
| ddp   | `DistributedDataParallel` + `torch.optim.AdamW`           | `DistributedAdam` |
| zero1 | DDP + `torch.distributed.optim.ZeroRedundancyOptimizer`   | `ZeRO1Adam` |
| zero2 | FSDP2 `fully_shard(reshard_after_forward=False)` + AdamW  | `ZeRO2Adam(bucket_mb=one block)` |
| zero3 | FSDP2 `fully_shard` (blocks reshard after forward) + AdamW | `ZeRO3Adam(units=blocks)` |

FSDP2 wraps each transformer block, then the root (embeddings, final norm, head); zerokit
gets the same granularity: ZeRO-3 units are the blocks (the root unit keeps the rest), and
ZeRO-2's gradient buckets are one block in size (its 25 MiB default would make one bucket
of the whole small model, sent only after backward).

All run in one `zerokit.launch` (one process tree): each rank builds a configuration fresh
from the same seed, trains it on the same batches (rank r takes its slice of each global
batch), measures it, frees it and builds the next. What is measured, and how:

- **step time**: forward + backward + optimizer step + zero_grad. Before every step all
  ranks meet at a barrier; a step's time is the slowest rank's; the table shows the median
  over the timed steps, which follow the warm-up steps.
- **communication**: one step under `zerokit.CommCounter`, which sees every c10d and
  functional collective (DDP's reducer, ZeroRedundancyOptimizer's broadcasts and FSDP2's
  all-gathers and reduce-scatters included). Volume in the ZeRO paper's convention
  (all-reduce of Psi = 2 Psi; reduce-scatter, all-gather, broadcast of Psi = Psi); a ring
  puts (N-1)/N of it on the wire per rank. Theory: 2 Psi (ddp, zero1, zero2), 3 Psi (zero3).
- **memory**, per rank, during that same instrumented step (sampled after every tensor
  operation, through the same dispatch mode):
  *total* = bytes the process has allocated (glibc `mallinfo2` in-use + mmapped on CPU,
  `torch.cuda.memory_allocated` / `max_memory_allocated` on GPU) above what it had before
  the configuration was built: everything, C++-held buffers (DDP buckets, gloo, autograd's
  saved activations) included. *parameters*, *gradients*, *optimizer_states*: bytes of the
  distinct storages each system holds in that role, classified with `zerokit.memory.census`'s
  rules (first claim wins: parameters, then gradients, then optimizer state); DTensors
  (FSDP2) count their local shard, and FSDP2's unsharded parameters and all-gather buffers
  count as parameters while they hold memory. *other* = total - the three (activations,
  communication buffers, temporaries). Each column is its own peak over the step.
- **loss**: the mean loss of an evaluation batch after training, and of every training step;
  the table shows the difference from DDP + AdamW, which all of them should match to
  float rounding (they all compute AdamW on the mean gradient of the same global batch).
- **floor**: what the step would cost with perfect software. The same forward/backward on
  a plain, unwrapped model with no communication, plus the fastest local AdamW update
  (fused `torch.optim.AdamW`, on one flat tensor) of the elements this rank updates (Psi
  for ddp, Psi/N for ZeRO), plus the raw collectives for the theoretical volume on one flat
  fp32 buffer (all-reduce Psi; reduce-scatter Psi + all-gather Psi; ZeRO-3 a second
  all-gather). Timed per stage, interleaved with the stage's two systems. Overlapping
  communication with compute can in principle go below it. On gloo (CPU) a reduce-scatter
  plus an all-gather take about twice as long as an all-reduce of the same buffer (gloo
  builds them with extra copies), which is why the ZeRO floors sit above DDP's.

Timing on a shared machine: the two systems of a stage are timed in alternating chunks of
two steps (with the floor), so a change in load falls on both alike; the JSON also keeps
each rank's CPU time per step and the load average before and after the run.

Output: the table on stdout, `bench-results/bench-ws<N>.json` and `bench-ws<N>.png`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokit
from zerokit.comm import CommCounter, WireCounter, all_gather, reduce_scatter, theory_volume
from zerokit.memory import census
from zerokit.models import TinyTransformer, loss_for, make_batch

__all__ = ["CONFIGS", "MODELS", "main", "run"]

# ---------------------------------------------------------------------------------------
# what is compared


@dataclass(frozen=True)
class Config:
    name: str
    stage: str  # ddp, zero1, zero2, zero3
    system: str  # "torch" or "zerokit"
    label: str


CONFIGS = [
    Config("torch-ddp", "ddp", "torch", "DDP + torch AdamW"),
    Config("zerokit-ddp", "ddp", "zerokit", "zerokit DistributedAdam"),
    Config("torch-zero1", "zero1", "torch", "DDP + ZeroRedundancyOptimizer"),
    Config("zerokit-zero1", "zero1", "zerokit", "zerokit ZeRO1Adam"),
    Config("torch-zero2", "zero2", "torch", "FSDP2 no reshard + AdamW"),
    Config("zerokit-zero2", "zero2", "zerokit", "zerokit ZeRO2Adam"),
    Config("torch-zero3", "zero3", "torch", "FSDP2 reshard + AdamW"),
    Config("zerokit-zero3", "zero3", "zerokit", "zerokit ZeRO3Adam"),
]
BASELINE = "torch-ddp"  # the loss every other configuration is compared with

# The PyTorch peers use their documented memory/speed options: gradients that live in
# DDP's communication buckets instead of beside them, and ZeroRedundancyOptimizer's
# parameters packed into one buffer per rank (one broadcast per rank, not one per tensor).
# torch.optim.AdamW keeps its defaults (its CPU default is the per-tensor loop).
DDP_OPTIONS = {"gradient_as_bucket_view": True}
ZERO_REDUNDANCY_OPTIONS = {"parameters_as_bucket_view": True}

# TinyTransformer sizes: widths not divisible by 4 (shards are never assumed even).
MODELS = {
    "tiny": dict(vocab=101, dim=22, n_layers=2, n_heads=2, seq_len=9, mlp_ratio=3, batch=2),
    "small": dict(vocab=2003, dim=222, n_layers=4, n_heads=6, seq_len=64, mlp_ratio=3, batch=4),
    "medium": dict(vocab=8191, dim=510, n_layers=6, n_heads=6, seq_len=128, mlp_ratio=3, batch=4),
    "large": dict(vocab=16381, dim=1022, n_layers=8, n_heads=14, seq_len=256, mlp_ratio=3, batch=4),
}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _model_kwargs(model_cfg):
    return {k: v for k, v in model_cfg.items() if k != "batch"}


def _build(config, model_cfg, device, seed):
    """A fresh (model, optimizer) for `config`; every rank starts from the same weights."""
    torch.manual_seed(seed)
    model = TinyTransformer(**_model_kwargs(model_cfg)).to(device)
    ddp_kw = dict(DDP_OPTIONS, device_ids=[device.index] if device.type == "cuda" else None)
    name = config.name
    if name == "torch-ddp":
        model = DDP(model, **ddp_kw)
        return model, torch.optim.AdamW(model.parameters(), **HYPER)
    if name == "zerokit-ddp":
        return model, zerokit.DistributedAdam(model.parameters(), **HYPER)
    if name == "torch-zero1":
        model = DDP(model, **ddp_kw)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                              **ZERO_REDUNDANCY_OPTIONS, **HYPER)
    if name == "zerokit-zero1":
        return model, zerokit.ZeRO1Adam(model.parameters(), **HYPER)
    if name in ("torch-zero2", "torch-zero3"):
        # zero2: nothing resharded after forward (one all-gather per step, like ZeRO-2's
        # all-gather of updated weights); zero3: FSDP2's default, blocks reshard after
        # forward and are gathered again for backward, the root stays gathered.
        reshard = False if name == "torch-zero2" else None
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return model, torch.optim.AdamW(model.parameters(), **HYPER)
    if name == "zerokit-zero2":  # buckets of one block, as FSDP2 communicates per block
        block_mib = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters()) / 2**20
        return model, zerokit.ZeRO2Adam(model.parameters(), bucket_mb=block_mib, **HYPER)
    if name == "zerokit-zero3":  # FSDP2's units: one per block, the rest in the root
        return model, zerokit.ZeRO3Adam(model, units=list(model.blocks), **HYPER)
    raise ValueError(f"unknown configuration {name!r}")


# ---------------------------------------------------------------------------------------
# measuring memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


def _libc_mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _libc_mallinfo2()


def allocated_bytes(device) -> int:
    """Bytes this process has allocated right now on `device` (CPU: the whole C heap)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd  # in use in the arenas + large blocks (mmapped)


def _local(t):
    """A DTensor's local shard (FSDP2); a plain tensor as it is."""
    return getattr(t, "_local_tensor", t)


def holdings(model, optimizer) -> dict:
    """{category: [tensors]} that a system holds as parameters, gradients, optimizer state."""
    params, grads, states = [], [], []
    for p in model.parameters():
        params.append(_local(p))
        if p.grad is not None:
            grads.append(_local(p.grad))
    for m in model.modules():  # FSDP2's own buffers (private API: best effort)
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in getattr(get_state(), "_fsdp_param_groups", []):
            for fp in group.fsdp_params:
                params.append(fp._sharded_param_data)
                params.extend(getattr(fp, "all_gather_outputs", []))
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    params.append(_local(unsharded))
                    if unsharded.grad is not None:
                        grads.append(_local(unsharded.grad))
    declared = getattr(optimizer, "memory_categories", None)
    if declared is not None:  # zerokit optimizers list their flat buffers and shards
        cats = declared()
        params += cats.get("parameters", [])
        grads += cats.get("gradients", [])
        states += cats.get("optimizer_states", [])
    for opt in (optimizer, getattr(optimizer, "optim", None)):  # ZeroRedundancyOptimizer.optim
        for state in getattr(opt, "state", {}).values():
            if isinstance(state, dict):
                states += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return {"parameters": params, "gradients": grads, "optimizer_states": states}


MODEL_STATE = ("parameters", "gradients", "optimizer_states")


class _Declared:
    """Hands `holdings` to zerokit.memory.census as an optimizer's declared categories."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def memory_categories(self):
        return holdings(self.model, self.optimizer)


class Instrument(CommCounter):
    """Counts collectives (CommCounter) and samples memory after every tensor operation:
    the process's allocated bytes, and census(scan=False) of what the system holds."""

    def __init__(self, model, optimizer, device, baseline):
        super().__init__()
        self.model, self.optimizer, self.device, self.baseline = model, optimizer, device, baseline
        self.peak = dict.fromkeys(MODEL_STATE + ("other", "total"), 0)
        self.at_peak = {}  # the sample where the total was highest, and the operation before it
        self.samples = 0
        self._last_total = None

    def sample(self, op=None):
        total = allocated_bytes(self.device) - self.baseline
        if total == self._last_total and op is not None:
            return  # nothing allocated or freed by this operation (a view, a hook, ...)
        self._last_total = total
        held = census(None, _Declared(self.model, self.optimizer), self.device.type, scan=False)
        cats = {k: held[k] for k in MODEL_STATE}
        cats["other"] = max(total - sum(cats.values()), 0)
        cats["total"] = total
        for k, v in cats.items():
            self.peak[k] = max(self.peak[k], v)
        if total >= self.at_peak.get("total", -1):
            self.at_peak = {**cats, "after_op": op}
        self.samples += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.sample(str(func))
        return out

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.sample()
        if self.device.type == "cuda":  # includes temporaries inside a single operation
            self.peak["total"] = max(self.peak["total"], torch.cuda.max_memory_allocated(self.device) - self.baseline)
        return out


# ---------------------------------------------------------------------------------------
# running one configuration (inside a worker)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(model_cfg, step, rank, world_size, device):
    """This rank's slice of global batch number `step` (the same stream for every config)."""
    micro = model_cfg["batch"]
    x, y = make_batch("transformer", micro * world_size, seed=1000 + step,
                      vocab=model_cfg["vocab"], seq_len=model_cfg["seq_len"])
    sl = slice(rank * micro, (rank + 1) * micro)
    return x[sl].to(device), y[sl].to(device)


def _eval_batch(model_cfg, device):
    x, y = make_batch("transformer", 2 * model_cfg["batch"], seed=999_999,
                      vocab=model_cfg["vocab"], seq_len=model_cfg["seq_len"])
    return x.to(device), y.to(device)


def _train_step(model, opt, x, y):
    loss = loss_for("transformer", model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class _Run:
    """One live configuration: its model, optimizer, step counter and measurements."""

    def __init__(self, config, rank, world_size, opts, device):
        self.config, self.rank, self.world_size, self.opts, self.device = config, rank, world_size, opts, device
        gc.collect()
        self.baseline = allocated_bytes(device)  # what the process held before this config
        self.model, self.opt = _build(config, opts["model"], device, opts["seed"])
        self.step, self.losses, self.times, self.cpu_times = 0, [], [], []

    def batch(self):
        return _batch(self.opts["model"], self.step, self.rank, self.world_size, self.device)

    def train(self, timed=False):
        x, y = self.batch()
        if timed:
            dist.barrier()
            _sync(self.device)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = _train_step(self.model, self.opt, x, y)
        _sync(self.device)
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.cpu_times.append(time.process_time() - c0)  # all threads of this rank
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
            loss = _train_step(self.model, self.opt, x, y)
        self.losses.append(loss.item())
        self.step += 1

    def result(self):
        ex, ey = _eval_batch(self.opts["model"], self.device)
        with torch.no_grad():
            final = loss_for("transformer", self.model(ex), ey).item()
        inst = self.inst
        return {
            "name": self.config.name,
            "step_times_s": self.times,
            "step_cpu_s": self.cpu_times,
            "train_losses": self.losses,
            "final_loss": final,
            "memory": {**inst.peak, "samples": inst.samples, "at_peak": inst.at_peak},
            "comm": {"table": inst.table(), "volume_bytes": inst.volume_bytes(), "sent_bytes": inst.sent_bytes(),
                     "calls": inst.count(), "wire_bytes": self.wire.sent_bytes},
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
        run = _Run(config, rank, world_size, opts, device)
        run.prepare()
        runs.append(run)
    floor = _Floor(configs[0].stage, rank, world_size, opts, device, psi)
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


# ---------------------------------------------------------------------------------------
# the floor: compute with no communication, plus the raw collectives (inside a worker)


class _Floor:
    """A stage's floor, timed in the same rotation as the stage's configurations.

    Each repetition times, each behind a barrier: forward + backward of a plain model (no
    wrapper, no hooks, no communication); the fastest local update this PyTorch has (fused
    AdamW; zerokit's adamw_update_ where there is no fused kernel) of the elements one rank
    updates, as one flat tensor; the raw collectives of the stage's theoretical volume on
    one flat fp32 buffer.
    """

    COLLECTIVES = {"ddp": ("all_reduce",), "zero1": ("reduce_scatter", "all_gather"),
                   "zero2": ("reduce_scatter", "all_gather"), "zero3": ("reduce_scatter", "all_gather", "all_gather")}

    def __init__(self, stage, rank, world_size, opts, device, psi):
        self.device = device
        torch.manual_seed(opts["seed"])
        self.model = TinyTransformer(**_model_kwargs(opts["model"])).to(device)
        self.x, self.y = _batch(opts["model"], 0, rank, world_size, device)
        shard = -(-psi // world_size)
        n = psi if stage == "ddp" else shard
        self.flat = torch.zeros(n, device=device, requires_grad=True)
        self.flat.grad = torch.randn(n, device=device)
        try:
            self.opt = torch.optim.AdamW([self.flat], fused=True, **HYPER)
            self.opt.step()
            self.update, self.update_impl = self.opt.step, "torch.optim.AdamW(fused=True)"
        except (RuntimeError, TypeError):  # no fused kernel for this device
            m, v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
            hp = dict(lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"])
            self.update = lambda: zerokit.adamw_update_(self.flat.data, self.flat.grad, m, v, 1, **hp)
            self.update_impl = "zerokit.adamw_update_"
        self.full = torch.randn(shard * world_size, device=device)
        self.part = torch.empty(shard, device=device)
        self.collectives = self.COLLECTIVES[stage]
        self.times = {"forward_backward": [], "update": [], "comm": []}
        self.train(timed=False)

    def fwd_bwd(self):
        loss_for("transformer", self.model(self.x), self.y).backward()
        self.model.zero_grad(set_to_none=True)

    def comm(self):
        for op in self.collectives:
            if op == "all_reduce":
                dist.all_reduce(self.full)
            elif op == "reduce_scatter":
                reduce_scatter(self.part, self.full)
            else:
                all_gather(self.full, self.part)

    def _time(self, fn):
        dist.barrier()
        _sync(self.device)
        t0 = time.perf_counter()
        fn()
        _sync(self.device)
        return time.perf_counter() - t0

    def train(self, timed=True):
        times = {"forward_backward": self._time(self.fwd_bwd), "update": self._time(self.update),
                 "comm": self._time(self.comm)}
        if timed:
            for k, v in times.items():
                self.times[k].append(v)


def warm_process(rank, world_size, opts, device):
    """Pay one-time costs before anything is measured: kernels' first-use caches, the
    autograd engine, gloo's buffers for each collective. Otherwise the first configuration
    would carry a few MiB and milliseconds that belong to the process, not to it."""
    torch.manual_seed(opts["seed"])
    model = TinyTransformer(**_model_kwargs(opts["model"])).to(device)
    for step in range(2):
        x, y = _batch(opts["model"], step, rank, world_size, device)
        loss_for("transformer", model(x), y).backward()
    full = torch.zeros(world_size * 1024, device=device)
    part = torch.zeros(1024, device=device)
    dist.all_reduce(full)
    reduce_scatter(part, full)
    reduce_scatter(part, full, op=dist.ReduceOp.AVG)
    all_gather(full, part)
    dist.broadcast(full, 0)
    dist.barrier()


def _worker(rank, world_size, opts):
    device = zerokit.rank_device()
    torch.manual_seed(opts["seed"])
    psi = sum(p.numel() for p in TinyTransformer(**_model_kwargs(opts["model"])).parameters())
    warm_process(rank, world_size, opts, device)
    results, floors = [], {}
    selected = [c for c in CONFIGS if c.name in opts["configs"]]
    stages = [[c for c in selected if c.stage == st] for st in ("ddp", "zero1", "zero2", "zero3")]
    for stage_configs in (g for g in stages if g):
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


# ---------------------------------------------------------------------------------------
# putting the ranks' measurements together (in the launching process)


def _summarize(per_rank, opts, world_size):
    psi = per_rank[0]["psi"]
    n = world_size
    floors = {}
    for stage, f0 in per_rank[0]["floors"].items():
        parts = {}
        for k in ("forward_backward", "update", "comm"):  # per repetition the slowest rank, then the median
            parts[k] = [max(t) for t in zip(*(r["floors"][stage][k] for r in per_rank))]
        total = [sum(v) for v in zip(*parts.values())]
        floors[stage] = {**{f"{k}_s": statistics.median(v) for k, v in parts.items()},
                         "total_s": statistics.median(total), "update_impl": f0["update_impl"],
                         "collectives": list(f0["collectives"])}

    configs = []
    for i, entry in enumerate(per_rank[0]["configs"]):
        cfg = next(c for c in CONFIGS if c.name == entry["name"])
        ranks = [r["configs"][i] for r in per_rank]
        steps = [max(t) for t in zip(*(r["step_times_s"] for r in ranks))]
        med = statistics.median(steps) if steps else float("nan")
        train = [statistics.mean(v) for v in zip(*(r["train_losses"] for r in ranks))]
        theory = theory_volume(cfg.stage, psi) * 4  # fp32 bytes
        configs.append({
            **asdict(cfg),
            "step_time_s": {"median": med, "min": min(steps, default=med), "max": max(steps, default=med),
                            "per_step_slowest_rank": steps},
            "step_cpu_s_per_rank": [statistics.median(r["step_cpu_s"]) if r["step_cpu_s"] else None
                                    for r in ranks],
            "floor_s": floors[cfg.stage]["total_s"],
            "vs_floor": med / floors[cfg.stage]["total_s"],
            "memory_per_rank": [{k: r["memory"][k] for k in MODEL_STATE + ("other", "total")} for r in ranks],
            "memory_peak": {k: max(r["memory"][k] for r in ranks) for k in MODEL_STATE + ("other", "total")},
            "memory_at_peak_per_rank": [r["memory"]["at_peak"] for r in ranks],
            "comm": {"volume_bytes": max(r["comm"]["volume_bytes"] for r in ranks),
                     "sent_bytes": max(r["comm"]["sent_bytes"] for r in ranks),
                     "wire_bytes": max((r["comm"]["wire_bytes"] or 0 for r in ranks), default=0) or None,
                     "theory_volume_bytes": theory,
                     "vs_theory": max(r["comm"]["volume_bytes"] for r in ranks) / theory,
                     "calls": ranks[0]["comm"]["calls"], "by_op": ranks[0]["comm"]["table"]},
            "loss": {"final": ranks[0]["final_loss"], "train": train},
        })
    base = next((c for c in configs if c["name"] == BASELINE), configs[0] if configs else None)
    for c in configs:
        c["loss"]["baseline"] = base["name"]
        c["loss"]["final_diff"] = abs(c["loss"]["final"] - base["loss"]["final"])
        c["loss"]["max_train_diff"] = max((abs(a - b) for a, b in zip(c["loss"]["train"], base["loss"]["train"])),
                                          default=0.0)
    ratios = []
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        zk = next((c for c in configs if c["stage"] == stage and c["system"] == "zerokit"), None)
        peer = next((c for c in configs if c["stage"] == stage and c["system"] == "torch"), None)
        if zk and peer:
            ratios.append({
                "stage": stage, "zerokit": zk["name"], "peer": peer["name"],
                "time": zk["step_time_s"]["median"] / peer["step_time_s"]["median"],
                "memory": zk["memory_peak"]["total"] / max(peer["memory_peak"]["total"], 1),
                "model_state": sum(zk["memory_peak"][k] for k in MODEL_STATE)
                / max(sum(peer["memory_peak"][k] for k in MODEL_STATE), 1),
                "comm": zk["comm"]["volume_bytes"] / max(peer["comm"]["volume_bytes"], 1),
            })
    model_cfg = opts["model"]
    meta = {
        "world_size": n, "backend": per_rank[0]["backend"], "device": per_rank[0]["device"],
        "torch": torch.__version__, "zerokit": zerokit.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "model": {"name": opts["model_name"], **model_cfg, "parameters": psi,
                  "global_batch": model_cfg["batch"] * n},
        "steps": opts["steps"], "warmup": opts["warmup"], "seed": opts["seed"], "hyperparameters": HYPER,
        "peer_options": {"ddp": DDP_OPTIONS, "zero_redundancy_optimizer": ZERO_REDUNDANCY_OPTIONS},
        "units": ("FSDP2: one fully_shard per block, then the root; ZeRO3Adam: the same units; "
                  "ZeRO2Adam: gradient buckets of one block's size"),
        "how_measured": {
            "step_time": "barrier before each step; a step's time is the slowest rank's; median over timed steps",
            "memory": ("per rank, one step sampled after every tensor op: total = bytes allocated above the "
                       "pre-build level (CPU: glibc mallinfo2 in-use+mmapped; GPU: torch.cuda allocated); "
                       "parameters/gradients/optimizer_states = distinct storages each system holds in that "
                       "role (DTensor: local shard); other = total - those; each its own peak"),
            "comm": "zerokit.CommCounter over one step; volume in the ZeRO paper's convention",
            "floor": ("forward/backward of a plain model + fused AdamW of this rank's elements as one flat "
                      "tensor + raw collectives of the theoretical volume on one flat fp32 buffer; timed in the "
                      "same rotation as the stage's configurations; slowest rank per repetition, median"),
            "loss": "final = eval batch after training (rank 0); diffs against " + (base["name"] if base else BASELINE),
        },
    }
    return {"meta": meta, "floors": floors, "configs": configs, "ratios": ratios}


# ---------------------------------------------------------------------------------------
# the report


def _mib(b):
    return b / 2**20


def format_table(summary) -> str:
    meta, configs = summary["meta"], summary["configs"]
    m = meta["model"]
    lines = [
        f"world size {meta['world_size']} ({meta['backend']}, {meta['device']}), torch {meta['torch']}; "
        f"TinyTransformer '{m['name']}': {m['parameters'] / 1e6:.2f} M parameters (dim {m['dim']}, "
        f"{m['n_layers']} layers, vocab {m['vocab']}), {m['batch']} x {m['seq_len']} tokens per rank; "
        f"median of {meta['steps']} steps after {meta['warmup']} warm-up + 1 instrumented",
        "",
        f"{'configuration':32s} {'stage':5s} {'ms/step':>8s} {'floor':>7s} {'/floor':>6s} "
        f"{'comm MiB':>8s} {'theory':>7s} {'wire':>6s} {'params':>7s} {'grads':>7s} {'optim':>7s} {'other':>7s} "
        f"{'peak MiB':>8s} {'|dloss|':>8s}",
    ]
    for c in configs:
        mp = c["memory_peak"]
        lines.append(
            f"{c['label']:32s} {c['stage']:5s} {c['step_time_s']['median'] * 1e3:8.1f} {c['floor_s'] * 1e3:7.1f} "
            f"{c['vs_floor']:6.2f} {_mib(c['comm']['volume_bytes']):8.2f} "
            f"{_mib(c['comm']['theory_volume_bytes']):7.2f} {_mib(c['comm']['wire_bytes'] or float('nan')):6.2f} "
            f"{_mib(mp['parameters']):7.2f} {_mib(mp['gradients']):7.2f} {_mib(mp['optimizer_states']):7.2f} "
            f"{_mib(mp['other']):7.2f} {_mib(mp['total']):8.2f} {c['loss']['final_diff']:8.1e}")
    lines += [""] + [
        f"floor {stage:5s}: forward+backward {f['forward_backward_s'] * 1e3:6.1f} ms + update "
        f"{f['update_s'] * 1e3:5.1f} ms + {' + '.join(f['collectives'])} {f['comm_s'] * 1e3:6.1f} ms "
        f"= {f['total_s'] * 1e3:6.1f} ms" for stage, f in summary["floors"].items()]
    lines += ["", f"{'zerokit / PyTorch peer':32s} {'stage':5s} {'time':>6s} {'peak mem':>8s} "
                  f"{'model state':>11s} {'comm':>6s}"]
    for r in summary["ratios"]:
        lines.append(f"{r['zerokit'] + ' / ' + r['peer']:32s} {r['stage']:5s} {r['time']:6.2f} {r['memory']:8.2f} "
                     f"{r['model_state']:11.2f} {r['comm']:6.2f}")
    lines += [
        "",
        "comm: volume per rank per step, ZeRO paper's convention (a ring sends (N-1)/N of it); theory 2 Psi, "
        "3 Psi for zero3, fp32; wire: bytes the rank really wrote to its sockets in that step (/proc/self/io).",
        "memory: per rank (the highest), each column its own peak over one step, so they need not add up; "
        "peak = all bytes allocated, C++ buffers and activations included; other = peak - model state.",
        "ratios: zerokit / peer of median step time, peak memory (all), model state (parameters + gradients + "
        "optimizer state, own peaks) and comm volume.",
    ]
    # name the baseline: without torch-ddp (--configs) the first configuration stands in for it
    base = configs[0]["loss"]["baseline"] if configs else BASELINE
    lines.append(f"|dloss|: |final eval loss - {base}'s|" + ("" if base == BASELINE else f" ({BASELINE} not run)")
                 + ".")
    # the peers' AdamW and the floor's are different implementations: say which row uses which
    impls = sorted({f["update_impl"] for f in summary["floors"].values()})
    lines.append("update: torch rows torch.optim.AdamW's default implementation (per-tensor loop on CPU, "
                 f"foreach on CUDA), zerokit rows zerokit's own AdamW, floor {' / '.join(impls) or '-'}.")
    return "\n".join(lines)


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = summary["configs"]
    names = [c["label"] for c in configs]
    colors = ["#4e79a7" if c["system"] == "torch" else "#f28e2b" for c in configs]
    x = range(len(configs))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    ax.bar(x, [c["step_time_s"]["median"] * 1e3 for c in configs], color=colors)
    ax.scatter(x, [c["floor_s"] * 1e3 for c in configs], marker="_", s=600, color="black", label="floor", zorder=3)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("step time (blue: PyTorch, orange: zerokit)")
    ax.legend()
    ax = axes[1]
    # what was live at the moment of the peak, on the rank with the highest peak: sums to it
    at_peak = [max(c["memory_at_peak_per_rank"], key=lambda m: m.get("total", 0)) for c in configs]
    bottom = [0.0] * len(configs)
    for cat, col in zip(MODEL_STATE + ("other",), ("#59a14f", "#e15759", "#76b7b2", "#bab0ac")):
        vals = [_mib(m.get(cat, 0)) for m in at_peak]
        ax.bar(x, vals, bottom=bottom, color=col, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank at its peak, by category")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(x, [_mib(c["comm"]["volume_bytes"]) for c in configs], color=colors)
    ax.scatter(x, [_mib(c["comm"]["theory_volume_bytes"]) for c in configs], marker="_", s=600, color="black",
               label="theory (2Ψ / 3Ψ)", zorder=3)
    ax.set_ylabel("MiB per rank per step (paper convention)")
    ax.set_title("communication")
    ax.legend()
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    meta = summary["meta"]
    fig.suptitle(f"zerokit vs PyTorch, world size {meta['world_size']} ({meta['backend']}), "
                 f"{meta['model']['parameters'] / 1e6:.2f} M parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# entry points


def run(world_size=2, model="small", steps=20, warmup=2, configs=None, seed=0,
        launcher="forkserver", timeout=1800.0, out_dir="bench-results", make_plot=True, **model_overrides):
    """Run the benchmark and write its files; returns the summary (also in the JSON)."""
    model_cfg = dict(MODELS[model], **{k: v for k, v in model_overrides.items() if v is not None})
    names = [c.name for c in CONFIGS]
    configs = list(configs or names)
    unknown = set(configs) - set(names)
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; choose from {names}")
    opts = {"model": model_cfg, "model_name": model, "steps": steps, "warmup": warmup, "configs": configs,
            "chunk": 2, "seed": seed}
    t0, load_before = time.perf_counter(), os.getloadavg()
    per_rank = zerokit.launch(_worker, world_size, args=(opts,), launcher=launcher, timeout=timeout)
    summary = _summarize(per_rank, opts, world_size)
    summary["meta"]["wall_time_s"] = time.perf_counter() - t0
    # other processes share the cores: times are only as steady as the machine was
    summary["meta"]["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench-ws{world_size}"
    summary["files"] = {"json": str(stem.with_suffix(".json"))}
    if make_plot:
        plot(summary, stem.with_suffix(".png"))
        summary["files"]["plot"] = str(stem.with_suffix(".png"))
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1, default=float))
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerokit.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", "-n", type=int, default=2)
    p.add_argument("--model", choices=sorted(MODELS), default="small", help="TinyTransformer preset")
    p.add_argument("--dim", type=int, help="override the preset's width")
    p.add_argument("--n-layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the instrumented one")
    p.add_argument("--configs", nargs="+", metavar="NAME", help=f"subset of {[c.name for c in CONFIGS]}")
    p.add_argument("--launcher", choices=("forkserver", "torchrun"), default="forkserver")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--out", default="bench-results", help="folder for the JSON and the plot")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    summary = run(world_size=a.world_size, model=a.model, steps=a.steps, warmup=a.warmup, configs=a.configs,
                  seed=a.seed, launcher=a.launcher, timeout=a.timeout, out_dir=a.out, make_plot=not a.no_plot,
                  dim=a.dim, n_layers=a.n_layers, vocab=a.vocab, seq_len=a.seq_len, batch=a.batch)
    print()
    print(format_table(summary))
    print()
    print(f"wrote {', '.join(summary['files'].values())} in {time.perf_counter() - t0:.0f} s")
    return 0

