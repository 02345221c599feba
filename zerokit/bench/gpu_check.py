r"""`make gpu-check`: every CUDA path of the course, in one command on one GPU, as one table.

    PYTHONPATH=. python3 -m zerokit.bench.gpu_check           # a GPU machine, its own torch, nothing installed
    make gpu-check                                            # the same (the .venv's python if there is one)
    python -m zerokit.bench.gpu_check --rehearse              # the same rows on the CPU (make test runs it)

The course is built and tested on CPUs (gloo); its CUDA paths are the branches that only a
GPU takes: NCCL and the device a rank computes on (zerokit.launcher.backend), the CUDA memory
counters (zerokit.memory, the bench's accounting), pinned-memory offload (zerokit.offload),
checkpoint files written from GPU tensors, the bench's timing, zerokit.fully_shard's mesh on the
device (bench --fsdp2 beside torch's fully_shard). One row per path and what it
was compared with; the command exits 1 if any row fails, 0 otherwise, and 0 with one line
where there is no GPU. `cuda_branches()` lists every such branch in zerokit's source, and
tests/test_gpu_check.py fails when one has no row here (COVERS).

One GPU and several ranks: NCCL refuses two ranks on one device, so with fewer GPUs than ranks
the course runs gloo, its ranks on the CPU (a laptop's setting: `zerokit.rank_device()`).
`ZEROKIT_DEVICE=cuda` puts gloo's ranks on the GPU, sharing it; the two-rank rows below run
that way, gloo moving CUDA tensors through host memory.

--rehearse runs every row on the CPU (gloo; "disk" stands in for pinned-memory offload; the
CUDA counters read "n/a"), so the rows' own logic is tested between GPU runs.
"""

import argparse
import ast
import contextlib
import functools
import gc
import io
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import zerokit
from zerokit.bench import alignment as align
from zerokit.bench import lesson_grades
from zerokit.bench import odd_shapes as odd
from zerokit.bench.workload import MODELS, make_model, rank_batch
from zerokit.launcher.backend import DEVICE_ENV
from zerokit.memory import MemoryProbe, census, theory_bytes
from zerokit.mixed_precision import MixedPrecision
from zerokit.models import build_model, model_loss, num_parameters
from zerokit.reference import global_batch, rank_slice
from zerokit.stages import STAGE_NAMES, get_stage, lessons_optimizer

KIND, BATCH, STEPS, LR, WD = "transformer", 12, 8, 1e-2, 0.1  # the zoo's transformer memorises one batch
FP32_ATOL = 1e-5  # the graders' fp32 tolerance (zerokit.grading.compare.TOLERANCES)
MIXED_LOSS_RTOL = 0.05  # per step, 16-bit vs fp32 (as tests/test_mixed_precision.py)
MEMORY_RTOL = 0.01  # census vs the paper's formula at rest: padding only
CUDA_SLACK = (0.05, 2**20)  # cuda allocated vs census: the allocator's rounding (rtol, bytes)
LAUNCH_TIMEOUT = 180.0


@dataclass
class Row:
    path: str  # which CUDA path
    compared: str  # with what
    ok: bool
    figure: str  # the number that decided it


@dataclass(frozen=True)
class Target:
    """Where the rows run: "cuda" (the check) or "cpu" (--rehearse); whose graded checks run (lesson_grades)."""

    device: str
    lessons: tuple = lesson_grades.LESSONS

    @property
    def gpu(self):
        return self.device == "cuda"

    @property
    def preset(self):  # the bench preset for memory, offload and timing rows
        return "small" if self.gpu else "tiny"


# ---------------------------------------------------------------------------------------
# inside the ranks


def _loss(model, x, y):
    return model_loss(KIND, model(x).float(), y)


def _batch(rank, world_size, device):
    """The batch every step memorises (the zoo's global batch 0), this rank's slice of it."""
    x, y = global_batch(KIND, 0, BATCH)
    return rank_slice(x, rank, world_size).to(device), rank_slice(y, rank, world_size).to(device)


def _reference(device):
    """One process, torch.optim.AdamW, the whole batch: losses and final weights. AdamW's default implementation
    for the device (multi-tensor on CUDA), as zerokit's stages take theirs (zerokit.multi_tensor)."""
    model = build_model(KIND).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    x, y = _batch(0, 1, device)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def _full_weights(stage, model, opt):
    gathered = get_stage(stage).gathered(opt)
    with gathered:  # copies: ZeRO-3 frees the gathered storage on leaving the block
        return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}


def _train(rank, world_size, stage, precision, device, offload=None, model=None):
    """A zerokit stage on this rank's slice of the batch: mean loss per step, final weights, the optimizer
    and the model."""
    model = model or build_model(KIND).to(device)
    opt = lessons_optimizer(stage, model, lr=LR, weight_decay=WD, precision=precision, offload=offload)
    x, y = _batch(rank, world_size, device)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model, x, y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses, _full_weights(stage, model, opt), opt, model


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _against_adamw(rank, world_size, runs):
    """Each (stage, precision name) of `runs` against one-process AdamW on this rank's device."""
    device = zerokit.rank_device()
    ref_losses, ref_weights = _reference(device)
    out = []
    for stage, name in runs:
        precision = None if name == "fp32" else MixedPrecision(name)
        try:
            losses, weights, opt, _ = _train(rank, world_size, stage, precision, device)
        except Exception as exc:  # one stage's failure is its own row, not the group's
            out.append((stage, name, None, f"{type(exc).__name__}: {exc}".splitlines()[0]))
            continue
        if precision is None:
            out.append((stage, name, _max_diff(weights, ref_weights), None))
        else:
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            out.append((stage, name, rel, {"first": losses[0], "last": losses[-1], "scale": opt.precision.loss_scale,
                                           "fell": losses[-1] < 0.8 * losses[0]}))
    return {"device": str(device), "backend": dist.get_backend(), "runs": out}


def _probe_launch(rank, world_size):
    t = torch.ones(3, device=zerokit.rank_device()) * (rank + 1)
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "device": str(zerokit.rank_device()), "sum": t.tolist()}


def _allocated(device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _warm_up(rank, world_size, device):
    """One forward and backward on a throwaway model, so that what torch allocates once per process
    (cuBLAS's workspaces: one per handle, and backward runs on autograd's own thread with its own
    handle; 32 MiB each on an H200) is in every baseline read after it, not in the first run's growth."""
    x, y = rank_batch(MODELS["tiny"], 0, rank, world_size, device)
    model_loss("transformer", make_model(MODELS["tiny"], device, seed=0)(x), y).backward()
    del x, y
    gc.collect()


def _shard_weights(opt):
    """The weights this rank's Adam updates, flat and on the CPU: the fp32 master under mixed precision
    (in host memory or files when offloaded), else the fp32 shard of the flat weights."""
    return {"shards": torch.cat([opt.weight_shard(i)[:].detach().to("cpu", torch.float32, copy=True)
                                 for i in range(len(opt.buckets))])}  # [:]: a tensor, also of a DiskTensor


def _memory(rank, world_size, preset):
    """Per stage, at rest (after step, before zero_grad): the paper's formula, the census, the CUDA counters.

    The CUDA counter and the census are both taken as growth over a baseline read after a warm-up
    forward and backward: the CUDA counter also holds what torch allocates once per process (cuBLAS's
    workspaces), which no tensor of the model stands for."""
    device = zerokit.rank_device()
    cfg = MODELS[preset]
    _warm_up(rank, world_size, device)
    base_cuda, base_census = _allocated(device), census(None, None, device.type)["total"]
    out = []
    for stage in STAGE_NAMES:
        model = make_model(cfg, device, seed=0)
        psi = num_parameters(model)
        opt = lessons_optimizer(stage, model, lr=1e-3)
        x, y = rank_batch(cfg, 0, rank, world_size, device)
        with MemoryProbe(model, opt, device=device.type) as probe:
            model_loss("transformer", model(x), y).backward()
            opt.step()
        gc.collect()
        held = census(model, opt, device.type)
        cuda = _allocated(device)
        out.append({"stage": stage, "psi": psi, "theory": theory_bytes(psi, stage, world_size), "census": held,
                    "census_growth": held["total"] - base_census,
                    "cuda_growth": None if cuda is None else cuda - base_cuda,
                    "cuda_peak": probe.cuda_peak, "census_peak": probe.peak["total"]})
        opt.zero_grad()
        del model, opt, probe, x, y
        gc.collect()
    return out


def _offload(rank, world_size, preset, place, runs):
    """Each (stage, precision) with offload=place against the same optimizer in device memory.

    The two runs must compute the same gradients from the same weights, so torch's deterministic
    algorithms are on (a GPU's backward may sum with atomics, in any order). Mixed precision is
    compared after the first step: from there on, where the CPU's Adam and the GPU's differ in the
    last bit of an fp32 master (6e-7 in fp32 on an H200), the 16-bit rounding of that master can flip,
    the next gradients follow other weights, and Adam turns a near-zero gradient's change of sign
    into a change of 2 lr (2.6e-3 after 3 steps, the first H200 run). Its later steps are held to the
    loss, as the other 16-bit rows are."""
    device = zerokit.rank_device()
    cfg = MODELS[preset]
    torch.use_deterministic_algorithms(True, warn_only=True)
    _warm_up(rank, world_size, device)
    out = []
    for stage, name in runs:
        precision = None if name == "fp32" else MixedPrecision(name)
        held, grown, weights, losses = {}, {}, {}, {}  # per run: the census at rest, the CUDA counter's growth
        for where in (None, place):
            gc.collect()  # what the last run left in reference cycles is gone before the baseline
            before = _allocated(device)
            model = make_model(cfg, device, seed=0)
            psi = num_parameters(model)  # before the optimizer: ZeRO-3 leaves the parameters empty
            opt = lessons_optimizer(stage, model, lr=1e-3, precision=precision, offload=where)
            weights[where], losses[where] = [], []
            for step in range(3):
                x, y = rank_batch(cfg, step, rank, world_size, device)
                loss = model_loss("transformer", model(x).float(), y)
                opt.scale_loss(loss).backward()
                opt.step()
                losses[where].append(loss.item())
                # Adam's own fp32 shard: 16-bit weights would hide a master's last bits
                weights[where].append(_shard_weights(opt))
                if step < 2:
                    opt.zero_grad()
            gc.collect()
            held[where] = census(model, opt, device.type)  # every live tensor on the device
            grown[where] = None if before is None else _allocated(device) - before
            # K bytes (8: m, v; 12: and the fp32 master) per element of the shards, padding included
            state_bytes = (8 if precision is None else 12) * sum(b.shard_numel for b in opt.buckets)
            opt.zero_grad()
            del model, opt
        compared = 0 if precision is not None else -1  # which step's shards decide
        out.append({"stage": stage, "precision": name, "steps": len(weights[place]),
                    "diff": _max_diff(weights[place][compared], weights[None][compared]),
                    "diff_last": _max_diff(weights[place][-1], weights[None][-1]),
                    "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses[place], losses[None])),
                    "freed": {k: held[None][k] - held[place][k] for k in held[None]},
                    "freed_cuda": None if grown[None] is None else grown[None] - grown[place],
                    "state_bytes": state_bytes,
                    "theory": theory_bytes(psi, stage, world_size, "fp32" if precision is None else "mixed")[
                        "optimizer_states"]})
    return out


def _checkpoint(rank, world_size, stages, folder):
    """Save after two steps, load into a fresh model and optimizer: weights and m, v bit for bit."""
    device = zerokit.rank_device()
    out = []
    for stage in stages:
        path = os.path.join(folder, stage)
        _, saved, opt, trained = _train(rank, world_size, stage, None, device)
        saved_state = [(s.exp_avg.cpu(), s.exp_avg_sq.cpu()) for s in opt.state_shards()]
        zerokit.checkpoint.save(path, trained, opt)
        model = build_model(KIND).to(device)
        fresh = lessons_optimizer(stage, model, lr=LR, weight_decay=WD)
        zerokit.checkpoint.load(path, model, fresh)
        loaded = _full_weights(stage, model, fresh)
        state = [(s.exp_avg.cpu(), s.exp_avg_sq.cpu()) for s in fresh.state_shards()]
        same = all(torch.equal(loaded[k], saved[k]) for k in saved) and all(
            torch.equal(a, b) for pair, other in zip(saved_state, state) for a, b in zip(pair, other))
        out.append({"stage": stage, "same": same, "bytes": sum(f.stat().st_size for f in Path(path).iterdir())})
    return out


# ---------------------------------------------------------------------------------------
# the rows, in the launching process


def _launch(fn, world_size, *args, env=None, backend="auto", launcher="forkserver"):
    return zerokit.launch(fn, world_size, args=args, backend=backend, launcher=launcher, timeout=LAUNCH_TIMEOUT,
                          echo=False, env=env)


def environment(target):
    """What this machine is: torch, its CUDA build, the GPU, NCCL."""
    if not target.gpu:
        return [Row("environment", "torch build, GPU, NCCL", True,
                    f"torch {torch.__version__}, no GPU (rehearsal on the CPU)")]
    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else "none"
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)  # an int in older torch
    return [Row("environment", "torch build, GPU, NCCL", True,
                f"torch {torch.__version__} (CUDA {torch.version.cuda}), {props.name} "
                f"{props.total_memory / 2**30:.0f} GiB x{torch.cuda.device_count()}, NCCL {nccl}")]


def launch_auto(target):
    """zerokit.launch(backend="auto") at world size 1 under torchrun: NCCL on cuda:0 (gloo on cpu rehearsing)."""
    got = _launch(_probe_launch, 1, launcher="torchrun")[0]
    want = ("nccl", "cuda:0") if target.gpu else ("gloo", "cpu")
    ok = (got["backend"], got["device"]) == want and got["sum"] == [1.0, 1.0, 1.0]
    return [Row("launch backend=auto", f"expects {want[0]} on {want[1]}, an all-reduce", ok,
                f"{got['backend']} on {got['device']}, all-reduce {got['sum']}")]


def _stage_rows(label, result):
    rows = []
    for stage, name, value, extra in result["runs"]:
        path = f"{label} {stage} {name}"
        if value is None:
            rows.append(Row(path, "vs torch.optim.AdamW", False, extra))
        elif name == "fp32":
            rows.append(Row(path, f"weights after {STEPS} steps vs torch.optim.AdamW, |d| <= {FP32_ATOL:g}",
                            value <= FP32_ATOL, f"max |d| {value:.1e}"))
        else:
            ok = value <= MIXED_LOSS_RTOL and extra["fell"]
            rows.append(Row(path, f"loss per step vs fp32 AdamW within {MIXED_LOSS_RTOL:.0%}, and falling", ok,
                            f"max rel d {value:.1e}, loss {extra['first']:.2f} -> {extra['last']:.2f}, "
                            f"scale {extra['scale']:g}"))
    return rows


ALL_RUNS = [(s, p) for p in ("fp32", "bf16", "fp16") for s in STAGE_NAMES]


def single_rank(target):
    """Every stage in fp32, bf16 and fp16 at world size 1 on NCCL, against AdamW on the same GPU."""
    result = _launch(_against_adamw, 1, ALL_RUNS)[0]
    return _stage_rows(f"{result['backend']} N=1", result)


def shared_gpu(target):
    """Two ranks on one GPU: gloo with CUDA tensors (ZEROKIT_DEVICE=cuda), each stage in fp32."""
    runs = [(s, "fp32") for s in STAGE_NAMES]
    result = _launch(_against_adamw, 2, runs, env={DEVICE_ENV: target.device}, backend="gloo")[0]
    return _stage_rows(f"gloo N=2 on {result['device']}", result)


def memory(target):
    """The CUDA counters beside zerokit.memory's census and the paper's formula, per stage, N = 2."""
    per_rank = _launch(_memory, 2, target.preset, env={DEVICE_ENV: target.device}, backend="gloo")
    rows = []
    for r in per_rank[0]:
        model_state = {k: r["census"][k] for k in ("parameters", "gradients", "optimizer_states")}
        off = max(abs(model_state[k] - r["theory"][k]) / r["theory"][k] for k in model_state)
        held, cuda = sum(model_state.values()), r["cuda_growth"]
        ok = off <= MEMORY_RTOL
        figure = f"theory {r['theory']['total'] / 2**20:.2f} MiB, census {held / 2**20:.2f}"
        if cuda is None:
            figure += ", CUDA counters n/a (cpu)"
        else:
            rtol, slack = CUDA_SLACK
            total = r["census_growth"]
            ok = ok and total <= cuda <= total * (1 + rtol) + slack and r["cuda_peak"] >= r["census_peak"]
            figure += (f" (all live {total / 2**20:.2f}), cuda allocated {cuda / 2**20:.2f}; "
                       f"peak cuda {r['cuda_peak'] / 2**20:.2f} >= census {r['census_peak'] / 2**20:.2f}")
        rows.append(Row(f"memory N=2 {r['stage']}",
                        "at rest: census vs the 4+4+8 Psi formula; cuda allocated vs census; peaks",
                        ok, figure))
    return rows


OFFLOAD_RUNS = [("zero1", "fp32"), ("zero2", "fp32"), ("zero3", "fp32"), ("zero2", "bf16")]


def offload(target):
    """offload="cpu" (pinned host memory, Adam on the CPU) against the optimizer in GPU memory."""
    place = "cpu" if target.gpu else "disk"
    per_rank = _launch(_offload, 1, target.preset, place, OFFLOAD_RUNS)
    rows = []
    for r in per_rank[0]:
        ok = r["diff"] <= FP32_ATOL
        if r["precision"] == "fp32":
            compared = f"Adam's fp32 shard after {r['steps']} steps"
            figure = f"max |d| {r['diff']:.1e}"
        else:
            ok = ok and r["loss_rel"] <= MIXED_LOSS_RTOL
            compared = f"the fp32 master after 1 step, the loss for {r['steps']}"
            figure = (f"max |d| {r['diff']:.1e} ({r['diff_last']:.1e} after {r['steps']}), "
                      f"loss rel d {r['loss_rel']:.1e}")
        # The census decides, the CUDA counter is shown beside it. On the H200 the counter's
        # difference moved with this check's own code, by whole multiples of 4 Psi: 22, 22, 22 and
        # 33 MiB for the four rows when the weights were read once, after counting; 33, 22, 11 and 39.5
        # (twice) when they and the loss are read after every step, the census 22, 22, 22 and 33
        # both times. The census sees every tensor Python can reach, so the rest is held where it
        # cannot (the allocator's blocks a side stream or a collective's work object still holds;
        # not tracked down). On the GPU nothing else may grow; on the CPU ("disk") the files' mapped
        # pages and this check's own copies of the shards are CPU tensors too ("other").
        freed = r["freed"]
        # all of the optimizer's state, its shards' padding (zerokit.flat) included; K Psi beside it
        ok = ok and freed["optimizer_states"] == r["state_bytes"] and (
            not target.gpu or freed["total"] == r["state_bytes"])
        theory = f"theory K Psi = {r['theory'] / 2**20:.2f} MiB + padding {r['state_bytes'] - r['theory']:.0f} B"
        if target.gpu:
            figure += f", frees {freed['total'] / 2**20:.2f} MiB of GPU tensors ({theory}"
            if freed["total"] != freed["optimizer_states"]:  # which category did not move as it should
                figure += "; " + ", ".join(f"{k} {v / 2**20:+.2f}" for k, v in freed.items() if v and k != "total")
            figure += f"), CUDA counter {r['freed_cuda'] / 2**20:.2f}"
        else:
            figure += f", optimizer-state tensors {freed['optimizer_states'] / 2**20:.2f} MiB fewer ({theory})"
        rows.append(Row(f"offload={place} {r['stage']} {r['precision']}",
                        f"{compared} vs in-memory state; device bytes freed vs K Psi", ok, figure))
    return rows


def checkpoint(target):
    """zerokit.checkpoint save and load from GPU tensors (the files' device branches)."""
    with tempfile.TemporaryDirectory(prefix="zerokit-gpu-check-") as folder:
        per_rank = _launch(_checkpoint, 1, ("zero2", "zero3"), folder)
    return [Row(f"checkpoint {r['stage']}", "save, load into a fresh model: weights, m, v bit for bit", r["same"],
                f"{r['bytes'] / 2**10:.0f} KiB written, {'equal' if r['same'] else 'DIFFERENT'}")
            for r in per_rank[0]]


def bench(target, out_dir):
    """The bench at world size 1: each zerokit stage (the lessons' classes and the wrappers) beside its
    PyTorch peer, same model and data."""
    from zerokit.bench.runner import run

    steps = 10 if target.gpu else 2
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        summary = run(world_size=1, model=target.preset, steps=steps, warmup=1, out_dir=out_dir, make_plot=False,
                      timeout=LAUNCH_TIMEOUT * 2)
    configs = {c["name"]: c for c in summary["configs"]}
    rows = []
    for r in summary["ratios"]:
        mine, peer = configs[r["zerokit"]], configs[r["peer"]]
        dloss = max(abs(mine["loss"]["final_diff"]), abs(peer["loss"]["final_diff"]))
        rows.append(Row(f"bench N=1 {r['zerokit']} ({summary['meta']['device']})",
                        f"{mine['label']} vs {peer['label']}: final loss within 1e-3", dloss <= 1e-3,
                        f"{mine['step_time_s']['median'] * 1e3:.1f} vs {peer['step_time_s']['median'] * 1e3:.1f} "
                        f"ms/step ({r['time']:.2f}x), peak memory {r['memory']:.2f}x, |dloss| {dloss:.1e}"))
    return rows


def _default_placement(rank, world_size, preset):
    """torch's fully_shard and zerokit's on a model built on the CPU, with no mesh given (each block, then the
    root): where each puts the parameters and the output (the default mesh's device), and the loss."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from zerokit.bench.workload import loss_of
    from zerokit.fully_shard.api import fully_shard as zerokit_fully_shard

    cfg = MODELS[preset]
    out = {}
    for impl, shard in (("torch", torch_fully_shard), ("zerokit", zerokit_fully_shard)):
        model = make_model(cfg, "cpu", seed=0)
        for block in model.blocks:
            shard(block)
        shard(model)
        x, y = rank_batch(cfg, 0, rank, world_size, "cpu")  # on the CPU: the root's forward moves them
        output = model(x)
        out[impl] = {"parameters": sorted({str(p.device) for p in model.parameters()}), "output": str(output.device),
                     "loss": loss_of(cfg, output, y.to(output.device)).item()}
    return out


def _shared_fsdp2(rank, world_size, preset, steps):
    """Two ranks on one device with gloo (ZEROKIT_DEVICE): torch's fully_shard and zerokit's, the same calls
    (each block, then the root) and AdamW, `steps` steps: on a GPU the reduce-scatters and the prefetched
    all-gathers run asynchronously (N = 1 has no reduce-scatter at all). Each step's loss, and the weights."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerokit.bench import fsdp2 as bench
    from zerokit.bench.systems import Config
    from zerokit.bench.workload import train_step

    device = zerokit.rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    cfg = MODELS[preset]
    out = {"device": str(device)}
    for impl in bench.IMPLS:
        config = Config(f"{impl}-fp32", "zero3", impl, bench.LABELS[impl], "fp32")
        model, opt = bench.build(config, cfg, device, 0, mesh)
        losses = []
        for step in range(steps):
            x, y = rank_batch(cfg, step, rank, world_size, device)
            losses.append(float(train_step(model, opt, x, y, cfg)))
        out[impl] = {"losses": losses, "weights": bench.full_weights(model)}
    return out


def fsdp2(target, out_dir):
    """zerokit.fully_shard beside torch's with the same calls on the device (bench --fsdp2 at N = 1): step time,
    peak memory (torch.cuda.max_memory_allocated), the same losses; and both default meshes on the device."""
    import math

    from zerokit.bench import fsdp2 as bench

    steps = 10 if target.gpu else 2
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        summary = bench.run(world_sizes=(1,), model=target.preset, steps=steps, warmup=1, out_dir=out_dir,
                            echo=False, timeout=LAUNCH_TIMEOUT * 2)
    rows = []
    for r in summary["rows"]:
        z, t, q = r["zerokit"], r["torch"], r["ratios"]
        figures = [z["step_time_s"]["median"], t["step_time_s"]["median"], z["peak_bytes"], t["peak_bytes"],
                   q["time"], q["memory"], z["final_loss"], t["final_loss"]]
        dloss = abs(z["final_loss"] - t["final_loss"])
        ok = all(math.isfinite(v) for v in figures) and min(z["peak_bytes"], t["peak_bytes"]) > 0 and dloss <= 1e-3
        same = "losses and weights bitwise" if r["losses_bitwise"] and r["weights_bitwise"] else f"|dloss| {dloss:.1e}"
        rows.append(Row(f"fsdp2 N=1 {r['policy']} ({summary['meta']['device']})",
                        "zerokit.fully_shard vs torch's, the same calls: final loss within 1e-3; ms/step, peak memory",
                        ok, f"{z['step_time_s']['median'] * 1e3:.1f} vs {t['step_time_s']['median'] * 1e3:.1f} ms/step "
                            f"({q['time']:.2f}x), peak {z['peak_bytes'] / 2**20:.1f} vs "
                            f"{t['peak_bytes'] / 2**20:.1f} MiB ({q['memory']:.2f}x), {same}"))
    placed = _launch(_default_placement, 1, target.preset)[0]
    want = "cuda:0" if target.gpu else "cpu"
    ok = all(p["parameters"] == [want] and p["output"] == want for p in placed.values()) and \
        abs(placed["zerokit"]["loss"] - placed["torch"]["loss"]) <= 1e-3
    compared = ("zerokit.fully_shard vs torch's, the same calls, 3 steps (reduce-scatters and prefetches "
                "asynchronous on a GPU): losses within 1e-3")
    try:  # its own row's verdict: a failure here (gloo with CUDA tensors) keeps the rows above
        shared = _launch(_shared_fsdp2, 2, target.preset, 3, env={DEVICE_ENV: target.device}, backend="gloo")[0]
    except Exception as exc:
        last = (str(exc).strip().splitlines() or [""])[-1]
        rows.append(Row(f"fsdp2 gloo N=2 on {target.device}", compared, False, f"{type(exc).__name__}: {last[:150]}"))
    else:
        z, t = shared["zerokit"], shared["torch"]
        same = z["losses"] == t["losses"] and all(torch.equal(z["weights"][n], w) for n, w in t["weights"].items())
        dloss = max(abs(a - b) for a, b in zip(z["losses"], t["losses"]))
        rows.append(Row(f"fsdp2 gloo N=2 on {shared['device']}", compared, dloss <= 1e-3,
                        "losses and weights bitwise" if same else f"max |dloss| {dloss:.1e}"))
    rows.append(Row(f"fsdp2 default mesh ({want})", f"fully_shard with no mesh, model and batch on the CPU: expects "
                    f"parameters and output on {want}, torch's and zerokit's", ok,
                    "; ".join(f"{impl}: parameters on {', '.join(p['parameters'])}, output on {p['output']}, loss "
                              f"{p['loss']:.4f}" for impl, p in placed.items())))
    return rows


def _all_reduce(tensor, on_input_device=True):
    """Lesson 00's exercise: every buffer on the input's device; on_input_device=False is the slip the
    lessons warn about, buffers made without device= (they land on the CPU)."""
    from zerokit.comm import all_gather, reduce_scatter

    device = tensor.device if on_input_device else torch.device("cpu")
    n, numel = dist.get_world_size(), tensor.numel()
    chunk = -(-numel // n)
    padded = torch.zeros(chunk * n, dtype=tensor.dtype, device=device)
    padded[:numel] = tensor.reshape(-1)
    mine = torch.empty(chunk, dtype=tensor.dtype, device=device)
    reduce_scatter(mine, padded)
    all_gather(padded, mine)
    return padded[:numel].view_as(tensor).clone()


def lesson_checks(target):
    """Lesson 00's graded checks on the rank's device: a right answer passes; one that allocates on the
    CPU fails on a GPU (and passes on a laptop's CPU, as the lesson says)."""
    from zerokit.grading import lesson00
    from zerokit.grading.harness import CheckFailed

    before = os.environ.get(DEVICE_ENV)
    os.environ[DEVICE_ENV] = target.device  # the ranks inherit it: their rank_device()
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            lesson00.check_numerics(_all_reduce)
            lesson00.check_traffic(_all_reduce)
            try:
                lesson00.check_numerics(functools.partial(_all_reduce, on_input_device=False))
                slip = "passed"
            except CheckFailed as exc:
                slip = "failed: " + str(exc).splitlines()[0]
    finally:
        if before is None:
            os.environ.pop(DEVICE_ENV)
        else:
            os.environ[DEVICE_ENV] = before
    expected_slip = "failed" if target.gpu else "passed"
    return [Row(f"lesson 00 checks on {target.device}", "right answer passes both checks; CPU buffers "
                + ("fail" if target.gpu else "pass on cpu"), slip.startswith(expected_slip),
                f"right: passed; CPU buffers: {slip[:110]}")]


def lesson_grades_on_device(target):
    """Lessons 01-09: the solutions' graded checks (visible ones) with the ranks' tensors on the device."""
    rows = []
    for lesson in target.lessons:
        results = lesson_grades.run_lesson(lesson, target.device)
        failed = [f"{cell}: {reason}" for cell, ok, reason, _ in results if not ok]
        seconds = sum(t for *_, t in results)
        figure = f"{len(results) - len(failed)} of {len(results)} graded cells pass, {seconds:.1f} s"
        rows.append(Row(f"lesson {lesson[:2]} checks on {target.device}",
                        "the solution's graded checks, ZEROKIT_DEVICE: every cell passes", bool(results) and not failed,
                        figure + ("; " + "; ".join(failed) if failed else "")))
    return rows


def odd_shapes(target):
    """Odd sizes under deterministic algorithms: zerokit's optimizers against torch.optim's built the same way."""
    result = _launch(odd.compare, 1)[0]
    rows = []
    for name, mode, value, first, aligned in result["runs"]:
        path = f"odd shapes {name} {mode}"
        compared = f"weights after {odd.STEPS} steps vs torch.optim built the same way, deterministic: expect 0"
        if value is None:
            rows.append(Row(path, compared, False, first))
            continue
        figure = f"max |d| {value:.1e}" + (f" (from step {first})" if first else "")
        figure += f", LayerNorm weight {'' if aligned else 'not '}16-byte aligned"
        rows.append(Row(path, compared, value == 0, figure))
    return rows


def alignment(target):
    """zerokit's flat buffers aligned to 1 (plain), 16 (zerokit's) and 128 bytes (Megatron's): each class's step
    time in turns on one rank, and 16 against 128 bit for bit (bench/alignment.py)."""
    result = _launch(align.compare, 1, target.gpu, 12 if target.gpu else 3)[0]
    rows = []
    for name, r in result["classes"].items():
        ms = r["ms"]
        rows.append(Row(f"alignment {name} ({result['device']})",
                        f"median step at 1, 16, 128-byte alignment, in turns (Psi = {result['psi']:,}); "
                        f"16 vs 128: weights bitwise", r["diff_16_128"] == 0,
                        f"{ms[1]:.2f} / {ms[16]:.2f} / {ms[128]:.2f} ms (16 B: {ms[16] / ms[1]:.2f}x, "
                        f"128 B: {ms[128] / ms[1]:.2f}x of plain); 16 vs 128 max |d| {r['diff_16_128']:.1e}"))
    return rows


# ---------------------------------------------------------------------------------------
# the capstone's script, python -m zerokit.train, on the device

# the job: issue 39's on a GPU (25.6 M parameters, 8,192 tokens a step), a tiny one rehearsing
TRAIN_JOB = {True: ["--dim", "512", "--layers", "8", "--heads", "8", "--seq-len", "256", "--batch", "32"],
             False: ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "32", "--batch", "8",
                     "--data-mb", "0.25"]}
TRAIN_CURVE_STEPS = 4  # tests/test_train.py's curves: 4 steps, fp32 within FP32_ATOL, bf16 within 2% of fp32
TRAIN_BF16_RTOL = 0.02
TRAIN_TIMED = {True: ("12", "4"), False: ("3", "1")}  # train_peers' --steps and --warmup


def _train_curves(rank, world_size, runs):
    from zerokit.train import parse_args
    from zerokit.train import train as run

    return [run(rank, world_size, parse_args(argv)) for argv in runs]


def _train_torchrun(target, folder):
    """The job as a user starts it: torchrun, stage 0 in bf16; (return code, output, its --out record)."""
    import subprocess

    out = Path(folder) / "torchrun.json"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "zerokit.train",
            *TRAIN_JOB[target.gpu], "--device", target.device, "--stage", "0", "--precision", "bf16",
            "--steps", TRAIN_TIMED[target.gpu][0], "--warmup", TRAIN_TIMED[target.gpu][1], "--sample-bytes", "0",
            "--quiet", "--out", str(out)]
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, cwd=folder)
    record = json.loads(out.read_text()) if done.returncode == 0 and out.exists() else None
    return done.returncode, done.stdout + done.stderr, record


def _rate(record):
    mfu = "MFU n/a" if record.get("mfu") is None else f"MFU {record['mfu']:.1%}"
    return f"{record['tokens_per_s'] / 1e3:.1f}k tokens/s, {mfu}"


def train_script(target):
    """python -m zerokit.train on the device at N = 1: every stage's tokens/s and MFU in bf16 beside its
    PyTorch peer (zerokit.bench.train_peers, in turns), bf16 against fp32, fp32 against --impl torch; and
    one job started by torchrun, as users start it."""
    from zerokit.bench import train_peers

    job = [*TRAIN_JOB[target.gpu], "--device", target.device, "--quiet", "--sample-bytes", "0"]
    curve = [*job, "--steps", str(TRAIN_CURVE_STEPS)]
    runs = [[*curve, "--stage", str(s), *extra] for s in range(len(STAGE_NAMES))
            for extra in ([], ["--precision", "bf16"], ["--impl", "torch"])]
    curves = _launch(_train_curves, 1, runs, env={DEVICE_ENV: target.device})[0]
    steps, warmup = TRAIN_TIMED[target.gpu]
    with tempfile.TemporaryDirectory(prefix="zerokit-gpu-check-train-") as folder:
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            train_peers.main(["--nproc", "1", "--steps", steps, "--warmup", warmup, "--device", target.device,
                              "--timeout", str(LAUNCH_TIMEOUT), "--out", folder, "--", *TRAIN_JOB[target.gpu],
                              "--precision", "bf16"])
        timed = json.loads((Path(folder) / "runs.json").read_text())["runs"]
        rc, said, record = _train_torchrun(target, folder)
    rows, by_key = [], {(r["stage"], r["impl"]): r for r in reversed(timed)}  # the first of a key wins
    for s in range(len(STAGE_NAMES)):
        fp32, bf16, peer = (curves[3 * s + i] for i in range(3))
        losses = [[r["losses"][k] for k in sorted(r["losses"])] for r in (fp32, bf16, peer)]
        mean = [sum(c) / len(c) for c in losses]
        rel = abs(mean[1] - mean[0]) / mean[0]
        dpeer = max(abs(a - b) for a, b in zip(losses[0], losses[2]))
        mine, theirs = (by_key[s, impl] for impl in ("zerokit", "torch"))
        same_job = abs(mine["final_loss"] - theirs["final_loss"]) <= TRAIN_BF16_RTOL * theirs["final_loss"]
        on = {r["device"] for r in (fp32, bf16, peer, mine, theirs)}
        ok = rel <= TRAIN_BF16_RTOL and dpeer <= FP32_ATOL and same_job and on == {fp32["device"]} \
            and fp32["device"].startswith(target.device)
        rows.append(Row(f"train stage {s} ({fp32['device']}, {fp32['backend']})",
                        f"bf16 tokens/s and MFU vs the PyTorch peer in turns; bf16 mean loss vs fp32 within "
                        f"{TRAIN_BF16_RTOL:.0%}; fp32 curve vs --impl torch, |d| <= {FP32_ATOL:g}", ok,
                        f"{_rate(mine)} vs peer {_rate(theirs)} "
                        f"({mine['tokens_per_s'] / theirs['tokens_per_s']:.2f}x); "
                        f"bf16 {rel:.1e} off fp32; fp32 vs torch max |d| {dpeer:.1e}"))
    first = next((line for line in said.splitlines() if line.startswith("device:")), "no device line")
    ok = rc == 0 and record is not None and first.startswith(f"device: rank 0 on {target.device}") \
        and record["device"].startswith(target.device)
    rows.append(Row("train under torchrun, stage 0 bf16", "torchrun --standalone -m zerokit.train: the device it "
                    "says and uses, tokens/s, MFU", ok, (f"{first}; {_rate(record)}" if record else
                                                        f"exit {rc}: {said.strip()[-150:]}")[:200]))
    return rows


# Every CUDA branch in zerokit (cuda_branches()) -> the row group that runs it.
COVERS = {
    "launch_auto": ["zerokit/launcher/backend.py:resolve_backend", "zerokit/launcher/backend.py:rank_device",
                    "zerokit/launcher/worker.py:main"],
    # gloo with CUDA tensors: zerokit.collectives hands them to torch's own reduce-scatter and all-gather
    "shared_gpu": ["zerokit/collectives.py:_direct"],
    "memory": ["zerokit/memory.py:MemoryProbe.__enter__", "zerokit/memory.py:MemoryProbe.__exit__"],
    "offload": ["zerokit/offload.py:offload_place", "zerokit/offload.py:PinnedPlace.__init__",
                "zerokit/offload.py:PinnedPlace.begin", "zerokit/zero1.py:ShardedAdamState.update"],
    "checkpoint": ["zerokit/checkpoint/files.py:write_tensors", "zerokit/checkpoint/files.py:read_into"],
    # the capstone's script: where a rank runs, its peers on that device, MFU's peak, the bench of its stages
    "train": ["zerokit/train/device.py:placement", "zerokit/train/device.py:local_placement",
              "zerokit/train/device.py:prepare", "zerokit/train/device.py:take_place", "zerokit/train/build.py:build",
              "zerokit/stages.py:torch_peer", "zerokit/train/speed.py:device_peak",
              "zerokit/train/options.py:parse_args", "zerokit/train/job.py:main",
              "zerokit/bench/train_peers.py:measure", "zerokit/bench/train_peers.py:_sync",
              "zerokit/bench/train_peers.py:main", "zerokit/bench/train_peers.py:table"],
    "alignment": ["zerokit/bench/alignment.py:_sync"],  # 16 or 128 bytes, timed on the device
    "bench": ["zerokit/bench/accounting.py:allocated_bytes", "zerokit/bench/accounting.py:Instrument.__enter__",
              "zerokit/bench/accounting.py:Instrument.__exit__", "zerokit/bench/runs.py:run_stage",
              "zerokit/bench/timing.py:sync",
              "zerokit/fully_shard/wrapper.py:FullyShard.__init__"],  # wrapper-zero3: FullyShard's mesh on the GPU
    # zerokit.fully_shard on the device: its default mesh and device, the root moving the inputs there
    # (the shared row: two ranks on one GPU, where the reduce-scatter and the prefetch are asynchronous)
    "fsdp2": ["zerokit/bench/fsdp2.py:worker", "zerokit/fully_shard/api.py:_default_mesh",
              "zerokit/fully_shard/api.py:_device", "zerokit/fully_shard/state.py:ModuleState._root_pre_forward",
              "zerokit/fully_shard/group.py:ParamGroup._reduce", "zerokit/fully_shard/group.py:ParamGroup.prefetch"],
}

GROUPS = [("environment", environment), ("launch_auto", launch_auto), ("single_rank", single_rank),
          ("shared_gpu", shared_gpu), ("memory", memory), ("offload", offload), ("checkpoint", checkpoint),
          ("bench", bench), ("fsdp2", fsdp2), ("lesson_checks", lesson_checks),
          ("lesson_grades", lesson_grades_on_device), ("odd_shapes", odd_shapes), ("alignment", alignment),
          ("train", train_script)]


# ---------------------------------------------------------------------------------------
# the CUDA branches of zerokit's source


def _is_cuda_test(node):
    """A node that makes code depend on being on a GPU: torch.cuda.*, "cuda"/"nccl", `.type == "cpu"`."""
    if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
            and node.value.id == "torch":
        return True
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ("cuda", "nccl"):
        return True
    if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "type":
        return any(isinstance(c, ast.Constant) and c.value in ("cpu", "cuda") for c in node.comparators)
    return False


def cuda_branches(root=None):
    """Sorted "zerokit/<file>.py:<function>" for every function of zerokit whose code depends on a GPU
    (grading and this module excepted: the checks only call what the lessons teach)."""
    root = Path(root or Path(__file__).resolve().parents[2])
    found = set()
    for path in sorted((root / "zerokit").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("zerokit/grading/") or rel == "zerokit/bench/gpu_check.py":
            continue
        tree = ast.parse(path.read_text(), rel)

        def visit(node, scope):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, scope + [child.name])
                    continue
                if scope and _is_cuda_test(child) and not isinstance(node, ast.Expr):
                    found.add(f"{rel}:{'.'.join(scope)}")
                visit(child, scope)

        visit(tree, [])
    return sorted(found)


# ---------------------------------------------------------------------------------------
# the table and the command


def format_table(rows):
    """The rows as a fixed-width table, then a verdict line."""
    head = ("path", "compared", "result", "figure")
    cells = [(r.path, r.compared, "ok" if r.ok else "FAIL", r.figure) for r in rows]
    widths = [max(len(c[i]) for c in [head] + cells) for i in range(3)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(3)) + "  " + c[3] for c in [head] + cells]
    lines.insert(1, "-" * min(160, max(len(line) for line in lines)))
    failed = [r.path for r in rows if not r.ok]
    lines.append(f"{len(rows) - len(failed)} of {len(rows)} rows ok" + (f"; FAILED: {', '.join(failed)}" if failed
                                                                          else ""))
    return "\n".join(lines)


def run_checks(target, out_dir, groups=None, echo=print):
    """Run the row groups (all, or those named); a group that raises becomes one failed row."""
    rows = []
    for name, fn in GROUPS:
        if groups and name not in groups:
            continue
        t0 = time.perf_counter()
        try:
            got = fn(target, out_dir) if name in ("bench", "fsdp2") else fn(target)  # they write their JSON there
        except Exception as exc:  # a group's crash or timeout is its row's verdict, the others still run
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            got = [Row(name, (fn.__doc__ or "").strip().splitlines()[0], False, f"{type(exc).__name__}: {first}"[:200])]
            echo("".join(traceback.format_exception(exc))[-3000:])
        for r in got:
            echo(f"[{time.perf_counter() - t0:5.1f} s] {'ok  ' if r.ok else 'FAIL'} {r.path}: {r.figure}")
        rows.extend(got)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m zerokit.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="run every row on the CPU (gloo), for the tests")
    parser.add_argument("--groups", nargs="+", choices=[g for g, _ in GROUPS], help="only these row groups")
    parser.add_argument("--out", default="bench-results", help="folder for gpu-check.json (and the bench's JSON)")
    parser.add_argument("--lessons", nargs="+", metavar="NN", help="whose graded checks lesson_grades runs, e.g. 02 03 "
                        "(default: 01 to 09)")
    args = parser.parse_args(argv)
    lessons = lesson_grades.LESSONS
    if args.lessons:
        lessons = tuple(next((ls for ls in lesson_grades.LESSONS if ls.startswith(n)), n) for n in args.lessons)
        unknown = [ls for ls in lessons if ls not in lesson_grades.LESSONS]
        if unknown:
            parser.error(f"no such lesson: {', '.join(unknown)} (choose from {', '.join(lesson_grades.LESSONS)})")
    if not args.rehearse and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
              f"nothing to check ({sys.executable}; GPU_PYTHON=... makes make gpu-check use another)")
        return 0
    target = Target("cpu" if args.rehearse else "cuda", lessons)
    t0 = time.perf_counter()
    rows = run_checks(target, args.out, args.groups)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gpu-check.json").write_text(json.dumps(
        {"device": target.device, "torch": torch.__version__, "seconds": time.perf_counter() - t0,
         "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"\ngpu-check on {target.device}, {time.perf_counter() - t0:.0f} s:")
    print(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
