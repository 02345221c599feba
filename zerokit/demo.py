"""`make demo`: what each stage holds and sends per rank, measured beside the ZeRO paper's theory.

    python -m zerokit.demo [--world-sizes 2 4] [--out bench-results]

For data parallel Adam and ZeRO-1/2/3 on N ranks (gloo on CPU) it trains a small
transformer for a few steps and measures, per rank:
- model-state bytes by category at their peak during a step (zerokit.memory.MemoryProbe:
  a census of live tensors after every module's forward, as each gradient arrives and
  around the optimizer step), beside theory_bytes() for fp32 Adam (4 + 4 + 8 bytes per
  parameter, divided by N where the stage shards);
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

STAGES = ("ddp", "zero1", "zero2", "zero3")
LABELS = {"ddp": "data parallel", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
MODEL = dict(vocab=1999, dim=150, n_layers=3, n_heads=6, seq_len=32)


def make_optimizer(stage, model, lr=1e-3):
    import zerokit

    if stage == "ddp":
        return zerokit.DistributedAdam(model.parameters(), lr=lr)
    if stage == "zero1":
        return zerokit.ZeRO1Adam(model.parameters(), lr=lr)
    if stage == "zero2":
        return zerokit.ZeRO2Adam(model.parameters(), lr=lr, bucket_mb=1.0)
    if stage == "zero3":
        from zerokit.models import Block

        # one unit per block, and the two big embedding matrices each on their own; the
        # small rest (position embedding, final norm) stays in the root unit
        units = [model.embed] + [m for m in model.modules() if isinstance(m, Block)] + [model.head]
        return zerokit.ZeRO3Adam(model, lr=lr, units=units)
    raise ValueError(stage)


def measure(rank, world_size, stage, steps=3, micro_batch=4):
    """One rank: train `steps` steps, measure the last one. Returns a dict of numbers."""
    import torch.nn.functional as F

    from zerokit import CommCounter, MemoryProbe
    from zerokit.models import TinyTransformer, make_batch, num_parameters

    torch.manual_seed(0)
    model = TinyTransformer(**MODEL)
    psi = num_parameters(model)
    opt = make_optimizer(stage, model)

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
    step_time = (time.perf_counter() - t0) / max(steps - 1, 1)
    probe, comm = MemoryProbe(model, opt), CommCounter()
    loss = step(steps - 1, probe, comm)
    gathered = opt.gathered() if stage == "zero3" else nullcontext()
    with gathered:
        checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    return {
        "psi": psi, "peak": probe.peak, "buffers": buffer_bytes(stage, opt), "volume": comm.volume(),
        "sent_bytes": comm.sent_bytes(),
        "calls": comm.table(), "loss": loss, "step_time": step_time, "params": checksum,
    }


def buffer_bytes(stage, opt):
    """Bytes a stage holds beyond the paper's accounting, by category, from its own structure.

    ZeRO-2: gradients of the bucket being filled, plus up to `max_in_flight` flat copies
    being reduce-scattered. ZeRO-3: the root unit's full weights and gradients (it stays
    gathered through forward and backward) plus the two largest other units (the one
    computing and the one prefetched), for weights and for gradients in flight.
    """
    if stage == "zero2":
        bucket = max(b.padded_numel for b in opt.buckets) * 4
        return {"gradients": (opt.max_in_flight + 1) * bucket}
    if stage == "zero3":
        root = sum(b.padded_numel for b in opt.buckets if b.unit == 0) * 4
        others = sorted((b.padded_numel * 4 for b in opt.buckets if b.unit != 0), reverse=True)
        two = sum(others[:2])
        return {"parameters": root + two, "gradients": root + (opt.max_in_flight + 1) * (others[0] if others else 0)}
    return {}


def run(world_sizes=(2, 4), steps=3, progress=print):
    from zerokit import launch, theory_bytes, theory_volume

    rows = []
    for n in world_sizes:
        reference = None
        for stage in STAGES:
            t0 = time.perf_counter()
            results = launch(measure, world_size=n, args=(stage, steps), launcher="forkserver", timeout=300)
            r = results[0]
            if reference is None:
                reference = r["params"]
            theory = theory_bytes(r["psi"], stage, n, precision="fp32")
            rows.append({
                "world_size": n, "stage": stage, "psi": r["psi"],
                "measured": {k: max(res["peak"][k] for res in results) for k in ("parameters", "gradients", "optimizer_states")},
                "theory": theory,
                "buffers": r["buffers"],
                "theory_plus_buffers": theory["total"] + sum(r["buffers"].values()),
                "volume": r["volume"], "theory_volume": theory_volume(stage, r["psi"]),
                "sent_bytes": r["sent_bytes"], "step_time": r["step_time"],
                "max_param_diff_vs_ddp": (r["params"] - reference).abs().max().item(),
                "ranks_agree": all(torch.equal(res["params"], r["params"]) for res in results),
            })
            progress(f"  measured {LABELS[stage]:<13} on {n} ranks in {time.perf_counter() - t0:5.1f} s")
    return rows


def format_table(rows):
    mib = 2**20
    head = (f"{'N':>2} {'stage':<13}{'params':>8}{'grads':>8}{'optim':>8}{'model state':>12}{'theory':>8}"
            f"{'+buffers':>9}{'ratio':>7}{'comm/step':>10}{'theory':>7}{'max |Δθ|':>10}")
    lines = [head, f"{'':>2} {'':<13}{'MiB':>8}{'MiB':>8}{'MiB':>8}{'MiB':>12}{'MiB':>8}{'MiB':>9}{'':>7}{'Ψ':>10}{'Ψ':>7}{'vs DP':>10}"]
    for r in rows:
        m, t = r["measured"], r["theory"]
        total = sum(m.values())
        allowed = r["theory_plus_buffers"]
        lines.append(
            f"{r['world_size']:>2} {LABELS[r['stage']]:<13}{m['parameters'] / mib:>8.2f}{m['gradients'] / mib:>8.2f}"
            f"{m['optimizer_states'] / mib:>8.2f}{total / mib:>12.2f}{t['total'] / mib:>8.2f}{allowed / mib:>9.2f}"
            f"{total / allowed:>7.2f}{r['volume'] / r['psi']:>10.3f}{r['theory_volume'] / r['psi']:>7.0f}"
            f"{r['max_param_diff_vs_ddp']:>10.1e}")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    from .figures import memory_bars

    bars = [(f"{LABELS[r['stage']]}\nN={r['world_size']}", r["measured"], r["theory"]["total"]) for r in rows]
    fig = memory_bars(bars, title=f"model state per rank at its peak, Ψ = {rows[0]['psi'] / 1e6:.2f} M parameters (fp32)")
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    print("model state: peak bytes per category during one step (live-tensor census); theory: ZeRO paper,\n"
          "  fp32 (P=4, G=4, K=8 bytes/param); +buffers: theory plus what the stage holds in transit (ZeRO-2:\n"
          "  buckets being filled and reduced; ZeRO-3: the root unit and the two largest units gathered);\n"
          "  ratio = measured / (theory + buffers). comm/step: elements per rank, paper convention\n"
          "  (all-reduce = 2x); ZeRO-3 is a hair under 3: the small root unit is gathered once, not twice.")
    path = plot(rows, Path(args.out) / "demo_memory.png")
    print(f"figure: {path}   ({time.perf_counter() - t0:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
