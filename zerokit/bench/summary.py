"""The ranks' measurements put together, in the launching process.

A step's time is the slowest rank's, and the table shows the median over the timed steps;
the floor likewise takes the slowest rank per repetition, then the median. Memory and
communication are each rank's highest. Losses are compared with DDP + AdamW's (or, without
it, the first configuration's), and each stage's zerokit row is divided by its PyTorch peer.
"""

import os
import platform
import statistics
from dataclasses import asdict

import torch

import zerokit
from zerokit.comm import theory_volume
from zerokit.stages import DDP_OPTIONS, STAGE_NAMES, ZERO_REDUNDANCY_OPTIONS

from .accounting import MODEL_STATE
from .systems import BASELINE, CONFIGS, FULLY_SHARD_SETTINGS, SYSTEMS
from .workload import HYPER


def quartiles(values):
    """(25th, 75th) percentile: the spread the table prints beside a median."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q1, q3)


def _theory_volume(cfg, psi):
    """Elements per rank per step: the stage's (zerokit.comm.theory_volume), and for an FSDP2
    setting its own: no backward all-gather when nothing is resharded (2 Psi), and under
    no-sync k gathers of 2 Psi with one reduce-scatter."""
    setting = FULLY_SHARD_SETTINGS.get(cfg.setting, {})
    if setting.get("reshard_after_forward") is False:
        return 2 * psi
    micro = setting.get("micro_batches", 1)
    return theory_volume(cfg.stage, psi, micro_batches=micro, no_sync=micro > 1)


def summarize(per_rank, opts, world_size):
    psi = per_rank[0]["psi"]
    n = world_size
    floors = {}
    for stage, f0 in per_rank[0]["floors"].items():
        parts = {}
        for k in ("forward_backward", "update", "comm"):  # per repetition the slowest rank, then the median
            parts[k] = [max(t) for t in zip(*(r["floors"][stage][k] for r in per_rank))]
        total = [sum(v) for v in zip(*parts.values())]
        floors[stage] = {**{f"{k}_s": statistics.median(v) for k, v in parts.items()},
                         "total_s": statistics.median(total), "total_quartiles_s": quartiles(total),
                         "update_impl": f0["update_impl"], "collectives": list(f0["collectives"])}

    configs = []
    for i, entry in enumerate(per_rank[0]["configs"]):
        cfg = next(c for c in CONFIGS if c.name == entry["name"])
        ranks = [r["configs"][i] for r in per_rank]
        steps = [max(t) for t in zip(*(r["step_times_s"] for r in ranks))]
        med = statistics.median(steps) if steps else float("nan")
        train = [statistics.mean(v) for v in zip(*(r["train_losses"] for r in ranks))]
        theory = _theory_volume(cfg, psi) * 4  # fp32 bytes
        configs.append({
            **asdict(cfg),
            "step_time_s": {"median": med, "min": min(steps, default=med), "max": max(steps, default=med),
                            "quartiles": quartiles(steps),
                            "per_step_slowest_rank": steps},
            "step_cpu_s_per_rank": [statistics.median(r["step_cpu_s"]) if r["step_cpu_s"] else None
                                    for r in ranks],
            # minor page faults per timed step: the median, on the rank with the most. A step that frees
            # large buffers may hand them back to the kernel (glibc's thresholds move with what the
            # process frees) and fault them in again, a page at a time; the README's bench section has
            # the counts measured and what they cost.
            "page_faults_per_step": max((statistics.median(r["step_page_faults"]) for r in ranks
                                         if r["step_page_faults"]), default=None),
            "floor_s": floors[cfg.stage]["total_s"],
            "vs_floor": med / floors[cfg.stage]["total_s"],
            "memory_per_rank": [{k: r["memory"][k] for k in MODEL_STATE + ("other", "total")} for r in ranks],
            "memory_peak": {k: max(r["memory"][k] for r in ranks) for k in MODEL_STATE + ("other", "total")},
            "memory_at_peak_per_rank": [r["memory"]["at_peak"] for r in ranks],
            "comm": {"volume_bytes": max(r["comm"]["volume_bytes"] for r in ranks),
                     "sent_bytes": max(r["comm"]["sent_bytes"] for r in ranks),
                     "wire_bytes": max((r["comm"]["wire_bytes"] or 0 for r in ranks), default=0) or None,
                     "theory_volume_bytes": theory,
                     "vs_theory": max(r["comm"]["volume_bytes"] for r in ranks) / theory,
                     "calls": ranks[0]["comm"]["calls"], "by_op": ranks[0]["comm"]["table"],
                     "all_gather_nodes": {k: max(r["comm"]["all_gather_nodes"][k] for r in ranks)
                                          for k in ("intra", "inter")}},
            "loss": {"final": ranks[0]["final_loss"], "train": train},
        })
    base = next((c for c in configs if c["name"] == BASELINE), configs[0] if configs else None)
    for c in configs:
        c["loss"]["baseline"] = base["name"]
        c["loss"]["final_diff"] = abs(c["loss"]["final"] - base["loss"]["final"])
        c["loss"]["max_train_diff"] = max((abs(a - b) for a, b in zip(c["loss"]["train"], base["loss"]["train"])),
                                          default=0.0)
    ratios = []
    settings = [""] + list(FULLY_SHARD_SETTINGS)
    by_key = {(c["stage"], c["system"], c["setting"]): c for c in reversed(configs)}  # the first of a key wins
    for stage, system, setting in ((st, sy, se) for se in settings for sy in SYSTEMS for st in STAGE_NAMES):
        zk, peer = by_key.get((stage, system, setting)), by_key.get((stage, "torch", setting))
        if zk and peer:
            ratios.append({
                "stage": stage, "zerokit": zk["name"], "peer": peer["name"], "setting": setting,
                "time": zk["step_time_s"]["median"] / peer["step_time_s"]["median"],
                "memory": zk["memory_peak"]["total"] / max(peer["memory_peak"]["total"], 1),
                "model_state": sum(zk["memory_peak"][k] for k in MODEL_STATE)
                / max(sum(peer["memory_peak"][k] for k in MODEL_STATE), 1),
                # None where the peer sends nothing: FSDP2 at N = 1 skips its collectives
                "comm": zk["comm"]["volume_bytes"] / peer["comm"]["volume_bytes"]
                if peer["comm"]["volume_bytes"] else None,
            })
    model_cfg = opts["model"]
    meta = {
        "world_size": n, "backend": per_rank[0]["backend"], "device": per_rank[0]["device"],
        "torch": torch.__version__, "zerokit": zerokit.__version__, "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "threads_per_rank": int(os.environ.get("OMP_NUM_THREADS", "1")),
        "model": {"name": opts["model_name"], **model_cfg, "parameters": psi,
                  "global_batch": model_cfg["batch"] * n},
        "steps": opts["steps"], "warmup": opts["warmup"], "chunk": opts["chunk"], "seed": opts["seed"],
        "hyperparameters": HYPER, "node_size": opts["node_size"],
        "peer_options": {"ddp": DDP_OPTIONS, "zero_redundancy_optimizer": ZERO_REDUNDANCY_OPTIONS},
        "units": ("FSDP2: one fully_shard per block, then the root; ZeRO3Adam: the same units; "
                  "ZeRO2Adam: gradient buckets of two blocks' size; ZeRO1Adam and DataParallel: of half the model's"),
        "how_measured": {
            "step_time": "barrier before each step; a step's time is the slowest rank's; median over timed steps",
            "memory": ("per rank, one step sampled after every tensor op: total = bytes allocated above the "
                       "pre-build level (CPU: glibc mallinfo2 in-use+mmapped; GPU: torch.cuda allocated); "
                       "parameters/gradients/optimizer_states = distinct storages each system holds in that "
                       "role (DTensor: local shard); other = total - those; each its own peak"),
            "comm": "zerokit.CommCounter over one step; volume in the ZeRO paper's convention",
            "floor": ("forward/backward of a plain model + fused AdamW of this rank's elements as one flat "
                      "tensor + raw collectives of the theoretical volume on one flat fp32 buffer; timed in the "
                      "same rotation as the stage's configurations; slowest rank per repetition, median"),
            "loss": "final = eval batch after training (rank 0); diffs against " + (base["name"] if base else BASELINE),
        },
    }
    return {"meta": meta, "floors": floors, "configs": configs, "ratios": ratios}
