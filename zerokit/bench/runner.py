"""run(): the whole benchmark from Python. One `zerokit.launch` (one process tree) runs every
selected configuration on every rank; the launching process puts the ranks' measurements
together and writes `bench-ws<N>.json` and `bench-ws<N>.png`."""

import json
import os
import re
import time
from pathlib import Path

import zerokit
from zerokit.widgets import progress

from .plot import plot
from .summary import summarize
from .systems import CONFIGS, DEFAULT_CONFIGS
from .worker import worker
from .workload import MODELS


def run(world_size=2, model="small", steps=20, warmup=2, configs=None, seed=0,
        launcher="forkserver", timeout=1800.0, out_dir="bench-results", make_plot=True, node_size=None,
        **model_overrides):
    """Run the benchmark and write its files; returns the summary (also in the JSON).

    configs: names from systems.CONFIGS (default: DEFAULT_CONFIGS, the rows without an FSDP2
    setting). node_size: ranks per "node" for the all-gather bytes inside and across nodes
    (default 2 where N is even, else N)."""
    model_cfg = dict(MODELS[model], **{k: v for k, v in model_overrides.items() if v is not None})
    names = [c.name for c in CONFIGS]
    configs = list(configs or DEFAULT_CONFIGS)
    unknown = set(configs) - set(names)
    if unknown:
        raise ValueError(f"unknown configurations {sorted(unknown)}; choose from {names}")
    node_size = node_size or (2 if world_size % 2 == 0 else world_size)
    opts = {"model": model_cfg, "model_name": model, "steps": steps, "warmup": warmup, "configs": configs,
            "chunk": 2, "seed": seed, "node_size": node_size}
    t0, load_before = time.perf_counter(), os.getloadavg()
    bar = progress(total=len(configs), desc="bench")

    def echo(rank, line):
        # rank 0 reports each configuration it finishes as "[k/n] ...": the bar follows it
        done = re.match(r"\[(\d+)/\d+\]", line)
        if done:
            bar.update(int(done.group(1)) - bar.n)
        bar.write(f"[rank {rank}] {line}")

    try:
        per_rank = zerokit.launch(worker, world_size, args=(opts,), launcher=launcher, timeout=timeout, echo=echo)
    finally:
        bar.close()
    summary = summarize(per_rank, opts, world_size)
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
