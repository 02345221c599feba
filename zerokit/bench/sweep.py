r"""`python -m zerokit.bench --sweep`: how cost grows with the model size Ψ and the world size N.

    python -m zerokit.bench --sweep                          # Ψ = 1M .. 16M, N = 1, 2, 4
    python -m zerokit.bench --sweep --max-params 64e6 --steps 3
    python -m zerokit.bench --sweep --world-sizes 2 --stages zero2 zero3

For each N, one `zerokit.launch` runs every Ψ and stage (data parallel, ZeRO-1, ZeRO-2, ZeRO-3:
zerokit's classes, zerokit.stages.lessons_optimizer) in turn. Ψ grows by doubling from
--min-params up to --max-params (or the largest that fits in memory, whichever is smaller)
through the width of a TinyTransformer whose depth, vocabulary and sequence are fixed
(`model_for`). Per configuration, per rank, as the bench measures them:

- **step time**: the median over the timed steps of the slowest rank's step (timing.py:
  a barrier before each, forward + backward + step + zero_grad);
- **model-state bytes at rest**: right after opt.step() of the instrumented step, before
  zero_grad, parameters + gradients + optimizer state as zerokit.memory.census classifies
  the storages the system holds (accounting.py's rules): the steady state the ZeRO paper's
  table describes, beside theory_bytes(Ψ, stage, N, "fp32") (4 + 4 + 8 bytes per parameter,
  divided by N where the stage shards). Padding of each flat buffer to a multiple of N is the
  only excess. Each category's peak during the step (accounting.Instrument, which samples
  memory after every operation; --no-peak skips it) is in the JSON beside it;
- **bytes communicated**: zerokit.CommCounter over the same step, in the paper's convention
  (an all-reduce of Ψ counts 2Ψ), beside theory_volume(stage, Ψ) x 4 bytes: equal but for the
  padding, one presence flag per parameter tensor, and ZeRO-3's root unit (the position
  embedding and final norm here), gathered once rather than twice; and the bytes the rank
  really wrote to its sockets (zerokit.comm.WireCounter, gloo over TCP), beside what a ring
  puts on the wire per rank, theory x (N - 1) / N. Measured at N = 2 and 4: data parallel
  writes exactly that; gloo's reduce-scatter writes as many bytes as an all-reduce of the
  same buffer, so ZeRO-1/2 write 1.5 times it and ZeRO-3 4/3.

With N ranks of one thread each on fewer than N cores the ranks take turns on the cores:
their step times then show the trend, not what N machines would take (marked in the table
and the JSON). Bytes are exact whatever the load.

Output: `bench-results/sweep.json` (every measurement with its theory beside it),
`bench-results/sweep.png` (three panels against Ψ, log-log) and the table on stdout.
"""

import argparse
import gc
import json
import math
import os
import re
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import zerokit
from zerokit.comm import CommCounter, WireCounter, theory_volume
from zerokit.memory import census, theory_bytes
from zerokit.models import loss_for
from zerokit.stages import STAGE_NAMES, by_stage, lessons_optimizer
from zerokit.widgets import progress

from .accounting import MODEL_STATE, Held, Instrument, allocated_bytes
from .timing import time_together
from .workload import HYPER, make_model, rank_batch, train_step

LABELS = {"ddp": "data parallel", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
FP32 = 4
# The knob: the width of a TinyTransformer with everything else fixed (6 heads: widths are
# multiples of 6, not of 4, so shards are never even by luck). Ψ = 2 V d + S d + 2 d + L (10 d² + 9 d).
SHAPE = dict(vocab=2003, n_layers=4, n_heads=6, seq_len=32, mlp_ratio=3, batch=2)
MIN_PARAMS, MAX_PARAMS = 1e6, 16e6


def psi_of(cfg):
    v, d, s, n_layers, r = cfg["vocab"], cfg["dim"], cfg["seq_len"], cfg["n_layers"], cfg["mlp_ratio"]
    per_block = (3 + 1 + 2 * r) * d * d + (2 + 1 + 2 + r + 1) * d  # qkv, proj, fc, out; norms and biases
    return 2 * v * d + s * d + 2 * d + n_layers * per_block


def model_for(target, **shape):
    """The TinyTransformer configuration whose Ψ is nearest `target` (width in steps of n_heads)."""
    cfg = dict(SHAPE, **shape)
    step = cfg["n_heads"]
    a = cfg["n_layers"] * (4 + 2 * cfg["mlp_ratio"])
    b = 2 * cfg["vocab"] + cfg["seq_len"] + 2 + cfg["n_layers"] * (6 + cfg["mlp_ratio"])
    d = (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    cands = [max(step, step * k) for k in (math.floor(d / step), math.ceil(d / step))]
    cfg["dim"] = min(cands, key=lambda w: abs(psi_of(dict(cfg, dim=w)) - target))
    return cfg


def targets(min_params=MIN_PARAMS, max_params=MAX_PARAMS):
    """Ψ from min_params, doubling, up to max_params (both included)."""
    out, t = [], float(min_params)
    while t <= max_params * 1.0001:
        out.append(int(t))
        t *= 2
    return out


def available_bytes():
    """MemAvailable from /proc/meminfo (Linux); None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fits(psi, world_size, available):
    """A generous guess at the job's peak: per rank 16 Ψ of model state, as much again in
    flat copies, gathered units and temporaries; all ranks on this machine; within half of
    what is available."""
    return available is None or 32 * psi * world_size < 0.5 * available


def zero3_units(model):
    """ZeRO-3's gather units: each block, and the embedding and the head on their own, so that
    only the position embedding and the final norm stay in the root unit (gathered once per
    step, not twice): the traffic is 3Ψ but for them. As the demo cuts it."""
    from .demo import zero3_units as units

    return units(model)


def measure(stage, cfg, rank, world_size, device, opts):
    """One configuration on this rank: build, warm up, one instrumented step, timed steps."""
    gc.collect()
    baseline = allocated_bytes(device)
    model = make_model(cfg, device, opts["seed"])
    psi = sum(p.numel() for p in model.parameters())
    opt = lessons_optimizer(stage, model, units=zero3_units(model), **HYPER)  # only ZeRO-3 has units
    step = 0

    def batch():
        return rank_batch(cfg, step, rank, world_size, device)

    for _ in range(opts["warmup"]):
        train_step(model, opt, *batch())
        step += 1
    x, y = batch()
    # Instrument: a CommCounter that also samples memory after every operation (slower)
    inst = Instrument(model, opt, device, baseline) if opts["peak"] else CommCounter()
    with WireCounter() as wire, inst:  # nothing printed inside: the wire counter counts every write
        loss = loss_for("transformer", model(x), y)
        loss.backward()
        opt.step()
    # at rest: after step(), before zero_grad(): every model-state category in its steady state
    held = census(None, Held(model, opt), device.type, scan=False)
    at_rest = {k: held[k] for k in MODEL_STATE}
    opt.zero_grad(set_to_none=True)
    step += 1
    times = []
    for _ in range(opts["steps"]):
        x, y = batch()
        times.append(time_together(lambda: train_step(model, opt, x, y), device))
        step += 1
    out = {
        "stage": stage, "psi": psi, "step_times_s": times, "at_rest": at_rest,
        "peak": {k: inst.peak[k] for k in MODEL_STATE + ("other", "total")} if opts["peak"] else None,
        "volume_bytes": inst.volume_bytes(), "ring_sent_bytes": inst.sent_bytes(),
        "wire_bytes": wire.sent_bytes, "calls": inst.table(),
        "flat_buffers": len(getattr(opt, "buckets", ())), "param_tensors": len(list(model.parameters())),
        "loss": loss.item(),
    }
    return out


def worker(rank, world_size, opts):
    """What every rank runs for one world size: each Ψ, each stage, in turn."""
    from .worker import warm_process

    device = zerokit.rank_device()
    warm_process(rank, world_size, {"model": opts["models"][0], "seed": opts["seed"]}, device)
    gc.freeze()  # what the process holds now is never garbage: each configuration's collect skips it
    results, k, total = [], 0, len(opts["models"]) * len(opts["stages"])
    for cfg in opts["models"]:
        for stage in opts["stages"]:
            t0 = time.perf_counter()
            r = measure(stage, cfg, rank, world_size, device, opts)
            results.append(r)
            k += 1
            if rank == 0:
                print(f"[{k}/{total}] N={world_size} Ψ={r['psi'] / 1e6:6.2f}M {LABELS[stage]:<13} "
                      f"{statistics.median(r['step_times_s']) * 1e3:8.1f} ms/step (rank 0) "
                      f"in {time.perf_counter() - t0:5.1f} s", flush=True)
    return {"rank": rank, "results": results, "backend": dist.get_backend(), "device": str(device)}


def combine(per_rank, world_size, cfg_by_psi):
    """One row per configuration: the slowest rank's step, each rank's bytes (the highest), theory beside."""
    rows = []
    n = world_size
    cores = os.cpu_count() or 1
    for i, r0 in enumerate(per_rank[0]["results"]):
        ranks = [r["results"][i] for r in per_rank]
        stage, psi = r0["stage"], r0["psi"]
        steps = [max(t) for t in zip(*(r["step_times_s"] for r in ranks))]
        state = {k: max(r["at_rest"][k] for r in ranks) for k in MODEL_STATE}
        state["total"] = max(sum(r["at_rest"][k] for k in MODEL_STATE) for r in ranks)
        t_state = theory_bytes(psi, stage, n, "fp32")
        t_volume = theory_volume(stage, psi) * FP32
        t_ring = t_volume * (n - 1) / n
        volume = max(r["volume_bytes"] for r in ranks)
        wires = [r["wire_bytes"] for r in ranks]
        wire = None if None in wires else max(wires)  # None: no /proc/self/io (not Linux)
        rows.append({
            "psi": psi, "world_size": n, "stage": stage, "model": cfg_by_psi[psi],
            "oversubscribed": n > cores,
            "step_time_s": {"median": statistics.median(steps), "per_step_slowest_rank": steps},
            "model_state": {"measured": state, "theory": t_state, "ratio": state["total"] / t_state["total"],
                            "per_rank": [r["at_rest"] for r in ranks]},
            # what may legitimately exceed theory: each flat buffer's padding (under one alignment per
            # parameter and per shard, zerokit.flat), and one presence flag sent per parameter tensor
            "flat_buffers": r0["flat_buffers"], "param_tensors": r0["param_tensors"],
            "peak": ({k: max(r["peak"][k] for r in ranks) for k in MODEL_STATE + ("other", "total")}
                     if r0["peak"] is not None else None),
            "comm": {"volume_bytes": volume, "theory_volume_bytes": t_volume, "ratio": volume / t_volume,
                     "ring_sent_bytes": max(r["ring_sent_bytes"] for r in ranks), "theory_wire_bytes": t_ring,
                     "wire_bytes": wire, "wire_ratio": (wire / t_ring) if wire is not None and t_ring else None,
                     "calls": r0["calls"]},
            "loss": r0["loss"],
        })
    return rows


def run(world_sizes=(1, 2, 4), min_params=MIN_PARAMS, max_params=MAX_PARAMS, stages=STAGE_NAMES, steps=5, warmup=1,
        seed=0, launcher="forkserver", timeout=1800.0, out_dir="bench-results", make_plot=True, peak=True,
        **shape):
    """Run the sweep, write sweep.json (and sweep.png); returns the summary."""
    stages = list(stages)
    unknown = set(stages) - set(STAGE_NAMES)
    if unknown:
        raise ValueError(f"unknown stages {sorted(unknown)}; choose from {STAGE_NAMES}")
    shape = {k: v for k, v in shape.items() if v is not None}
    available = available_bytes()
    models, skipped = {n: [] for n in world_sizes}, []
    for t in targets(min_params, max_params):
        cfg = model_for(t, **shape)
        for n in world_sizes:
            if not fits(psi_of(cfg), n, available):
                skipped.append((n, cfg))
            elif cfg not in models[n]:
                models[n].append(cfg)
    t0, load_before = time.perf_counter(), os.getloadavg()
    total = sum(len(m) for m in models.values()) * len(stages)
    bar = progress(total=total, desc="sweep")
    rows, meta_ranks = [], {}
    done = 0
    try:
        for n in world_sizes:
            if not models[n]:
                continue

            def echo(rank, line, offset=done):
                m = re.match(r"\[(\d+)/\d+\]", line)
                if m:
                    bar.update(offset + int(m.group(1)) - bar.n)
                bar.write(f"[rank {rank}] {line}")

            opts = {"models": models[n], "stages": stages, "steps": steps, "warmup": warmup, "seed": seed,
                    "peak": peak}
            per_rank = zerokit.launch(worker, n, args=(opts,), launcher=launcher, timeout=timeout, echo=echo)
            rows += combine(per_rank, n, {psi_of(c): c for c in models[n]})
            meta_ranks = {"backend": per_rank[0]["backend"], "device": per_rank[0]["device"]}
            done += len(models[n]) * len(stages)
    finally:
        bar.close()
    meta = {
        "world_sizes": list(world_sizes), "stages": stages, "psi": sorted({r["psi"] for r in rows}),
        "targets": targets(min_params, max_params),
        "skipped_do_not_fit": [{"world_size": n, "psi": psi_of(c)} for n, c in skipped],
        "shape": dict(SHAPE, **shape), "knob": "TinyTransformer width (multiples of n_heads); the rest fixed",
        "steps": steps, "warmup": warmup, "seed": seed, "hyperparameters": HYPER, **meta_ranks,
        "cpu_count": os.cpu_count(), "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "torch": torch.__version__, "zerokit": zerokit.__version__,
        "wall_time_s": time.perf_counter() - t0,
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "how_measured": {
            "step_time": "barrier before each step; a step's time is the slowest rank's; median over timed steps",
            "model_state": ("after opt.step() of the instrumented step, before zero_grad: bytes of the distinct "
                            "storages held as parameters, gradients, optimizer state (zerokit.memory.census); "
                            "the highest rank; theory = zerokit.theory_bytes(psi, stage, N, 'fp32')"),
            "peak": "accounting.Instrument: each category's peak over the instrumented step, the highest rank",
            "comm": ("zerokit.CommCounter over the instrumented step, paper convention (all-reduce = 2x), the "
                     "highest rank; theory = zerokit.theory_volume(stage, psi) * 4 bytes"),
            "wire": ("bytes the rank wrote through system calls during the step (WireCounter, gloo over TCP), "
                     "the highest rank; theory = theory_volume * 4 * (N - 1) / N, a ring's share per rank"),
            "oversubscribed": "N ranks of one thread each on fewer than N cores: step times show the trend only",
        },
    }
    summary = {"meta": meta, "rows": rows}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary["files"] = {"json": str(out / "sweep.json")}
    if make_plot and rows:
        plot(summary, out / "sweep.png")
        summary["files"]["plot"] = str(out / "sweep.png")
    (out / "sweep.json").write_text(json.dumps(summary, indent=1, default=float))
    return summary


def plot(summary, path):
    """Three panels against Ψ, log-log: step time; model state per rank beside theory_bytes;
    bytes per rank per step beside theory_volume. Markers: measured (colour: stage, shape: N);
    grey lines: theory, one per distinct slope, labelled with it at the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows, meta = summary["rows"], summary["meta"]
    colors = {"ddp": "#4e79a7", "zero1": "#f28e2b", "zero2": "#59a14f", "zero3": "#e15759"}
    ns = sorted({r["world_size"] for r in rows})
    stages = by_stage(rows)  # {stage: its rows}, the stages in the table's order
    markers = dict(zip(ns, ("o", "s", "^", "D", "v", "P")))
    dashes = dict(zip(ns, ("-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3)))))
    psis = sorted({r["psi"] for r in rows})
    grid = [psis[0] / 1.25, psis[-1] * 1.25]
    mib = 2**20
    fig, axes = plt.subplots(1, 3, figsize=(19, 6.6))

    def series(stage, n, key, dodge=False):
        """Ψ and key(row) of one stage at one N. dodge (where key is proportional to Ψ, as its
        theory is): each stage's markers moved a little along their theory line, x and y scaled
        alike (by at most 6 %), so that stages with the same theory do not hide one another,
        and each marker's ratio to its line stays what was measured."""
        shift = 1 + 0.04 * (list(stages).index(stage) - (len(stages) - 1) / 2) if dodge else 1
        pts = sorted((r["psi"], key(r)) for r in stages[stage] if r["world_size"] == n)
        return [p * shift for p, _ in pts], [v * shift for _, v in pts]

    def theory_line(ax, slope, label, style="-"):  # slope: bytes per parameter
        ax.plot(grid, [slope * p / mib for p in grid], color="0.45", linestyle=style, lw=1, zorder=1)
        ax.annotate(label, (grid[-1], slope * grid[-1] / mib), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8, color="0.3")

    ax = axes[0]
    for stage in stages:
        for n in ns:
            x, y = series(stage, n, lambda r: r["step_time_s"]["median"] * 1e3)
            if x:
                ax.plot(x, y, marker=markers[n], linestyle=dashes[n], color=colors[stage], ms=6, lw=1.3)
    over = [n for n in ns if n > (meta["cpu_count"] or 1)]
    ax.set_title("step time: median of the slowest rank\n" +
                 (f"N = {', '.join(map(str, over))}: more ranks than the {meta['cpu_count']} cores, trend only"
                  if over else "forward + backward + step + zero_grad"), fontsize=10)
    ax.set_ylabel("ms per step")

    ax = axes[1]
    for slope in sorted({theory_bytes(1, s, n, "fp32")["total"] for s in stages for n in ns}):
        theory_line(ax, slope, f"{slope:g}Ψ")
    for stage in stages:
        for n in ns:
            x, y = series(stage, n, lambda r: r["model_state"]["measured"]["total"] / mib, dodge=True)
            ax.plot(x, y, marker=markers[n], linestyle="none", color=colors[stage], ms=7, zorder=3)
    ax.set_title("model state per rank at rest (after step, before zero_grad)\n"
                 "lines: theory_bytes, fp32 Adam: (4 + 4 + 8) Ψ, each term / N where the stage shards",
                 fontsize=10)
    ax.set_ylabel("MiB per rank")

    ax = axes[2]
    for slope in sorted({theory_volume(s, 1) * FP32 for s in stages}):
        theory_line(ax, slope, f"{slope:g}Ψ")
    for slope in sorted({theory_volume(s, 1) * FP32 * (n - 1) / n for s in stages for n in ns if n > 1}):
        theory_line(ax, slope, f"{slope:g}Ψ", style=":")
    for stage in stages:
        x, y = series(stage, ns[-1], lambda r: r["comm"]["volume_bytes"] / mib, dodge=True)  # any N: the same
        ax.plot(x, y, marker="x", linestyle="none", color=colors[stage], ms=8, mew=2, zorder=3)
        for n in (n for n in ns if n > 1):
            x, y = series(stage, n, lambda r: (r["comm"]["wire_bytes"] or float("nan")) / mib, dodge=True)
            ax.plot(x, y, marker=markers[n], linestyle="none", color=colors[stage], ms=7, mfc="none", mew=1.5,
                    zorder=3)
    ax.set_title("bytes per rank per step: × communicated, paper convention\n(solid: theory_volume × 4 B); "
                 "hollow: written to the sockets\n(dotted: a ring's (N-1)/N of theory; N = 1 sends nothing)",
                 fontsize=10)
    ax.set_ylabel("MiB per rank per step")
    ratios = {s: [r["comm"]["wire_ratio"] for r in g if r["comm"]["wire_ratio"]] for s, g in stages.items()}
    if any(ratios.values()):
        ax.text(0.98, 0.03, "on the wire / ring's share:\n" + "\n".join(
            f"{LABELS[s]} {min(v):.2f}" + (f"-{max(v):.2f}" if max(v) - min(v) >= 0.005 else "")
            for s, v in ratios.items() if v), transform=ax.transAxes, ha="right", va="bottom", fontsize=8,
            bbox=dict(facecolor="white", edgecolor="0.8"))

    ticks = FuncFormatter(lambda v, _: f"{v:g}")
    # minor ticks: label 2, 3 and 5 times a power of ten only
    sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else "")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(psis)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1e6:.2g}M"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(ticks)
        ax.yaxis.set_minor_formatter(sparse)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_xlabel("Ψ (parameters)")
        ax.grid(True, which="major", alpha=0.3)
        ax.set_xlim(grid[0], grid[-1] * 1.35)  # room for the theory lines' labels
    handles = [Line2D([], [], color=colors[s], lw=3, label=LABELS[s]) for s in stages]
    handles += [Line2D([], [], color="0.3", marker=markers[n], linestyle=dashes[n], label=f"N = {n}") for n in ns]
    handles += [Line2D([], [], color="0.45", lw=1, label="theory")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=10)
    fig.suptitle(f"How cost grows with Ψ and N: zerokit's stages, {meta.get('backend', 'gloo')} on "
                 f"{meta.get('device', 'cpu')} ({meta['cpu_count']} cores; TinyTransformer of "
                 f"{meta['shape']['n_layers']} layers, width varied)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(summary):
    mib = 2**20
    lines = [f"{'Ψ':>9} {'N':>2} {'stage':<13}{'step':>9}{'state':>9}{'theory':>9}{'ratio':>7}"
             f"{'volume':>9}{'ratio':>7}{'wire':>9}{'ratio':>7}",
             f"{'':>9} {'':>2} {'':<13}{'ms':>9}{'MiB':>9}{'MiB':>9}{'':>7}{'MiB':>9}{'':>7}{'MiB':>9}{'':>7}"]
    for r in sorted(summary["rows"], key=lambda r: (r["psi"], r["world_size"], STAGE_NAMES.index(r["stage"]))):
        ms, c = r["model_state"], r["comm"]
        wire = "-" if c["wire_bytes"] is None else f"{c['wire_bytes'] / mib:.2f}"
        wr = "-" if c["wire_ratio"] is None else f"{c['wire_ratio']:.3f}"
        star = "*" if r["oversubscribed"] else " "
        lines.append(f"{r['psi']:>9,} {r['world_size']:>2} {LABELS[r['stage']]:<13}"
                     f"{r['step_time_s']['median'] * 1e3:>8.1f}{star}{ms['measured']['total'] / mib:>9.2f}"
                     f"{ms['theory']['total'] / mib:>9.2f}{ms['ratio']:>7.4f}{c['volume_bytes'] / mib:>9.2f}"
                     f"{c['ratio']:>7.4f}{wire:>9}{wr:>7}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerokit.bench --sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-sizes", "-n", type=int, nargs="+", default=[1, 2, 4], help="N, one launch each")
    p.add_argument("--min-params", type=float, default=MIN_PARAMS, help="the smallest Ψ (then doubling)")
    p.add_argument("--max-params", type=float, default=MAX_PARAMS,
                   help="the largest Ψ (lowered to what fits in half the available memory)")
    p.add_argument("--stages", nargs="+", choices=STAGE_NAMES, default=list(STAGE_NAMES), help="zerokit's classes")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the instrumented one")
    p.add_argument("--n-layers", type=int, default=SHAPE["n_layers"], help="depth (the width is the knob)")
    p.add_argument("--vocab", type=int, default=SHAPE["vocab"], help="vocabulary")
    p.add_argument("--seq-len", type=int, default=SHAPE["seq_len"], help="sequence length")
    p.add_argument("--batch", type=int, default=SHAPE["batch"], help="sequences per rank per step")
    p.add_argument("--launcher", choices=("forkserver", "torchrun"), default="forkserver")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    p.add_argument("--out", default="bench-results", help="folder for sweep.json and sweep.png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-peak", action="store_true",
                   help="skip sampling memory after every operation of the instrumented step (its peak)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    summary = run(world_sizes=a.world_sizes, min_params=a.min_params, max_params=a.max_params, stages=a.stages,
                  steps=a.steps, warmup=a.warmup, seed=a.seed, launcher=a.launcher, timeout=a.timeout,
                  out_dir=a.out, make_plot=not a.no_plot, peak=not a.no_peak, n_layers=a.n_layers, vocab=a.vocab,
                  seq_len=a.seq_len, batch=a.batch)
    print()
    print(format_table(summary))
    meta = summary["meta"]
    print("state: model-state bytes per rank at rest (after step(), before zero_grad), the highest rank, beside\n"
          "  theory_bytes(Ψ, stage, N, 'fp32'); volume: bytes communicated per rank per step, paper convention,\n"
          "  beside theory_volume x 4 B; wire: bytes really written to the sockets, beside a ring's (N-1)/N of it.")
    over = sorted({r["world_size"] for r in summary["rows"] if r["oversubscribed"]})
    if over:
        print(f"* N = {', '.join(map(str, over))}: more ranks than the {meta['cpu_count']} cores; they take turns, "
              "so these step times show the trend only.")
    for s in meta["skipped_do_not_fit"]:
        print(f"skipped Ψ = {s['psi']:,} at N = {s['world_size']}: would not fit in half the available memory")
    print(f"wrote {', '.join(summary['files'].values())} in {time.perf_counter() - t0:.0f} s")
    return 0
