"""zerokit.offload: the optimizer state in memory-mapped files (lesson 08).

One rank (PeakRSS and settled_resident_bytes change malloc's settings for their process): a
DiskTensor writes through its views, keeps its values across release(), and release() takes
its pages out of the process's resident memory; PeakRSS sees a whole-state load that a chunked
one avoids. One process: clear errors for offload="cpu" without a GPU, unknown options, and a
checkpoint of an offloaded optimizer.

Two gloo ranks: offload="disk" on ZeRO-1, 2 and 3, in fp32 and in bf16 mixed precision (the
fp32 master goes to disk too), is bit-identical to the same optimizer in memory, weights and
m, v, step after step, and its temporary folder is gone with the optimizer; the resident
memory of a rank after a step drops by the optimizer state, 8 Psi/N bytes in fp32 (within
3%; measured with glibc's malloc made to return large blocks at once, after one warm-up
step), and ZeRO-3's peak inside the step rises by a few chunks, not by the state.

The "cpu" (pinned host memory) path needs a GPU and is not run here.
"""

import gc
import os

import pytest
import torch

import zerokit
from conftest import run_ranks
from zerokit.mixed_precision import MixedPrecision
from zerokit.models import OddMLP, build_model, model_batch, model_loss
from zerokit.memory import PeakRSS, resident_bytes, settled_resident_bytes
from zerokit.offload import DiskTensor, Offload, offload_place, offload_theory_bytes
from zerokit.reference import rank_slice

MiB = 2**20


def _disk_tensor_case(rank, world_size, folder):
    n = 16 * MiB // 4
    t = DiskTensor(os.path.join(folder, "m.f32"), n)
    before = settled_resident_bytes()
    t[0:n].fill_(3.0)  # every page touched: 16 MiB resident
    touched = resident_bytes()
    t.release(0, n)
    released = resident_bytes()
    out = {"touched": touched - before, "released": touched - released,
           "kept": float(t[n - 1:n].item()) == 3.0 and torch.equal(t.read(), torch.full((n,), 3.0))}
    x = torch.randn(1000)
    u = DiskTensor(os.path.join(folder, "x.f32"), 1000, init=x)
    out["init"] = torch.equal(u.read(), x)
    v = DiskTensor(os.path.join(folder, "v.f32"), 2 * n)
    with PeakRSS() as chunked:
        for a in range(0, 2 * n, 1 << 18):
            v[a:a + (1 << 18)].add_(1.0)
            v.release(a, a + (1 << 18))
    with PeakRSS() as whole:
        v[0:2 * n].add_(1.0)
        v.release(0, 2 * n)
    out.update(chunked=chunked.bytes, whole=whole.bytes)
    for d in (t, u, v):
        d.close()
    return out


@pytest.mark.distributed
def test_disk_tensor_writes_through_releases_its_pages_and_streams(tmp_path):
    r = run_ranks(_disk_tensor_case, 1, str(tmp_path))[0]
    assert r["touched"] >= 15 * MiB and r["released"] >= 15 * MiB, r
    assert r["kept"] and r["init"], r  # the values are in the file, not in the pages released
    assert r["chunked"] < 4 * MiB and r["whole"] > 30 * MiB, r
    u = DiskTensor(tmp_path / "y.f32", 10)
    with pytest.raises(TypeError, match="contiguous chunks"):
        u[::2]
    u.close()


def test_clear_errors():
    with pytest.raises(ValueError, match="already"):
        offload_place("cpu", "cpu")
    with pytest.raises(ValueError, match="'disk' or 'cpu'"):
        Offload("nvme")
    with pytest.raises(TypeError, match="offload= takes"):
        offload_place(3, "cpu")
    assert Offload(chunk_mb=0.001).chunk_numel == os.sysconf("SC_PAGE_SIZE") // 4  # at least a page
    t = offload_theory_bytes(7.5e9, "zero3", 64, "mixed")
    assert t["device"] == 4 * 7.5e9 / 64 and t["offloaded"] == 12 * 7.5e9 / 64


def _checkpoint_refused(rank, world_size, folder):
    net = build_model("mlp")
    opt = zerokit.ZeRO2Adam(net.parameters(), lr=1e-3, offload=Offload(directory=folder))
    try:
        opt.state_shards()
    except NotImplementedError as exc:
        return str(exc)


@pytest.mark.distributed
def test_an_offloaded_optimizer_says_it_cannot_be_checkpointed(tmp_path):
    assert "cannot be checkpointed" in run_ranks(_checkpoint_refused, 1, str(tmp_path))[0]


# --------------------------------------------------------------------------------------
# on ranks


def _make(stage, net, offload, mixed):
    kw = dict(lr=1e-2, weight_decay=0.1, offload=offload,
              precision=MixedPrecision("bf16", reduce_dtype=torch.float32) if mixed else None)
    if stage == 3:
        return zerokit.ZeRO3Adam(net, **kw)
    if stage == 2:
        return zerokit.ZeRO2Adam(net.parameters(), bucket_mb=0.001, **kw)
    return zerokit.ZeRO1Adam(net.parameters(), **kw)


def _trajectory(rank, world_size, stage, mixed, offload):
    net = build_model("edge")
    opt = _make(stage, net, offload, mixed)
    folder = opt.offload.folder if offload else None
    out = []
    for step in range(3):
        x, y = model_batch("edge", 6, step)
        model_loss("edge", net(rank_slice(x, rank, world_size)).float(), rank_slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
        if stage == 3:
            with opt.gathered():
                weights = {n: p.detach().clone() for n, p in net.named_parameters()}
        else:
            weights = {n: p.detach().clone() for n, p in net.named_parameters()}
        state = [(s.exp_avg if offload is None else s.exp_avg.read(),
                  s.exp_avg_sq if offload is None else s.exp_avg_sq.read()) for s in opt.shards]
        out.append((weights, [(m.clone(), v.clone()) for m, v in state]))
    files = len(os.listdir(folder)) if folder else 0
    del opt
    gc.collect()
    return out, files, folder is not None and os.path.exists(folder)


def _identical(rank, world_size):
    results = {}
    for stage in (1, 2, 3):
        for mixed in (False, True):
            memory, _, _ = _trajectory(rank, world_size, stage, mixed, None)
            disk, files, left = _trajectory(rank, world_size, stage, mixed, "disk")
            same = all(torch.equal(a[0][n], b[0][n]) for a, b in zip(memory, disk) for n in a[0])
            same_state = all(torch.equal(x, y) for a, b in zip(memory, disk) for p, q in zip(a[1], b[1])
                             for x, y in zip(p, q))
            results[stage, mixed] = {"weights": same, "state": same_state, "files": files, "left": left}
    return results


@pytest.mark.distributed
def test_disk_offload_is_bit_identical_and_cleans_up():
    for rank, results in enumerate(run_ranks(_identical, 2)):
        for (stage, mixed), r in results.items():
            what = f"rank {rank}, ZeRO-{stage}, {'bf16' if mixed else 'fp32'}"
            assert r["weights"] and r["state"], f"{what}: differs from the in-memory optimizer"
            assert r["files"] > 0 and not r["left"], f"{what}: {r}"


def _resident(rank, world_size, stage, offload):
    torch.manual_seed(0)
    net = OddMLP((256, 2048, 2048, 7))
    psi = sum(p.numel() for p in net.parameters())
    x, y = torch.randn(8, 256), torch.randn(8, 7)
    torch.nn.functional.mse_loss(net(x), y).backward()  # warm up autograd before measuring
    for p in net.parameters():
        p.grad = None
    start = settled_resident_bytes()
    opt = zerokit.ZeRO3Adam(net, lr=1e-3, offload=offload) if stage == 3 else zerokit.ZeRO2Adam(
        net.parameters(), lr=1e-3, offload=offload)
    torch.nn.functional.mse_loss(net(x), y).backward()
    with PeakRSS() as peak:
        opt.step()
    opt.zero_grad()
    return {"psi": psi, "held": settled_resident_bytes() - start, "peak_rise": peak.bytes}


def _resident_all(rank, world_size):
    settled_resident_bytes()  # from here on large blocks are mappings of their own: RSS follows the tensors
    _resident(rank, world_size, 2, "disk")  # the first step of a process allocates for good (gloo, threads)
    return {(stage, off): _resident(rank, world_size, stage, off) for stage in (2, 3) for off in (None, "disk")}


@pytest.mark.distributed
def test_resident_memory_drops_by_the_optimizer_state():
    for rank, r in enumerate(run_ranks(_resident_all, 2)):
        for stage in (2, 3):
            memory, disk = r[stage, None], r[stage, "disk"]
            state = 8 * memory["psi"] / 2  # m and v of this rank's shard, fp32
            drop = memory["held"] - disk["held"]
            assert abs(drop - state) < 0.03 * state, f"rank {rank}, ZeRO-{stage}: dropped {drop}, state {state}"
        # ZeRO-3's step communicates nothing: its peak is Adam's (ZeRO-2's adds gloo's all-gather buffer)
        assert r[3, "disk"]["peak_rise"] < state / 4, f"rank {rank}: the step's peak rose {r[3, 'disk']['peak_rise']}"
