"""main(): `python -m zerokit.bench`'s options; prints the table and where the files went.
With --sweep, hands its other options to sweep.main (`python -m zerokit.bench --sweep --help`), with
--fsdp2 to fsdp2.main (`python -m zerokit.bench --fsdp2 --help`)."""

import argparse
import sys
import time

import zerokit.bench

from .runner import run
from .systems import CONFIGS, CONTROL_CONFIGS
from .table import format_table
from .workload import MODELS


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--sweep" in argv:  # a different run with its own options: sweep.py parses them
        from .sweep import main as sweep_main

        return sweep_main([a for a in argv if a != "--sweep"])
    if "--fsdp2" in argv:  # likewise: zerokit's fully_shard beside torch's, fsdp2.py's options
        from .fsdp2 import main as fsdp2_main

        return fsdp2_main([a for a in argv if a != "--fsdp2"])
    p = argparse.ArgumentParser(prog="python -m zerokit.bench", description=zerokit.bench.__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", "-n", type=int, default=2)
    p.add_argument("--model", choices=sorted(MODELS), default="small", help="TinyTransformer preset, or a plain MLP")
    p.add_argument("--dim", type=int, help="override the preset's width")
    p.add_argument("--n-layers", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the instrumented one")
    p.add_argument("--configs", nargs="+", metavar="NAME", help=f"subset of {[c.name for c in CONFIGS]}")
    p.add_argument("--fsdp-controls", action="store_true",
                   help=f"FSDP2's controls, FSDP2 beside zerokit.FullyShard: {CONTROL_CONFIGS}")
    p.add_argument("--node-size", type=int, help="ranks per node for the all-gather bytes inside and across nodes")
    p.add_argument("--launcher", choices=("forkserver", "torchrun"), default="forkserver")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--out", default="bench-results", help="folder for the JSON and the plot")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", action="store_true",
                   help="instead: how step time, model state and traffic grow with Ψ (about 1M up) and N (1, 2, 4), "
                        "beside theory; bench-results/sweep.json and sweep.png (options: --sweep --help)")
    p.add_argument("--fsdp2", action="store_true",
                   help="instead: zerokit.fully_shard beside torch's fully_shard with the same calls, fp32 and bf16, "
                        "N = 2 and 4: step time, peak memory per rank, ratios; bench-results/fsdp2.json "
                        "(options: --fsdp2 --help)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    configs = (a.configs or []) + (CONTROL_CONFIGS if a.fsdp_controls else [])
    summary = run(world_size=a.world_size, model=a.model, steps=a.steps, warmup=a.warmup, configs=configs or None,
                  seed=a.seed, launcher=a.launcher, timeout=a.timeout, out_dir=a.out, make_plot=not a.no_plot,
                  node_size=a.node_size,
                  dim=a.dim, n_layers=a.n_layers, vocab=a.vocab, seq_len=a.seq_len, batch=a.batch)
    print()
    print(format_table(summary))
    print()
    print(f"wrote {', '.join(summary['files'].values())} in {time.perf_counter() - t0:.0f} s")
    return 0
