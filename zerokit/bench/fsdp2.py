r"""`python -m zerokit.bench --fsdp2`: zerokit's fully_shard beside torch's, with the same calls.

    python -m zerokit.bench --fsdp2                        # N = 2 and 4, fp32 and bf16, the small transformer
    python -m zerokit.bench --fsdp2 --world-sizes 2 --policies bf16 --steps 40

Both systems get the same calls with the same settings, as an FSDP2 user writes them: on one
DeviceMesh of every rank, `fully_shard(block, mesh=mesh, mp_policy=policy)` for each block of the
model, then `fully_shard(model, mesh=mesh, mp_policy=policy)` (the root: the embeddings, the final
norm and the head), `reshard_after_forward` left at its default, and `torch.optim.AdamW` on
`model.parameters()` (DTensors in both). The policies are torch's own `MixedPrecisionPolicy`:

| policy | param_dtype | reduce_dtype |
|---|---|---|
| `fp32` | None (the parameters' fp32) | None |
| `bf16` | torch.bfloat16 | torch.float32 (FSDP2's recipe, and zerokit.train's) |
| `bf16-reduce` | torch.bfloat16 | None (reduced in bf16) |

One `zerokit.launch` per world size. On every rank, per policy, each system is built fresh from the
same seed (runs.Run), warmed up and measured over one instrumented step (accounting.Instrument:
collectives counted, memory sampled after every operation), then the two are timed in turns,
`chunk` steps of one and then `chunk` of the other, the order swapped every turn, so that a
change in the machine's load falls on both alike. They compute the same thing on the same
batches, so their losses and final weights must be equal bit for bit; the table says whether
they were, beside the figures, so that a fast wrong answer cannot pass for a fast one.

Figures, per world size and policy, zerokit / torch:
- **ms/step**: each timed step is the slowest rank's (a barrier before it, the device synchronised
  around it); the median over the timed steps, p25-p75 beside it; the ratio is of the medians,
  and beside it the p25-p75 of the ratio taken turn by turn (each turn's median of zerokit over
  the same turn's torch), which is what a noisy machine moves least;
- **peak MiB per rank**: the highest over the ranks of the instrumented step's peak above what the
  process held before the system was built (CPU: glibc's allocated bytes, sampled after every
  tensor operation; GPU: `torch.cuda.max_memory_allocated`), model state, activations and
  communication buffers alike;
- **CPU ms/step**: the busiest rank's CPU time in each timed step (all its threads), the median:
  on a machine with more ranks than free cores the wall time is mostly waiting for a core, and the
  CPU time is the work each system asks for;
- **comm MiB**: bytes per rank per step, the ZeRO paper's convention (zerokit.CommCounter).

Output: the table on stdout and `bench-results/fsdp2.json` (every step's time, every rank's peak).

`--profile K`: after the timed steps, K more steps of each system (in turns, untimed) under two
profilers on every rank, rank 0's figures printed per step: cProfile's time in each function of
the two machineries (zerokit/fully_shard/ and torch/distributed/fsdp/_fully_shard/, cumulative
CPU time: a hook with what it calls), and torch.profiler's self time per operator (aten and c10d,
wall clock, and how many calls), the operators where the two differ most first. Where a ratio is
above 1, this says in which calls zerokit's time goes.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import zerokit
from zerokit.widgets import progress

from .runs import Run
from .summary import quartiles
from .systems import Config
from .workload import HYPER, MODELS, describe, make_model, rank_batch, train_step
from .worker import warm_process

IMPLS = ("torch", "zerokit")
LABELS = {"torch": "torch.distributed.fsdp.fully_shard", "zerokit": "zerokit.fully_shard"}
POLICY_DTYPES = {"fp32": (None, None), "bf16": (torch.bfloat16, torch.float32), "bf16-reduce": (torch.bfloat16, None)}
DEFAULT_POLICIES = ("fp32", "bf16")


def policy(name):
    """torch's MixedPrecisionPolicy for a policy's name (the table above)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype, reduce_dtype = POLICY_DTYPES[name]
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def shard(impl, model, mesh, policy_name):
    """FSDP2's calls on `model`, by torch's fully_shard or zerokit's: each block, then the root."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    elif impl == "zerokit":
        from zerokit.fully_shard.api import fully_shard
    else:
        raise ValueError(f"impl is one of {IMPLS}, not {impl!r}")
    mp_policy = policy(policy_name)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def build(config, model_cfg, device, seed, mesh):
    """runs.Run's builder: the preset's model sharded by config.system, with torch's AdamW."""
    model = shard(config.system, make_model(model_cfg, device, seed), mesh, config.setting)
    return model, torch.optim.AdamW(model.parameters(), **HYPER)


def full_weights(model):
    """{name: the full tensor} of a sharded model's parameters (an all-gather each), in fp32 on the CPU.
    Resharded first: after a forward without backward (the eval loss) the root shows its unsharded
    parameters, in both systems (FSDP2 keeps the root gathered after forward)."""
    model.reshard()
    return {n: p.full_tensor().detach().to("cpu", torch.float32) for n, p in model.named_parameters()}


def _warm_policy(rank, world_size, opts, device, mesh, name):
    """Both systems built and stepped once, unmeasured, then freed: what a dtype costs the process once
    (bf16 kernels' first use, the collectives' buffers in that dtype: 7 MiB on the tiny model) falls on
    neither system's figures, instead of on whichever is built first."""
    for impl in IMPLS:
        config = Config(f"{impl}-{name}", "zero3", impl, LABELS[impl], name)
        model, opt = build(config, opts["model"], device, opts["seed"], mesh)
        x, y = rank_batch(opts["model"], 0, rank, world_size, device)
        train_step(model, opt, x, y, opts["model"])
        del model, opt
    gc.collect()


def worker(rank, world_size, opts):
    """Every rank: per policy, both systems built and instrumented, then timed in turns."""
    from torch.distributed.device_mesh import init_device_mesh

    device = zerokit.rank_device()
    mesh = init_device_mesh(device.type, (world_size,))
    warm_process(rank, world_size, opts, device)
    out = []
    for i, name in enumerate(opts["policies"]):
        # the first-built system's baseline holds nothing of the other's: alternate which goes first
        impls = IMPLS if i % 2 == 0 else IMPLS[::-1]
        _warm_policy(rank, world_size, opts, device, mesh, name)
        runs = {}
        for impl in impls:
            config = Config(f"{impl}-{name}", "zero3", impl, LABELS[impl], name)
            runs[impl] = Run(config, rank, world_size, opts, device, builder=partial(build, mesh=mesh))
            runs[impl].prepare()
        chunk, steps, turns = opts["chunk"], opts["steps"], []
        for turn, start in enumerate(range(0, steps, chunk)):
            order = impls if turn % 2 == 0 else impls[::-1]
            for impl in order:
                for _ in range(min(chunk, steps - start)):
                    runs[impl].train(timed=True)
            turns.append(min(chunk, steps - start))
        profiles = _profile(runs, impls, opts["profile"]) if opts["profile"] else None
        results = {impl: run.result() for impl, run in runs.items()}
        weights = {impl: full_weights(run.model) for impl, run in runs.items()}
        same = all(torch.equal(weights["zerokit"][n], w) for n, w in weights["torch"].items())
        apart = max((weights["zerokit"][n] - w).abs().max().item() for n, w in weights["torch"].items())
        out.append({"policy": name, "turns": turns, "runs": results, "weights_bitwise": same, "weights_apart": apart,
                    "profile": profiles})
        if rank == 0:
            med = {impl: statistics.median(r["step_times_s"]) * 1e3 for impl, r in results.items()}
            print(f"[{i + 1}/{len(opts['policies'])}] N={world_size} {name}: zerokit {med['zerokit']:.1f} ms, "
                  f"torch {med['torch']:.1f} ms (rank 0)", flush=True)
        del runs, results, weights
        gc.collect()
        if device.type == "cuda":  # each policy's systems start from the same empty cache
            torch.cuda.empty_cache()
    return {"rank": rank, "device": str(device), "backend": dist.get_backend(), "policies": out,
            "psi": sum(p.numel() for p in make_model(opts["model"], "cpu", opts["seed"]).parameters())}


# the files of each machinery, as cProfile names them
MACHINERY = {"zerokit": ("zerokit/fully_shard/",), "torch": ("torch/distributed/fsdp/_fully_shard/",)}


def _profile(runs, impls, steps):
    """`steps` more steps of each system under cProfile, then under torch.profiler: per step, seconds in each
    function of its machinery (cumulative) and self CPU seconds per operator."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    out = {}
    for impl in impls:
        run = runs[impl]
        prof = cProfile.Profile(time.process_time)  # CPU time: a loaded machine's waits are not the code's
        prof.enable()
        for _ in range(steps):
            run.train()
        prof.disable()
        functions = []
        for (file, line, func), (_, calls, _, cumulative, _) in pstats.Stats(prof).stats.items():
            where = file.replace("\\", "/")
            if any(part in where for part in MACHINERY[impl]):
                functions.append({"function": f"{where.rsplit('/', 1)[-1]}:{line} {func}", "calls": calls / steps,
                                  "cumulative_s": cumulative / steps})
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(steps):
                run.train()
        # operators only: the two machineries label their regions differently (FSDP2's record_function
        # scopes, zerokit's none), and a scope's self time is the waits and Python inside it
        operators = [{"op": e.key, "calls": e.count / steps, "self_cpu_s": e.self_cpu_time_total / 1e6 / steps}
                     for e in p.key_averages() if e.key.startswith(("aten::", "c10d::"))]
        out[impl] = {"functions": sorted(functions, key=lambda f: -f["cumulative_s"]),
                     "operators": sorted(operators, key=lambda o: -o["self_cpu_s"])}
    return out


def format_profile(row, top=12):
    """Rank 0's profile of one row: each machinery's functions, and the operators side by side."""
    prof = row["profile"]
    lines = [f"N = {row['world_size']}, {row['policy']}: per step, rank 0 (profilers on: slower than the timed steps)"]
    for impl in IMPLS:
        lines.append(f"  {LABELS[impl]}'s machinery, cumulative CPU ms per step (calls):")
        lines += [f"    {f['cumulative_s'] * 1e3:8.2f} ({f['calls']:5.0f})  {f['function']}"
                  for f in prof[impl]["functions"][:top]]
    ops = {impl: {o["op"]: o for o in prof[impl]["operators"]} for impl in IMPLS}
    names = sorted(set(ops["zerokit"]) | set(ops["torch"]),
                   key=lambda n: -abs(ops["zerokit"].get(n, {}).get("self_cpu_s", 0)
                                      - ops["torch"].get(n, {}).get("self_cpu_s", 0)))
    lines.append(f"  {'operator, self ms per step (calls)':44s} {'zerokit':>16s} {'torch':>16s} {'difference':>10s}")
    for n in names[:top]:
        z, t = ops["zerokit"].get(n, {}), ops["torch"].get(n, {})
        zs, ts = z.get("self_cpu_s", 0.0), t.get("self_cpu_s", 0.0)
        lines.append(f"  {n[:44]:44s} {zs * 1e3:8.2f} ({z.get('calls', 0):5.0f}) "
                     f"{ts * 1e3:8.2f} ({t.get('calls', 0):5.0f}) {(zs - ts) * 1e3:+10.2f}")
    total = {impl: sum(o["self_cpu_s"] for o in prof[impl]["operators"]) for impl in IMPLS}
    lines.append(f"  {'all aten and c10d operators':44s} {total['zerokit'] * 1e3:8.2f} {'':7s} "
                 f"{total['torch'] * 1e3:8.2f} {'':7s} {(total['zerokit'] - total['torch']) * 1e3:+10.2f}")
    return "\n".join(lines)


def _turn_ratios(mine, theirs, turns):
    """Per turn, the median of `mine`'s steps over the median of `theirs`'s in the same turn."""
    ratios, start = [], 0
    for n in turns:
        ratios.append(statistics.median(mine[start:start + n]) / statistics.median(theirs[start:start + n]))
        start += n
    return ratios


def summarize(per_rank, world_size):
    """The ranks' results for one world size: per policy, each system's figures and the ratios."""
    rows = []
    for i, entry in enumerate(per_rank[0]["policies"]):
        ranks = [r["policies"][i] for r in per_rank]
        param_dtype, reduce_dtype = POLICY_DTYPES[entry["policy"]]
        row = {"world_size": world_size, "policy": entry["policy"], "param_dtype": str(param_dtype),
               "reduce_dtype": str(reduce_dtype)}
        steps = {}
        for impl in IMPLS:
            results = [r["runs"][impl] for r in ranks]
            steps[impl] = [max(t) for t in zip(*(r["step_times_s"] for r in results))]  # the slowest rank's
            cpu = [max(t) for t in zip(*(r["step_cpu_s"] for r in results))]  # the busiest rank's CPU seconds
            peaks = [r["memory"]["total"] for r in results]
            row[impl] = {
                "step_time_s": {"median": statistics.median(steps[impl]), "quartiles": quartiles(steps[impl]),
                                "min": min(steps[impl]), "max": max(steps[impl]), "per_step_slowest_rank": steps[impl]},
                "cpu_time_s": {"median": statistics.median(cpu), "quartiles": quartiles(cpu),
                               "per_step_busiest_rank": cpu},
                "peak_bytes_per_rank": peaks, "peak_bytes": max(peaks),
                # the sample where each rank's total was highest: its categories and the operation before it
                "at_peak_per_rank": [r["memory"]["at_peak"] for r in results],
                "comm_bytes": max(r["comm"]["volume_bytes"] for r in results),
                "comm_calls": results[0]["comm"]["calls"],
                "train_losses_per_rank": [r["train_losses"] for r in results],
                "final_loss": results[0]["final_loss"],
            }
        turn = _turn_ratios(steps["zerokit"], steps["torch"], entry["turns"])
        mine, theirs = row["zerokit"], row["torch"]
        row["ratios"] = {
            "time": mine["step_time_s"]["median"] / theirs["step_time_s"]["median"],
            "time_per_turn": turn, "time_per_turn_quartiles": quartiles(turn),
            "cpu_time": mine["cpu_time_s"]["median"] / theirs["cpu_time_s"]["median"],
            "memory": mine["peak_bytes"] / max(theirs["peak_bytes"], 1),
            "comm": mine["comm_bytes"] / theirs["comm_bytes"] if theirs["comm_bytes"] else None,
        }
        row["losses_bitwise"] = mine["train_losses_per_rank"] == theirs["train_losses_per_rank"] and \
            mine["final_loss"] == theirs["final_loss"]
        row["weights_bitwise"] = all(r["weights_bitwise"] for r in ranks)
        row["weights_apart"] = max(r["weights_apart"] for r in ranks)
        row["profile"] = ranks[0]["profile"]  # rank 0's (None without --profile)
        rows.append(row)
    return rows


def _mib(b):
    return b / 2**20


def format_table(summary):
    meta = summary["meta"]
    m = meta["model"]
    lines = [
        f"zerokit.fully_shard / torch.distributed.fsdp.fully_shard, the same calls: one per block, then the root; "
        f"torch.optim.AdamW; {describe(m, m['name'], m['parameters'])}",
        f"{meta['backend']} on {meta['device']}, torch {meta['torch']}; per system {meta['steps']} timed steps in "
        f"turns of {meta['chunk']} after {meta['warmup']} warm-up + 1 instrumented",
        "",
        f"{'N':>2s} {'policy':11s} | {'ms/step zerokit':>21s} {'torch':>21s} {'ratio':>6s} {'per turn':>11s} | "
        f"{'CPU ms zerokit':>14s} {'torch':>7s} {'ratio':>6s} | "
        f"{'peak MiB/rank zerokit':>21s} {'torch':>6s} {'ratio':>6s} | {'comm MiB z / t':>15s} | bitwise",
    ]
    for r in summary["rows"]:
        z, t, q = r["zerokit"], r["torch"], r["ratios"]

        def ms(s):
            lo, hi = s["step_time_s"]["quartiles"]
            return f"{s['step_time_s']['median'] * 1e3:7.1f} ({lo * 1e3:5.1f}-{hi * 1e3:5.1f})"

        turn = q["time_per_turn_quartiles"]
        bitwise = "losses, weights" if r["losses_bitwise"] and r["weights_bitwise"] else \
            f"NO (weights {r['weights_apart']:.1e} apart)"
        lines.append(
            f"{r['world_size']:2d} {r['policy']:11s} | {ms(z):>21s} {ms(t):>21s} {q['time']:6.2f} "
            f"{turn[0]:5.2f}-{turn[1]:4.2f} | {z['cpu_time_s']['median'] * 1e3:14.1f} "
            f"{t['cpu_time_s']['median'] * 1e3:7.1f} {q['cpu_time']:6.2f} | {_mib(z['peak_bytes']):21.2f} "
            f"{_mib(t['peak_bytes']):6.2f} "
            f"{q['memory']:6.2f} | {_mib(z['comm_bytes']):6.2f} / {_mib(t['comm_bytes']):6.2f} | {bitwise}")
    lines += [
        "",
        "ms/step: the median over the timed steps of the slowest rank's step (p25-p75); ratio: zerokit's median over "
        "torch's; per turn: p25-p75 of each turn's zerokit median over the same turn's torch median.",
        "CPU ms: the median over the timed steps of the busiest rank's CPU time in the step (all its threads): "
        "the work, without the waits a loaded machine adds to the wall time.",
        "peak MiB/rank: the highest rank's peak over one instrumented step, above what the process held before the "
        "system was built (CPU: glibc's allocated bytes after every tensor operation; GPU: "
        "torch.cuda.max_memory_allocated).",
        "comm: bytes per rank per step, the ZeRO paper's convention; bitwise: every rank's losses and the final "
        "weights equal bit for bit. Goal: every ratio <= 1.00.",
    ]
    return "\n".join(lines)


def run(world_sizes=(2, 4), model="small", policies=DEFAULT_POLICIES, steps=20, warmup=2, chunk=2, seed=0,
        launcher="forkserver", timeout=1800.0, out_dir="bench-results", echo=True, profile=0, **model_overrides):
    """The FSDP2 bench from Python: one launch per world size; returns the summary (also in fsdp2.json)."""
    unknown = [p for p in policies if p not in POLICY_DTYPES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {sorted(POLICY_DTYPES)}")
    if model not in MODELS or MODELS[model].get("kind") == "mlp":
        raise ValueError(f"--fsdp2 shards a TinyTransformer's blocks: model is one of "
                         f"{sorted(k for k, v in MODELS.items() if v.get('kind') != 'mlp')}, not {model!r}")
    model_cfg = dict(MODELS[model], **{k: v for k, v in model_overrides.items() if v is not None})
    opts = {"model": model_cfg, "policies": list(policies), "steps": steps, "warmup": warmup, "chunk": chunk,
            "seed": seed, "node_size": 1, "profile": profile}
    t0 = time.perf_counter()
    rows, first = [], None
    bar = progress(total=len(world_sizes) * len(policies), desc="fsdp2 bench") if echo else None
    for n in world_sizes:
        def said(rank, line, n=n):
            if line.startswith("["):  # rank 0 reports each policy it finishes as "[k/n] ..."
                bar.update(1)
            bar.write(f"[N={n} rank {rank}] {line}")

        try:
            per_rank = zerokit.launch(worker, n, args=(opts,), launcher=launcher, timeout=timeout,
                                      echo=said if echo else False)
        except BaseException:
            if bar is not None:
                bar.close()
            raise
        first = first or per_rank[0]
        rows += summarize(per_rank, n)
    if bar is not None:
        bar.close()
    meta = {"model": {"name": model, **model_cfg, "parameters": first["psi"]}, "backend": first["backend"],
            "device": first["device"], "torch": torch.__version__, "steps": steps, "warmup": warmup, "chunk": chunk,
            "seed": seed, "world_sizes": list(world_sizes), "policies": list(policies),
            "hyperparameters": HYPER, "wall_time_s": time.perf_counter() - t0}
    summary = {"meta": meta, "rows": rows}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fsdp2.json"
    path.write_text(json.dumps(summary, indent=1, default=float))
    summary["files"] = {"json": str(path)}
    return summary


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerokit.bench --fsdp2", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-sizes", "-n", type=int, nargs="+", default=[2, 4])
    p.add_argument("--policies", nargs="+", choices=sorted(POLICY_DTYPES), default=list(DEFAULT_POLICIES))
    p.add_argument("--model", choices=sorted(k for k, v in MODELS.items() if v.get("kind") != "mlp"), default="small")
    p.add_argument("--dim", type=int, help="override the preset's width")
    p.add_argument("--n-layers", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--batch", type=int, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the instrumented one")
    p.add_argument("--chunk", type=int, default=2, help="steps of one system before the other's turn")
    p.add_argument("--launcher", choices=("forkserver", "torchrun"), default="forkserver")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for each world size's run")
    p.add_argument("--out", default="bench-results", help="folder for fsdp2.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="then K more steps of each system under cProfile and torch.profiler: where the time goes")
    a = p.parse_args(argv)
    summary = run(world_sizes=a.world_sizes, model=a.model, policies=a.policies, steps=a.steps, warmup=a.warmup,
                  chunk=a.chunk, seed=a.seed, launcher=a.launcher, timeout=a.timeout, out_dir=a.out, profile=a.profile,
                  dim=a.dim, n_layers=a.n_layers, seq_len=a.seq_len, batch=a.batch)
    print()
    print(format_table(summary))
    for row in summary["rows"]:
        if row["profile"]:
            print()
            print(format_profile(row))
    print()
    print(f"wrote {summary['files']['json']} in {summary['meta']['wall_time_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
