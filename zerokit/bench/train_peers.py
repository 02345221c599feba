r"""python -m zerokit.train's stages beside their PyTorch peers: the same job, tokens/s.

    python -m zerokit.bench.train_peers                                  # N = 1, 2, 4; stages 0-3
    python -m zerokit.bench.train_peers --nproc 2 --stages 3 --steps 60 -- --dim 256

Each (stage, N) is one `zerokit.launch` (forked ranks, gloo) in which every rank builds both
systems, zerokit's wrapper and the PyTorch peer that `python -m zerokit.train --impl torch`
builds, on the same model (TinyTransformer on bytes, same seed), and trains them in turns, one
step each, on the same batches with torch.optim.AdamW and the same hyperparameters
(zerokit.train's own step function):

| stage | zerokit (python -m zerokit.train)         | PyTorch peer (--impl torch) |
|-------|-------------------------------------------|-----------------------------|
| 0     | `zerokit.DataParallel` + AdamW            | `DistributedDataParallel(gradient_as_bucket_view=True)` + AdamW |
| 1     | `zerokit.ZeRO1(params, AdamW)`            | DDP + `ZeroRedundancyOptimizer(AdamW, parameters_as_bucket_view=True)` |
| 2     | `zerokit.ZeRO2(params, AdamW)`            | FSDP2 `fully_shard` on each block, then the root, `reshard_after_forward=False` + AdamW |
| 3     | `zerokit.FullyShard(model, units=blocks)` | FSDP2 `fully_shard` on each block, then the root (blocks reshard after forward) + AdamW |

Both sides keep their defaults otherwise (zerokit's bucket sizes, DDP's 25 MiB buckets), with
the documented memory options zerokit.bench uses for the peers (zerokit/bench/systems.py).

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

STAGE_PEERS = {
    0: "DDP + AdamW",
    1: "DDP + ZeroRedundancyOptimizer",
    2: "fully_shard, no reshard",
    3: "fully_shard",
}


def build_peer(stage, model, *, bf16=False, **hyper):
    """(model, optimizer): PyTorch's own implementation of `stage` on `model`, with torch.optim.AdamW(**hyper).

    bf16: autocast for the DDP-based peers (their weights stay fp32; the caller enters
    torch.autocast), FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for the
    others, as zerokit.train does for its own stages."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .systems import DDP_OPTIONS, ZERO_REDUNDANCY_OPTIONS

    if stage in (0, 1):
        model = DDP(model, **DDP_OPTIONS)
        if stage == 0:
            return model, torch.optim.AdamW(model.parameters(), **hyper)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                              **ZERO_REDUNDANCY_OPTIONS, **hyper)
    if stage in (2, 3):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        # stage 2: nothing resharded after forward (one all-gather per step, as ZeRO-2's all-gather
        # of the updated weights); stage 3: FSDP2's default, the blocks reshard after forward and
        # are gathered again for backward, the root stays gathered
        reshard = False if stage == 2 else None
        for block in model.blocks:  # FullyShard's units: one per block, the root keeps the rest
            fully_shard(block, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), **hyper)
    raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")


def cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


IMPLS = ("zerokit", "torch")


def rotation(rank, world_size, stage, train_args, threads):
    """Both systems of `stage` built on every rank and trained in turns, one step each, on the
    same batches; {impl: {"step_seconds": [...], "losses": {...}}} (rank 0's clock)."""
    import torch.distributed as dist

    from zerokit.train import autocast_for, build, parse_args, texts, train_step

    torch.set_num_threads(threads)
    args = {impl: parse_args(["--stage", str(stage), "--impl", impl, "--quiet", *train_args]) for impl in IMPLS}
    a = args["zerokit"]
    train_text, _, _ = texts(a)
    per_rank = a.batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    systems = {impl: build(args[impl], world_size)[:2] for impl in IMPLS}
    out = {impl: {"step_seconds": [], "losses": {}} for impl in IMPLS}
    for step in range(a.steps):
        # which system goes first alternates: neither always runs right after the other's step
        for impl in (IMPLS if step % 2 == 0 else IMPLS[::-1]):
            model, opt = systems[impl]
            autocast = autocast_for(args[impl])
            dist.barrier()  # every rank starts the step together: no rank's lag is charged to the other system
            t = time.perf_counter()
            total = train_step(args[impl], model, opt, train_text, step, rows, autocast)
            opt.zero_grad()
            dist.all_reduce(total)  # as zerokit.train's steps end
            seconds = time.perf_counter() - t
            if step >= a.warmup:
                out[impl]["step_seconds"].append(seconds)
            out[impl]["losses"][step + 1] = float(total) / world_size
    for impl in IMPLS:
        out[impl].update(stage=stage, impl=impl, precision=a.precision, world_size=world_size, start=0,
                         tokens_per_step=a.batch * a.seq_len, threads=threads)
    return out


def measure(stage, world_size, train_args, timeout):
    """rotation() on `world_size` forked ranks (gloo), each with max(1, cores // N) threads; rank 0's result,
    with each system's tokens/s: a step's tokens over its median step time."""
    import zerokit

    threads = max(1, cores() // world_size)
    out = zerokit.launch(rotation, world_size, args=(stage, train_args, threads), backend="gloo",
                         launcher="forkserver", timeout=timeout, echo=False)[0]
    for result in out.values():
        result["tokens_per_s"] = result["tokens_per_step"] / statistics.median(result["step_seconds"])
        result["final_loss"] = result["losses"][max(result["losses"])]
    return out


def table(rows, n_cores):
    lines = ["| stage | N | zerokit tokens/s | peer | peer tokens/s | zerokit / peer | final loss zerokit | "
             "final loss peer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = " (oversubscribed)" if r["world_size"] > n_cores else ""
        lines.append(f"| {r['stage']} | {r['world_size']}{note} | {r['zerokit']['tokens_per_s']:.0f} | "
                     f"{STAGE_PEERS[r['stage']]} | {r['torch']['tokens_per_s']:.0f} | "
                     f"{r['zerokit']['tokens_per_s'] / r['torch']['tokens_per_s']:.2f} | "
                     f"{r['zerokit']['final_loss']:.4f} | {r['torch']['final_loss']:.4f} |")
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
    p.add_argument("train_args", nargs="*", help="after --: more python -m zerokit.train options (--dim 64 ...)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup} to time")
    train_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), *args.train_args]
    n_cores, rows, runs = cores(), [], []
    for world_size in args.nproc:
        for stage in args.stages:
            out = measure(stage, world_size, train_args, args.timeout)
            rows.append({"stage": stage, "world_size": world_size, **{
                impl: {k: out[impl][k] for k in ("tokens_per_s", "final_loss")} for impl in IMPLS}})
            runs += out.values()
            print(f"stage {stage}, N = {world_size}: " + ", ".join(
                f"{impl} {out[impl]['tokens_per_s']:.0f} tokens/s (final loss {out[impl]['final_loss']:.4f})"
                for impl in IMPLS), flush=True)
    md = table(rows, n_cores)
    machine = (f"{n_cores} CPU cores, gloo, torch {torch.__version__}; {args.steps} steps per system, the last "
               f"{args.steps - args.warmup} timed (median step), the two systems in turns in one launch")
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
