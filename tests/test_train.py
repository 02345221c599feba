"""python -m zerokit.train: the capstone's script, run as users run jobs.

A small GPT (TinyTransformer on bytes) on the standard library's source, 4 steps of 8
sequences of 32 bytes, fp32 unless said:
- the same loss curve at N = 1, 2 and 4 and at every stage (0-3), within 1e-5 per step:
  the batch of a step is a function of the step alone, split over the ranks;
- bf16 (each stage's own mixed precision) within 2% of fp32's mean loss;
- two torchrun agents on this machine acting as two nodes of 2 processes (c10d rendezvous on
  127.0.0.1) give the same losses, bit for bit, as one node of 4 ranks;
- a job checkpointed at step 2 on 2 ranks and resumed on 4 continues the uninterrupted
  curve (within 1e-5), and a resume with another batch is refused (its data position would
  mean other samples).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_ranks
from zerokit.train import parse_args, train

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "4", "--batch", "8", "--seq-len", "32", "--dim", "32", "--layers", "2", "--heads", "2",
         "--data-mb", "0.25", "--quiet"]


def _losses(result):
    return [result["losses"][k] for k in sorted(result["losses"], key=int)]


def _runs(rank, world_size, configs):
    return [train(rank, world_size, parse_args(SMALL + extra)) for extra in configs]


def _close(a, b, tol=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


@pytest.mark.timeout(240)
def test_every_stage_at_every_world_size_has_the_same_loss_curve():
    stages = [["--stage", str(s)] for s in range(4)]
    reference = _losses(run_ranks(_runs, 1, [["--stage", "0"]])[0][0])
    assert reference[-1] < reference[0]  # it learns
    for world_size in (2, 4):
        for stage, result in enumerate(run_ranks(_runs, world_size, stages)[0]):
            assert _close(_losses(result), reference), (world_size, stage, _losses(result), reference)


@pytest.mark.timeout(240)
def test_bf16_stays_within_two_percent_of_fp32():
    fp32 = _losses(run_ranks(_runs, 1, [["--stage", "0"]])[0][0])
    for stage, result in enumerate(run_ranks(_runs, 2, [["--stage", str(s), "--precision", "bf16"]
                                                         for s in range(4)])[0]):
        got = _losses(result)
        assert abs(sum(got) / len(got) - sum(fp32) / len(fp32)) <= 0.02 * sum(fp32) / len(fp32), (stage, got, fp32)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out, *agent_args, nproc):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                             *agent_args, "-m", "zerokit.train", "--stage", "3", *SMALL, "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(240)
def test_two_torchrun_nodes_equal_one_node_of_four(tmp_path):
    port = _free_port()
    # last_call_timeout: the c10d rendezvous otherwise waits 30 s for more nodes than --nnodes asks
    rdzv = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=capstone",
            "--rdzv-conf=last_call_timeout=1"]
    nodes = [_torchrun(tmp_path / "two.json", *rdzv, f"--node-rank={r}", nproc=2) for r in (0, 1)]
    logs = [n.communicate(timeout=180)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(log[-2000:] for log in logs)
    double = json.loads((tmp_path / "two.json").read_text())
    single = run_ranks(_runs, 4, [["--stage", "3"]])[0][0]  # one node: 4 ranks of one launch, one thread each
    assert single["world_size"] == double["world_size"] == 4
    assert _losses(single) == _losses(double)


def _resume(rank, world_size, directory, extra):
    return train(rank, world_size, parse_args(SMALL + ["--stage", "3", "--checkpoint-dir", str(directory)] + extra))


@pytest.mark.timeout(240)
def test_a_job_resumed_on_another_world_size_continues_the_same_curve(tmp_path):
    whole = _losses(run_ranks(_resume, 2, tmp_path / "whole", [])[0])
    first = run_ranks(_resume, 2, tmp_path / "ckpt", ["--steps", "2", "--checkpoint-every", "2"])[0]
    assert (tmp_path / "ckpt" / "step2" / "COMPLETE").exists() and _close(_losses(first), whole[:2])
    resumed = run_ranks(_resume, 4, tmp_path / "ckpt", ["--resume"])[0]
    assert resumed["start"] == 2 and _close(_losses(resumed), whole[2:])
    with pytest.raises(Exception, match="--batch 8, this run has 16"):
        run_ranks(_resume, 2, tmp_path / "ckpt", ["--resume", "--batch", "16"])
