"""The table `python -m zerokit.bench` prints: one row per configuration, then each stage's
floor, then zerokit / PyTorch peer ratios, then what each column means."""

from zerokit.stages import get_stage

from .systems import BASELINE
from .workload import describe


def mib(b):
    return b / 2**20


def spread(quartiles):
    return f"{quartiles[0] * 1e3:.1f}-{quartiles[1] * 1e3:.1f}"


def _count(n):
    return "-" if n is None else f"{n:.0f}"


def format_table(summary) -> str:
    meta, configs = summary["meta"], summary["configs"]
    m = meta["model"]
    lines = [
        f"world size {meta['world_size']} ({meta['backend']}, {meta['device']}), torch {meta['torch']}; "
        f"{describe(m, m['name'], m['parameters'])}; "
        f"median of {meta['steps']} steps after {meta['warmup']} warm-up + 1 instrumented",
        "",
        f"{'configuration':32s} {'stage':5s} {'ms/step':>8s} {'p25-p75':>11s} {'floor':>7s} {'/floor':>6s} "
        f"{'comm MiB':>8s} {'theory':>7s} {'wire':>6s} {'params':>7s} {'grads':>7s} {'optim':>7s} {'other':>7s} "
        f"{'peak MiB':>8s} {'|dloss|':>8s} {'faults':>6s}",
    ]
    for c in configs:
        mp = c["memory_peak"]
        lines.append(
            f"{c['label']:32s} {c['stage']:5s} {c['step_time_s']['median'] * 1e3:8.1f} "
            f"{spread(c['step_time_s']['quartiles']):>11s} {c['floor_s'] * 1e3:7.1f} "
            f"{c['vs_floor']:6.2f} {mib(c['comm']['volume_bytes']):8.2f} "
            f"{mib(c['comm']['theory_volume_bytes']):7.2f} {mib(c['comm']['wire_bytes'] or float('nan')):6.2f} "
            f"{mib(mp['parameters']):7.2f} {mib(mp['gradients']):7.2f} {mib(mp['optimizer_states']):7.2f} "
            f"{mib(mp['other']):7.2f} {mib(mp['total']):8.2f} {c['loss']['final_diff']:8.1e} "
            f"{_count(c['page_faults_per_step']):>6s}")
    lines += [""] + [
        f"floor {stage:5s}: forward+backward {f['forward_backward_s'] * 1e3:6.1f} ms + update "
        f"{f['update_s'] * 1e3:5.1f} ms + {' + '.join(f['collectives'])} {f['comm_s'] * 1e3:6.1f} ms "
        f"= {f['total_s'] * 1e3:6.1f} ms (p25-p75 {spread(f['total_quartiles_s'])})"
        for stage, f in summary["floors"].items()]
    if any(c["setting"] for c in configs):  # FSDP2's controls: where the all-gathers ran
        k = meta["node_size"]
        lines += ["", f"{'all-gather MiB per step':32s} {'inside a node of ' + str(k):>18s} {'across nodes':>13s}"]
        lines += [f"{c['label']:32s} {mib(c['comm']['all_gather_nodes']['intra']):18.2f} "
                  f"{mib(c['comm']['all_gather_nodes']['inter']):13.2f}" for c in configs
                  if get_stage(c["stage"]).fsdp_controls]  # the rows whose gathers the controls change
    width = max([32] + [len(r["zerokit"] + " / " + r["peer"]) for r in summary["ratios"]])
    lines += ["", f"{'zerokit / PyTorch peer':{width}s} {'stage':5s} {'time':>6s} {'peak mem':>8s} "
                  f"{'model state':>11s} {'comm':>6s}"]
    for r in summary["ratios"]:
        lines.append(f"{r['zerokit'] + ' / ' + r['peer']:{width}s} {r['stage']:5s} {r['time']:6.2f} {r['memory']:8.2f} "
                     f"{r['model_state']:11.2f} {'n/a' if r['comm'] is None else format(r['comm'], '.2f'):>6s}")
    lines += [
        "",
        f"ms/step: the median over the timed steps of the slowest rank's step, p25-p75 their quartiles; each "
        f"stage's two systems and its floor are timed in turns, {meta['chunk']} steps at a time.",
        "comm: volume per rank per step, ZeRO paper's convention (a ring sends (N-1)/N of it); theory 2 Psi, "
        "3 Psi for zero3, fp32; wire: bytes the rank really wrote to its sockets in that step (/proc/self/io).",
        "memory: per rank (the highest), each column its own peak over one step, so they need not add up; "
        "peak = all bytes allocated, C++ buffers and activations included; other = peak - model state.",
        "ratios: zerokit / peer of median step time, peak memory (all), model state (parameters + gradients + "
        "optimizer state, own peaks) and comm volume.",
        "faults: minor page faults per timed step (median; the rank with the most): memory the step maps in "
        "anew, a page at a time (freed by the last step and handed back to the kernel).",
    ]
    # name the baseline: without torch-ddp (--configs) the first configuration stands in for it
    base = configs[0]["loss"]["baseline"] if configs else BASELINE
    lines.append(f"|dloss|: |final eval loss - {base}'s|" + ("" if base == BASELINE else f" ({BASELINE} not run)")
                 + ".")
    # the peers' AdamW and the floor's are different implementations: say which row uses which
    impls = sorted({f["update_impl"] for f in summary["floors"].values()})
    lines.append("update: torch rows torch.optim.AdamW's default implementation (per-tensor loop on CPU, "
                 f"foreach on CUDA), zerokit rows zerokit's own AdamW, floor {' / '.join(impls) or '-'}.")
    return "\n".join(lines)
