r"""python -m zerokit.train's stages beside their PyTorch peers: the same job, tokens/s.

    python -m zerokit.bench.train_peers                                  # N = 1, 2, 4; stages 0-3
    python -m zerokit.bench.train_peers --nproc 2 --stages 3 --steps 60 -- --dim 256

Each (stage, N) is one `zerokit.launch` (forked ranks) in which every rank builds both
systems, zerokit's wrapper and the PyTorch peer that `python -m zerokit.train --impl torch`
builds, on the same model (TinyTransformer on bytes, same seed), and trains them in turns, one
step each, on the same batches with torch.optim.AdamW and the same hyperparameters
(zerokit.train's own step function). The pairs (zerokit/train/peers.py has the table): DDP
(0), DDP + ZeroRedundancyOptimizer (1), FSDP2's fully_shard on each block and the root without
resharding after forward (2) and with it (3), against DataParallel, ZeRO1, ZeRO2 and FullyShard.

Both sides keep their defaults otherwise (zerokit's bucket sizes, DDP's 25 MiB buckets), with
the documented memory options zerokit.bench uses for the peers (zerokit/train/peers.py).

The ranks run where `python -m zerokit.train` would put them (zerokit/train/device.py): one GPU
per rank with NCCL where there are enough, gloo with the ranks sharing fewer GPUs, gloo on the
CPU without one; `-- --device cpu` keeps them on the CPU. On a GPU the table adds each
system's MFU (zerokit/train/speed.py), and the clock waits for the GPU's queued work (a sync
before each step's barrier, the loss read back at its end).

Timing: every step starts with a barrier and ends with the all-reduce of the loss, so rank 0's
clock covers the slowest rank; tokens/s is a step's tokens over the median step time after
--warmup. In turns, and with the median, because a shared machine is not quiet: measured as two
separate runs one after the other, the same configuration swung 4x from one run to the next
on this 2-core machine while other jobs ran, and a burst of other work now slows both systems'
steps alike. Which system goes first alternates every step. Each rank gets max(1, cores // N)
threads: N ranks on fewer cores than N are oversubscribed, and the table says so.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from zerokit.stages import get_stage

def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


IMPLS = ("zerokit", "torch")


def rotation(rank, world_size, stage, train_args, threads):
    """Both systems of `stage` built on every rank and trained in turns, one step each, on the
    same batches, on the rank's device (zerokit.train's: zerokit.rank_device() under the launch's
    backend); {impl: {"step_seconds": [...], "losses": {...}}} (rank 0's clock)."""
    import torch.distributed as dist

    from zerokit.train import autocast_for, build, parse_args, shape, texts, train_step
    from zerokit.train.device import take_place
    from zerokit.train.speed import device_peak, flops_per_token

    torch.set_num_threads(threads)
    args = {impl: parse_args(["--stage", str(stage), "--impl", impl, "--quiet", *train_args]) for impl in IMPLS}
    a = args["zerokit"]
    device = take_place(a.device)
    train_text, _, _ = texts(a)
    per_rank = a.batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    systems = {impl: build(args[impl], world_size, device)[:2] for impl in IMPLS}
    out = {impl: {"step_seconds": [], "losses": {}} for impl in IMPLS}
    for step in range(a.steps):
        # which system goes first alternates: neither always runs right after the other's step
        for impl in (IMPLS if step % 2 == 0 else IMPLS[::-1]):
            model, opt = systems[impl]
            autocast = autocast_for(args[impl], device)
            _sync(device)  # the other system's queued GPU work is not charged to this one
            dist.barrier()  # every rank starts the step together: no rank's lag is charged to the other system
            t = time.perf_counter()
            total = train_step(args[impl], model, opt, train_text, step, rows, autocast, device=device)
            opt.zero_grad()
            dist.all_reduce(total)  # as zerokit.train's steps end
            loss = float(total) / world_size  # waits for the step's work on a GPU, as zerokit.train's clock does
            seconds = time.perf_counter() - t
            if step >= a.warmup:
                out[impl]["step_seconds"].append(seconds)
            out[impl]["losses"][step + 1] = loss
    peak, source = device_peak(device, a.peak_tflops)
    where = [None] * world_size
    dist.all_gather_object(where, str(device))  # ranks sharing a GPU count it once (one machine: launch)
    for impl in IMPLS:
        out[impl].update(stage=stage, impl=impl, precision=a.precision, world_size=world_size, start=0,
                         tokens_per_step=a.batch * a.seq_len, threads=threads, device=str(device),
                         backend=dist.get_backend(), flops_per_token=flops_per_token(shape(a)),
                         peak_tflops=peak, peak_source=source, devices=len(set(where)))
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(stage, world_size, train_args, timeout, device="auto"):
    """rotation() on `world_size` forked ranks, each with max(1, cores // N) threads, placed as
    zerokit.train places them (NCCL with a GPU per rank, gloo sharing fewer GPUs, gloo on the CPU;
    `device` is its --device); rank 0's result, with each system's tokens/s (a step's tokens over its
    median step time) and MFU."""
    import zerokit
    from zerokit.train.device import placement
    from zerokit.train.speed import mfu

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    place = placement(0, world_size, gpus, device)
    threads = max(1, cores() // world_size)
    out = zerokit.launch(rotation, world_size, args=(stage, [*train_args, "--device", device], threads),
                         backend=place.backend, env=place.env, launcher="forkserver", timeout=timeout, echo=False)[0]
    for result in out.values():
        result["tokens_per_s"] = result["tokens_per_step"] / statistics.median(result["step_seconds"])
        result["final_loss"] = result["losses"][max(result["losses"])]
        result["mfu"] = mfu(result["tokens_per_s"], result["flops_per_token"], result["peak_tflops"],
                            result["devices"])
    return out


def _mfu(value):
    return "n/a" if value is None else f"{value:.1%}"


def table(rows, n_cores):
    lines = ["| stage | N | zerokit tokens/s | MFU | peer | peer tokens/s | MFU | zerokit / peer | "
             "final loss zerokit | final loss peer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        on_gpu = r.get("device", "cpu").startswith("cuda")
        note = " (oversubscribed)" if r["world_size"] > n_cores and not on_gpu else ""
        note += " (gloo, ranks sharing GPUs)" if on_gpu and r.get("backend") == "gloo" else ""
        zk, peer = r["zerokit"], r["torch"]
        lines.append(f"| {r['stage']} | {r['world_size']}{note} | {zk['tokens_per_s']:.0f} | {_mfu(zk.get('mfu'))} | "
                     f"{get_stage(r['stage']).peer} | {peer['tokens_per_s']:.0f} | {_mfu(peer.get('mfu'))} | "
                     f"{zk['tokens_per_s'] / peer['tokens_per_s']:.2f} | "
                     f"{zk['final_loss']:.4f} | {peer['final_loss']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerokit.bench.train_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=(0, 1, 2, 3))
    p.add_argument("--steps", type=int, default=40, help="steps per system, --warmup included")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    p.add_argument("--timeout", type=float, default=600, help="seconds one (stage, N) may take")
    p.add_argument("--out", type=Path, default=Path("bench-results/train_peers"),
                   help="folder for runs.json, table.md and loss.png")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the ranks run, as python -m zerokit.train --device")
    p.add_argument("train_args", nargs="*", help="after --: more python -m zerokit.train options (--dim 64 ...)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup} to time")
    train_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), *args.train_args]
    n_cores, rows, runs = cores(), [], []
    for world_size in args.nproc:
        for stage in args.stages:
            out = measure(stage, world_size, train_args, args.timeout, args.device)
            rows.append({"stage": stage, "world_size": world_size, "device": out["zerokit"]["device"],
                         "backend": out["zerokit"]["backend"], **{
                             impl: {k: out[impl][k] for k in ("tokens_per_s", "mfu", "final_loss")} for impl in IMPLS}})
            runs += out.values()
            where = f"{out['zerokit']['backend']}, rank 0 on {out['zerokit']['device']}"
            print(f"stage {stage}, N = {world_size} ({where}): "
                  + ", ".join(f"{impl} {out[impl]['tokens_per_s']:.0f} tokens/s, MFU {_mfu(out[impl]['mfu'])} "
                              f"(final loss {out[impl]['final_loss']:.4f})" for impl in IMPLS), flush=True)
    md = table(rows, n_cores)
    first = runs[0]
    where = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if first["device"].startswith("cuda")
             else f"{n_cores} CPU cores")
    peak = f", MFU of {first['peak_tflops']:g} TFLOPS ({first['peak_source']})" if first["peak_tflops"] else ""
    machine = (f"{where}, torch {torch.__version__}{peak}; "
               f"{args.steps} steps per system, the last {args.steps - args.warmup} timed (median step), the two "
               f"systems in turns in one launch")
    print(f"\n{md}\n\n{machine}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(f"{md}\n\n{machine}\n")
    (args.out / "runs.json").write_text(json.dumps({"machine": machine, "rows": rows, "runs": runs}, indent=1))
    from zerokit.train import plot_losses

    # the largest N only: in fp32 every curve is the same, and 24 lines would bury the legend
    top = max(args.nproc)
    plot_losses([r for r in runs if r["world_size"] == top], args.out / "loss.png",
                title=f"zerokit and its PyTorch peers, N = {top}: the same job")
    print(f"written: {args.out / 'table.md'}, {args.out / 'runs.json'}, {args.out / 'loss.png'}")


if __name__ == "__main__":
    sys.exit(main())
