r"""python -m zerokit.train's stages beside their PyTorch peers: the same job, tokens/s.

    python -m zerokit.bench.train_peers                                  # N = 1, 2, 4; stages 0-3
    python -m zerokit.bench.train_peers --nproc 2 --stages 3 --steps 60 -- --dim 256

Each (stage, N) is trained twice by `zerokit.train.train`, once with zerokit's wrapper and once
with `--impl torch`, which builds the peer below on the same model (TinyTransformer on bytes,
same seed), the same batches and torch.optim.AdamW with the same hyperparameters:

| stage | zerokit (python -m zerokit.train)         | PyTorch peer (--impl torch) |
|-------|-------------------------------------------|-----------------------------|
| 0     | `zerokit.DataParallel` + AdamW            | `DistributedDataParallel(gradient_as_bucket_view=True)` + AdamW |
| 1     | `zerokit.ZeRO1(params, AdamW)`            | DDP + `ZeroRedundancyOptimizer(AdamW, parameters_as_bucket_view=True)` |
| 2     | `zerokit.ZeRO2(params, AdamW)`            | FSDP2 `fully_shard` on each block, then the root, `reshard_after_forward=False` + AdamW |
| 3     | `zerokit.FullyShard(model, units=blocks)` | FSDP2 `fully_shard` on each block, then the root (blocks reshard after forward) + AdamW |

Both sides keep their defaults otherwise (zerokit's bucket sizes, DDP's 25 MiB buckets), with
the documented memory options zerokit.bench uses for the peers (zerokit/bench/systems.py).
Each run is its own `zerokit.launch` (forked ranks, gloo); tokens/s is a step's tokens over
rank 0's median step time after --warmup (every step ends in an all-reduce of the loss, so
rank 0 waits for the slowest; the median, not the mean, so that a burst of other work on the
machine moves it less). Each rank gets max(1, cores // N) threads: N ranks on fewer cores than N are
oversubscribed, and the table says so. The two systems of a cell run back to back, in
alternating order (so a slow drift of the machine does not always favour the same one),
--repeats times; the table keeps each system's fastest run, since whatever else the machine
does can only slow a run down.
"""

import argparse
import json
import os
import statistics
import sys
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


def run_one(stage, world_size, impl, train_args, timeout):
    """zerokit.train.train on `world_size` forked ranks; rank 0's result."""
    import zerokit
    from zerokit.train import parse_args, train

    threads = max(1, cores() // world_size)
    args = parse_args(["--stage", str(stage), "--impl", impl, "--threads", str(threads), "--quiet",
                       *train_args])
    return zerokit.launch(train, world_size, args=(args,), backend="gloo", launcher="forkserver",
                          timeout=timeout, echo=False)[0]


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
    p.add_argument("--steps", type=int, default=40, help="steps per run, --warmup included")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per system and cell, alternating; the table keeps each one's fastest (another "
                        "process on the machine only ever slows a run down)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    p.add_argument("--out", type=Path, default=Path("bench-results/train_peers"),
                   help="folder for runs.json, table.md and loss.png")
    p.add_argument("train_args", nargs="*", help="after --: more python -m zerokit.train options (--dim 64 ...)")
    args = p.parse_args(argv)
    train_args = ["--steps", str(args.steps), "--warmup", str(args.warmup), *args.train_args]
    n_cores, rows, runs, fastest, flip = cores(), [], [], {}, False
    for world_size in args.nproc:
        for stage in args.stages:
            row = {"stage": stage, "world_size": world_size}
            for _ in range(args.repeats):
                for impl in (("torch", "zerokit") if flip else ("zerokit", "torch")):
                    result = run_one(stage, world_size, impl, train_args, args.timeout)
                    speed = result["median_tokens_per_s"] = \
                        result["tokens_per_step"] / statistics.median(result["step_seconds"])
                    final = result["losses"][max(result["losses"])]
                    print(f"stage {stage}, N = {world_size}, {impl:>7}: {speed:8.0f} tokens/s (median step), "
                          f"{result['tokens_per_s']:8.0f} (mean), final loss {final:.4f}", flush=True)
                    best = row.setdefault(impl, {"tokens_per_s": 0.0, "all": []})
                    best["all"].append(speed)
                    runs.append(result)
                    if speed > best["tokens_per_s"]:
                        best.update(tokens_per_s=speed, final_loss=final)
                        fastest[stage, world_size, impl] = result
                flip = not flip
            rows.append(row)
    md = table(rows, n_cores)
    machine = (f"{n_cores} CPU cores, gloo, torch {torch.__version__}; {args.steps} steps per run, the last "
               f"{args.steps - args.warmup} timed (median step); the fastest of {args.repeats} runs per cell and system")
    print(f"\n{md}\n\n{machine}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(f"{md}\n\n{machine}\n")
    (args.out / "runs.json").write_text(json.dumps({"machine": machine, "rows": rows, "runs": runs}, indent=1))
    from zerokit.train import plot_losses

    # the largest N only: in fp32 every curve is the same, and 24 lines would bury the legend
    top = max(args.nproc)
    plot_losses([r for (_, n, _), r in fastest.items() if n == top], args.out / "loss.png",
                title=f"zerokit and its PyTorch peers, N = {top}: the same job")
    print(f"written: {args.out / 'table.md'}, {args.out / 'runs.json'}, {args.out / 'loss.png'}")


if __name__ == "__main__":
    sys.exit(main())
