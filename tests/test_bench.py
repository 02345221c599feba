"""`python -m zerokit.bench` runs end to end and writes what it promises.

Not a test of speed: a tiny model, two timed steps, every configuration (about 30 s on an
idle 2-core machine). It checks that the command succeeds, that the JSON has its fields,
and that every system trained the same model to the same loss as DDP + torch.optim.AdamW.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG_FIELDS = {"name", "stage", "system", "label", "step_time_s", "floor_s", "vs_floor", "memory_per_rank",
                 "memory_peak", "comm", "loss"}
MEMORY_FIELDS = {"parameters", "gradients", "optimizer_states", "other", "total"}


@pytest.mark.distributed
@pytest.mark.timeout(150)  # generous: the machine may be shared
def test_bench_command_writes_table_json_and_plot(tmp_path):
    cmd = [sys.executable, "-m", "zerokit.bench", "--model", "tiny", "--steps", "2", "--warmup", "0",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "zerokit / PyTorch peer" in proc.stdout and "floor zero3" in proc.stdout  # the table was printed

    summary = json.loads((tmp_path / "bench-ws2.json").read_text())
    assert (tmp_path / "bench-ws2.png").stat().st_size > 0
    meta = summary["meta"]
    assert meta["world_size"] == 2 and meta["backend"] == "gloo"
    assert meta["model"]["parameters"] > 0

    configs = {c["name"]: c for c in summary["configs"]}
    assert set(configs) == {f"{system}-{stage}" for system in ("torch", "zerokit", "wrapper")
                            for stage in ("ddp", "zero1", "zero2", "zero3")}
    psi = meta["model"]["parameters"]
    for name, c in configs.items():
        assert CONFIG_FIELDS <= set(c), name
        assert c["step_time_s"]["median"] > 0 and c["floor_s"] > 0, name
        assert len(c["memory_per_rank"]) == 2
        for rank_memory in c["memory_per_rank"]:
            assert MEMORY_FIELDS <= set(rank_memory), name
            assert rank_memory["parameters"] > 0 and rank_memory["optimizer_states"] > 0, name
        # every system communicates (the counter sees DDP, ZeroRedundancyOptimizer and FSDP2 too)
        assert c["comm"]["volume_bytes"] >= 1.5 * psi * 4, (name, c["comm"])
        assert c["comm"]["theory_volume_bytes"] == (3 if c["stage"] == "zero3" else 2) * psi * 4
        # the same AdamW on the same global batches: the same loss, up to float rounding
        assert math.isfinite(c["loss"]["final"]), name
        # one training loss per step taken (warm-up, the instrumented step, the timed ones): an
        # empty list would make max_train_diff 0.0 and the check below pass without comparing
        assert len(c["loss"]["train"]) == meta["warmup"] + 1 + meta["steps"], (name, c["loss"]["train"])
        assert c["loss"]["final_diff"] < 1e-4, (name, c["loss"])
        assert c["loss"]["max_train_diff"] < 1e-4, (name, c["loss"])

    # sharding shows: optimizer state halves from DDP to ZeRO-1 on 2 ranks
    for system in ("torch", "zerokit", "wrapper"):
        ddp = configs[f"{system}-ddp"]["memory_peak"]["optimizer_states"]
        zero1 = configs[f"{system}-zero1"]["memory_peak"]["optimizer_states"]
        assert zero1 < 0.75 * ddp, (system, ddp, zero1)

    ratios = {(r["zerokit"].split("-")[0], r["stage"]): r for r in summary["ratios"]}
    assert set(ratios) == {(system, stage) for system in ("zerokit", "wrapper")
                           for stage in ("ddp", "zero1", "zero2", "zero3")}
    for r in ratios.values():
        assert {"time", "memory", "model_state", "comm"} <= set(r) and r["time"] > 0

    # the floor of every stage: compute without communication + the raw collectives
    assert set(summary["floors"]) == {"ddp", "zero1", "zero2", "zero3"}
    for f in summary["floors"].values():
        assert {"forward_backward_s", "update_s", "comm_s", "total_s", "collectives"} <= set(f)
        parts = [f["forward_backward_s"], f["update_s"], f["comm_s"]]
        # total is the median of per-repetition sums, each part a median of its own: in general
        # only total >= every part holds; with 2 repetitions each median is a mean, so the
        # total is the sum of the parts up to float rounding
        assert f["total_s"] >= max(parts), f
        assert f["total_s"] == pytest.approx(sum(parts), rel=1e-9), f
