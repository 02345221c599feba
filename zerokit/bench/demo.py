"""`make demo`: what each stage holds and sends per rank, measured beside the ZeRO paper's theory.

    python -m zerokit.bench.demo [--world-sizes 2 4] [--out bench-results]

For data parallel Adam and ZeRO-1/2/3 on N ranks (gloo on CPU) it trains a small
transformer for a few steps and measures, per rank:
- model-state bytes by category at rest (right after opt.step(): steady state, nothing in
  transit), beside theory_bytes() for fp32 Adam (4 + 4 + 8 bytes per parameter, divided
  by N where the stage shards): equal, up to padding;
- the same at their peak during a step (zerokit.memory.MemoryProbe: a census of live
  tensors after every module's forward, as each gradient arrives and around the optimizer
  step), beside theory plus the buffers the stage holds at that moment, derived from its
  buckets, units and their order (buffer_bytes: ZeRO-2's reduce-scatters in flight,
  ZeRO-3's gathered units);
- elements communicated per step (zerokit.CommCounter, the paper's volume convention),
  beside 2Ψ (DP, ZeRO-1, ZeRO-2) and 3Ψ (ZeRO-3);
- that all stages end with the same parameters (max difference from data parallel).
It prints the table and saves a figure. About a minute on 2 CPU cores.
"""

import argparse
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from zerokit.stages import STAGE_NAMES, get_stage, lessons_optimizer
from zerokit.widgets import progress as progress_bar

from .buffers import buffer_bytes

LABELS = {"ddp": "data parallel", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
CATEGORIES = ("parameters", "gradients", "optimizer_states")
MODEL = dict(vocab=1999, dim=150, n_layers=3, n_heads=6, seq_len=32)
BUCKET_MB = 1.0  # ZeRO-2: several buckets even in this small model (about 5 MiB of parameters)


def zero3_units(model):
    """ZeRO-3's units: one per block, and the two big embedding matrices each on their own;
    the small rest (position embedding, final norm) stays in the root unit."""
    from zerokit.models import Block

    return [model.embed] + [m for m in model.modules() if isinstance(m, Block)] + [model.head]


def measure(rank, world_size, stage, steps=3, micro_batch=4):
    """One rank: train `steps` steps, measure the last one. Returns a dict of numbers."""
    import torch.nn.functional as F

    from zerokit import CommCounter, MemoryProbe
    from zerokit.models import TinyTransformer, make_batch, num_parameters

    torch.manual_seed(0)
    model = TinyTransformer(**MODEL)
    psi = num_parameters(model)
    opt = lessons_optimizer(stage, model, lr=1e-3, bucket_mb=BUCKET_MB, units=zero3_units(model))

    def step(i, probe=None, comm=None):
        x, y = make_batch("transformer", micro_batch, seed=1000 * i + rank, vocab=MODEL["vocab"], seq_len=MODEL["seq_len"])
        with probe or nullcontext(), comm or nullcontext():
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss.item()

    t0 = time.perf_counter()
    for i in range(steps - 1):
        step(i)
    # the steps before the measured one (the probe and counter slow theirs down); none with steps=1
    step_time = (time.perf_counter() - t0) / (steps - 1) if steps > 1 else float("nan")
    probe, comm = MemoryProbe(model, opt), CommCounter()
    loss = step(steps - 1, probe, comm)
    gathered = get_stage(stage).gathered(opt)
    with gathered:
        checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    return {
        "psi": psi, "peak": probe.peak, "peak_where": probe.peak_where,
        "at_rest": {k: probe.after_step[k] for k in CATEGORIES},
        "buffers": buffer_bytes(stage, opt, model), "volume": comm.volume(),
        "sent_bytes": comm.sent_bytes(),
        "calls": comm.table(), "loss": loss, "step_time": step_time, "params": checksum,
        "max_in_flight": getattr(opt, "max_in_flight", None),
    }


def run(world_sizes=(2, 4), steps=3):
    from zerokit import launch, theory_bytes, theory_volume

    rows = []
    bar = progress_bar(total=len(world_sizes) * len(STAGE_NAMES), desc="demo")
    for n in world_sizes:
        reference = None
        for stage in STAGE_NAMES:
            t0 = time.perf_counter()
            results = launch(measure, world_size=n, args=(stage, steps), launcher="forkserver", timeout=300)
            r = results[0]
            if reference is None:
                reference = r["params"]
            theory = theory_bytes(r["psi"], stage, n, precision="fp32")
            buffers = {k: b for k, (b, _) in r["buffers"].items()}
            rows.append({
                "world_size": n, "stage": stage, "psi": r["psi"],
                "measured": {k: max(res["peak"][k] for res in results) for k in CATEGORIES},
                "peak_where": r["peak_where"],
                "at_rest": {k: max(res["at_rest"][k] for res in results) for k in CATEGORIES},
                "theory": theory,
                "buffers": buffers,
                "buffer_moments": {k: w for k, (_, w) in r["buffers"].items()},
                "theory_plus_buffers": {k: theory[k] + buffers.get(k, 0) for k in CATEGORIES},
                "volume": r["volume"], "theory_volume": theory_volume(stage, r["psi"]),
                "sent_bytes": r["sent_bytes"], "step_time": r["step_time"], "max_in_flight": r["max_in_flight"],
                "max_param_diff_vs_ddp": (r["params"] - reference).abs().max().item(),
                "ranks_agree": all(torch.equal(res["params"], r["params"]) for res in results),
            })
            bar.write(f"  measured {LABELS[stage]:<13} on {n} ranks in {time.perf_counter() - t0:5.1f} s")
            bar.update(1)
    bar.close()
    return rows


def format_table(rows):
    """Model state per rank: at rest beside the paper, at its peak beside the paper plus buffers."""
    mib = 2**20
    lines = [f"{'N':>2} {'stage':<13}{'at rest':>8}{'theory':>8}{'ratio':>7}  |{'params':>8}{'grads':>8}"
             f"{'optim':>8}{'peak':>8}{'theory':>8}{'+buffers':>9}{'ratio':>7}",
             f"{'':>2} {'':<13}{'MiB':>8}{'MiB':>8}{'':>7}  |{'MiB':>8}{'MiB':>8}{'MiB':>8}{'MiB':>8}{'MiB':>8}{'MiB':>9}"]
    for r in rows:
        m, t, rest = r["measured"], r["theory"], sum(r["at_rest"].values())
        peak, allowed = sum(m.values()), sum(r["theory_plus_buffers"].values())
        lines.append(
            f"{r['world_size']:>2} {LABELS[r['stage']]:<13}{rest / mib:>8.2f}{t['total'] / mib:>8.2f}{rest / t['total']:>7.3f}  |"
            f"{m['parameters'] / mib:>8.2f}{m['gradients'] / mib:>8.2f}{m['optimizer_states'] / mib:>8.2f}"
            f"{peak / mib:>8.2f}{t['total'] / mib:>8.2f}{allowed / mib:>9.2f}{peak / allowed:>7.3f}")
    return "\n".join(lines)


def format_buffers(rows):
    """Each buffer term, the moment the stage's structure puts its peak at, and where the probe saw it."""
    lines = []
    for r in rows:
        for cat, moment in r["buffer_moments"].items():
            m, want = r["measured"][cat], r["theory_plus_buffers"][cat]
            lines.append(f"{r['world_size']:>2} {LABELS[r['stage']]:<7}{cat:<11}{r['buffers'][cat] / 2**20:>+6.2f} MiB "
                         f"({m / want:.3f})  {moment}; probe: {r['peak_where'][cat]}")
    return "\n".join(lines)


def format_comm(rows):
    lines = [f"{'N':>2} {'stage':<13}{'comm/step':>10}{'theory':>7}{'max |Δθ|':>10}{'ranks':>8}{'step':>8}",
             f"{'':>2} {'':<13}{'Ψ':>10}{'Ψ':>7}{'vs DP':>10}{'agree':>8}{'ms':>8}"]
    for r in rows:
        lines.append(f"{r['world_size']:>2} {LABELS[r['stage']]:<13}{r['volume'] / r['psi']:>10.3f}"
                     f"{r['theory_volume'] / r['psi']:>7.0f}{r['max_param_diff_vs_ddp']:>10.1e}"
                     f"{'yes' if r['ranks_agree'] else 'NO':>8}{r['step_time'] * 1e3:>8.1f}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    from zerokit.figures import memory_bars

    bars = [(f"{LABELS[r['stage']]}\nN={r['world_size']}", r["measured"], r["theory"]["total"]) for r in rows]
    fig = memory_bars(bars, title=f"model state per rank at its peak, Ψ = {rows[0]['psi'] / 1e6:.2f} M parameters (fp32)")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m zerokit.bench.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    print("ZeRO from Scratch: measuring data parallel and ZeRO-1/2/3 (gloo, CPU)")
    rows = run(args.world_sizes, args.steps)
    print()
    print(f"TinyTransformer, Ψ = {rows[0]['psi']:,} parameters, fp32 Adam (4 + 4 + 8 bytes per parameter)")
    print(format_table(rows))
    print("at rest: model state right after opt.step() (before zero_grad): every category in its steady\n"
          "  state, nothing in transit; theory: the ZeRO paper, fp32 (P=4, G=4, K=8 bytes/param, divided by N\n"
          "  where the stage shards). peak: each category's peak during the step (live-tensor census after\n"
          "  every module's forward, every gradient, and around the step); +buffers: theory plus what the\n"
          "  stage's structure holds at that moment, below.")
    print("\nbuffers at the peak (derived from buckets, units and their order; measured / (theory + buffer)):")
    print(format_buffers(rows))
    in_flight = "/".join(str(k) for k in sorted({r["max_in_flight"] for r in rows if r["max_in_flight"]})) or "?"
    print("  ZeRO-2/3 gradients: the reduced shards so far, the full-size flat copy of each bucket whose\n"
          f"  reduce-scatter is still in flight (at most {in_flight}), the gradients of the bucket filling (ZeRO-3: and\n"
          "  of the root unit, sent last). ZeRO-3 parameters: all shards, the root unit (gathered through\n"
          "  forward and backward), and two neighbouring units: the one computing and the one prefetched.\n"
          "  The ratios are 1 to the byte but for ZeRO-3's gradients: the root unit's are counted whole,\n"
          f"  but at the peak its position embedding's ({MODEL['seq_len'] * MODEL['dim']:,} elements) has not arrived yet.")
    print()
    print(format_comm(rows))
    print("comm/step: elements per rank, paper convention (all-reduce = 2x); ZeRO-3 is a hair under 3:\n"
          "  the small root unit is gathered once, not twice. max |Δθ|: parameters after the steps vs DP.\n"
          "  ranks agree: every rank ends with the same parameters, bit for bit. step: rank 0's mean time of\n"
          "  the steps before the measured one (no probe, no counter; one-time first-step costs included).")
    disagree = [f"{LABELS[r['stage']]} on {r['world_size']} ranks" for r in rows if not r["ranks_agree"]]
    print(f"all ranks hold identical parameters: {'no: ' + ', '.join(disagree) if disagree else 'yes'}")
    path = plot(rows, Path(args.out) / "demo_memory.png")
    print(f"figure: {path}   ({time.perf_counter() - t0:.0f} s)")
    if disagree:  # the stages must keep every rank's replica (or gathered shards) identical
        raise SystemExit(f"ranks ended with different parameters: {', '.join(disagree)}")
    return rows


if __name__ == "__main__":
    main()
