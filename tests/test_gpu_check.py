"""`make gpu-check` (zerokit.bench.gpu_check) between GPU runs: it cannot rot on a CPU-only CI.

- without a GPU the command says so in one line and exits 0;
- --rehearse runs every row group on the CPU (gloo; "disk" for pinned offload; the CUDA
  counters "n/a"): the rows' own numerics, memory and checkpoint comparisons must all pass, the
  odd shapes' optimizers end bitwise where torch.optim's do, one lesson's graded checks (02:
  make test grades every solution notebook already) pass through the group's own plumbing, and
  python -m zerokit.train's rows pass too, and zerokit.fully_shard's beside torch's (bench --fsdp2);
- every CUDA branch in zerokit's source has a row (COVERS), and the scanner finds a planted one;
- a group that raises becomes one failed row and the command exits 1; the table says so.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CheckFailed
from zerokit.bench import gpu_check, odd_shapes
from zerokit.bench.gpu_check import COVERS, GROUPS, Row, Target, cuda_branches, format_table, run_checks
from zerokit.bench.workload import MODELS, make_model

ROOT = Path(__file__).resolve().parents[1]


def _command(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "zerokit.bench.gpu_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: `make gpu-check` runs the real rows")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    done = _command()
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], done.stdout


@pytest.mark.distributed
def test_the_rehearsal_runs_every_row_on_the_cpu(tmp_path):
    done = _command("--rehearse", "--out", str(tmp_path), "--lessons", "02", timeout=400)
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    failed = [r for r in report["rows"] if not r["ok"]]
    assert done.returncode == 0 and not failed, done.stdout[-4000:] + done.stderr[-2000:]
    paths = [r["path"] for r in report["rows"]]
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        for precision in ("fp32", "bf16", "fp16"):
            assert f"gloo N=1 {stage} {precision}" in paths
        assert f"gloo N=2 on cpu {stage} fp32" in paths
        assert f"memory N=2 {stage}" in paths
        assert f"bench N=1 zerokit-{stage} (cpu)" in paths and f"bench N=1 wrapper-{stage} (cpu)" in paths
    assert {"launch backend=auto", "checkpoint zero2", "checkpoint zero3", "lesson 00 checks on cpu",
            "lesson 02 checks on cpu"} <= set(paths)
    assert not any(p.startswith("lesson 03") for p in paths)  # --lessons 02: that lesson's graded checks only
    # the flat buffers at 1, 16 and 128 bytes, timed in turns; 16 and 128 the same weights bit for bit (ok)
    assert {f"alignment {name} (cpu)" for name in ("ZeRO1Adam", "ZeRO1(AdamW)", "DataParallel")} <= set(paths)
    # python -m zerokit.train at every stage (bf16 beside its peer and fp32, fp32 beside --impl torch), and by torchrun
    assert {f"train stage {s} (cpu, gloo)" for s in range(4)} | {"train under torchrun, stage 0 bf16"} <= set(paths)
    assert sum(p.startswith("offload=disk") for p in paths) == len(gpu_check.OFFLOAD_RUNS)
    # the odd shapes: every optimizer in both modes, 0 on the CPU too (ok means max |d| == 0)
    for name in odd_shapes.OPTIMIZERS:
        for mode in odd_shapes.MODES:
            assert f"odd shapes {name} {mode}" in paths
    # the bytes an offload row expects to free: the paper's K Psi at N = 1 (K = 8 in fp32, 12 mixed), Psi counted
    # here on the unsharded model (the first H200 run read Psi off a ZeRO-3 model after sharding: 0)
    psi = sum(p.numel() for p in make_model(MODELS["tiny"], torch.device("cpu"), seed=0).parameters())
    for stage, precision in gpu_check.OFFLOAD_RUNS:
        row = next(r for r in report["rows"] if r["path"] == f"offload=disk {stage} {precision}")
        k = 8 if precision == "fp32" else 12
        assert f"theory K Psi = {k * psi / 2**20:.2f} MiB" in row["figure"], row
    # zerokit.fully_shard beside torch's with the same calls (bench --fsdp2 at N = 1), and both default meshes
    assert {"fsdp2 N=1 fp32 (cpu)", "fsdp2 N=1 bf16 (cpu)", "fsdp2 default mesh (cpu)",
            "fsdp2 gloo N=2 on cpu"} <= set(paths)
    rows = json.loads((tmp_path / "fsdp2.json").read_text())["rows"]
    assert [(r["world_size"], r["policy"]) for r in rows] == [(1, "fp32"), (1, "bf16")]
    # FSDP2 at N = 1 skips its collectives: a ratio against nothing is None ("n/a"), not bytes / 1
    bench = json.loads((tmp_path / "bench-ws1.json").read_text())
    sent = {c["name"]: c["comm"]["volume_bytes"] for c in bench["configs"]}
    assert sent["torch-zero3"] == 0 and sent["zerokit-zero3"] > 0, sent
    for r in bench["ratios"]:
        assert (r["comm"] is None) == (sent[r["peer"]] == 0), r
    # the same table on stdout, ending in the verdict
    assert done.stdout.rstrip().endswith(f"{len(paths)} of {len(paths)} rows ok")


def test_a_lessons_failing_check_is_its_cells_failure_and_the_device_is_put_back(monkeypatch):
    from zerokit.bench import lesson_grades
    from zerokit.launcher.backend import DEVICE_ENV

    cells = [(None, False, "import os\nseen = os.environ['ZEROKIT_DEVICE']"),
             ("test_right", True, "assert seen == 'cpu'"),
             ("test_wrong", True, "raise ValueError('the reason\\nand more')"),
             ("test_questions", True, "questions.check(answers)"),  # no device: not run
             (None, False, "raise RuntimeError('a definition failed')"), ("test_after", True, "pass")]
    monkeypatch.setattr(lesson_grades, "_cells", lambda lesson: cells)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    got = [(cell, ok, reason) for cell, ok, reason, _ in lesson_grades.run_lesson("02_distributed_adam", "cpu")]
    assert got == [("test_right", True, None), ("test_wrong", False, "ValueError: the reason"),
                   ("setup", False, "RuntimeError: a definition failed")]
    assert DEVICE_ENV not in os.environ


def test_the_lessons_cells_are_the_autograders_without_hidden_tests_or_magics():
    from zerokit.bench import lesson_grades

    cells = lesson_grades._cells("03_zero1")
    graded = [cell for cell, is_graded, _ in cells if is_graded]
    assert "test_zero1_numerics" in graded and "test_zero1_memory" in graded
    text = "\n".join(source for *_, source in cells)
    assert "lesson03.check_numerics(MyZeRO1Adam" in text and "class MyZeRO1Adam" in text
    assert "HIDDEN TESTS" not in text and "%matplotlib" not in text
    assert lesson_grades.MEASUREMENT not in text


def test_every_cuda_branch_of_zerokit_has_a_row():
    branches = cuda_branches()
    covered = {b for group in COVERS.values() for b in group}
    assert branches, "the scanner found no CUDA branch at all: it is broken"
    missing = sorted(set(branches) - covered)
    assert not missing, f"CUDA branches with no gpu-check row (add one, and name it in COVERS): {missing}"
    stale = sorted(covered - set(branches))
    assert not stale, f"COVERS names code that no longer branches on CUDA: {stale}"
    assert set(COVERS) <= {name for name, _ in GROUPS}


def test_the_scanner_finds_each_kind_of_cuda_branch(tmp_path):
    pkg = tmp_path / "zerokit"
    pkg.mkdir()
    (pkg / "planted.py").write_text(
        "import torch\n"
        "def on_device(t):\n    return 1 if t.device.type == 'cpu' else 2\n"
        "class Holder:\n    def sync(self):\n        torch.cuda.synchronize()\n"
        "def pick(name):\n    return name == 'nccl'\n"
        "def plain(t):\n    '''mentions cuda only in words'''\n    return t + 1\n")
    assert cuda_branches(tmp_path) == ["zerokit/planted.py:Holder.sync", "zerokit/planted.py:on_device",
                                       "zerokit/planted.py:pick"]


def test_a_group_that_raises_is_one_failed_row_and_the_others_still_run(monkeypatch):
    def broken(target):
        """A group that crashes."""
        raise RuntimeError("boom\nsecond line")

    def fine(target):
        return [Row("fine", "nothing", True, "1.0")]

    monkeypatch.setattr(gpu_check, "GROUPS", [("broken", broken), ("fine", fine)])
    said = []
    rows = run_checks(Target("cpu"), "unused", echo=said.append)
    assert [(r.path, r.ok) for r in rows] == [("broken", False), ("fine", True)]
    assert rows[0].figure == "RuntimeError: boom" and rows[0].compared == "A group that crashes."
    assert any("Traceback" in s for s in said)
    table = format_table(rows)
    assert table.splitlines()[0].split() == ["path", "compared", "result", "figure"]
    assert "FAIL" in table and table.endswith("1 of 2 rows ok; FAILED: broken")


def test_main_exits_1_when_a_row_fails(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "GROUPS", [("bad", lambda target: [Row("bad", "x", False, "2 > 1")])])
    assert gpu_check.main(["--rehearse", "--out", str(tmp_path)]) == 1
    assert "0 of 1 rows ok; FAILED: bad" in capsys.readouterr().out
    assert json.loads((tmp_path / "gpu-check.json").read_text())["rows"][0]["ok"] is False


def test_rank_device_under_gloo_follows_zerokit_device(monkeypatch):
    from zerokit.launcher.backend import rank_device

    monkeypatch.delenv("ZEROKIT_DEVICE", raising=False)
    assert rank_device() == torch.device("cpu")
    monkeypatch.setenv("ZEROKIT_DEVICE", "gpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        rank_device()
    if not torch.cuda.is_available():
        monkeypatch.setenv("ZEROKIT_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="sees no CUDA GPU"):
            rank_device()


@pytest.mark.distributed
def test_lesson00_says_when_the_result_is_on_another_device():
    """The device check gpu-check relies on, shown on the CPU: a result on another device (meta here,
    a CPU tensor for a GPU input there) fails with the reason, not a confusing comparison."""
    from zerokit.grading import lesson00

    def elsewhere(tensor):
        return torch.empty(tensor.shape, device="meta")

    with pytest.raises(CheckFailed, match="returned a tensor on meta for an input on cpu"):
        lesson00.check_numerics(elsewhere)


# importing the bench's fsdp2 in this process imports torch's FSDP, whose TorchScript use warns of deprecation
@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_the_shared_fsdp2_row_fails_alone_keeping_the_groups_other_rows(monkeypatch, tmp_path):
    """Two ranks on one GPU over gloo may fail where N = 1 does not (gloo with CUDA tensors): that row says so,
    failed, and the group's other rows stay."""
    from zerokit.bench import fsdp2 as bench

    figures = {"step_time_s": {"median": 0.01}, "peak_bytes": 1024, "final_loss": 1.0}
    monkeypatch.setattr(bench, "run", lambda **kw: {"meta": {"device": "cpu"}, "rows": [
        {"policy": "fp32", "zerokit": figures, "torch": figures, "ratios": {"time": 1.0, "memory": 1.0},
         "losses_bitwise": True, "weights_bitwise": True}]})

    def launch(fn, world_size, *args, **kw):
        if fn is gpu_check._shared_fsdp2:
            raise RuntimeError("a rank failed\nValueError: gloo cannot reduce-scatter these tensors")
        place = {"parameters": ["cpu"], "output": "cpu", "loss": 1.0}
        return [{"torch": place, "zerokit": place}]

    monkeypatch.setattr(gpu_check, "_launch", launch)
    rows = {r.path: r for r in gpu_check.fsdp2(Target("cpu"), tmp_path)}
    assert rows["fsdp2 N=1 fp32 (cpu)"].ok and rows["fsdp2 default mesh (cpu)"].ok, rows
    shared = rows["fsdp2 gloo N=2 on cpu"]
    assert not shared.ok and shared.figure == "RuntimeError: ValueError: gloo cannot reduce-scatter these tensors"
