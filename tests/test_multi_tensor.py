"""zerokit.multi_tensor: Adam on many tensors at once, bitwise torch.optim.AdamW on the CPU.

The multi-tensor update is what DistributedAdam and ZeRO-1/2/3 run by default on a GPU
(foreach=None follows torch.optim.AdamW's default); on the CPU it runs when asked (foreach=True).
Checked here, all with torch.equal:
- the function alone, against torch.optim.AdamW with foreach=False and with foreach=True: six
  steps, weight decay, odd shapes, an fp64 tensor beside fp32 ones (two multi-tensor groups), and
  one tensor without a gradient every other step (per-tensor step counts differ);
- every stage with foreach=True on two ranks that see the same batch, against AdamW on one
  process, after every step, on BranchNet whose branch sits out every third step (the shard's
  runs then carry two different step counts into one call);
- foreach=None takes the path torch takes for the same tensors (on the CPU: lesson 01's loop).
"""

import pytest
import torch

import zerokit
from conftest import run_ranks
from zerokit.models import BranchNet
from zerokit.multi_tensor import adamw_multi_tensor_, default_foreach

LR, WD, STEPS = 1e-2, 0.1, 6
SHAPES = [((7, 5), torch.float32), ((3,), torch.float32), ((11, 13), torch.float64), ((1,), torch.float32)]
SITS_OUT = 1  # SHAPES[1] has no gradient at odd steps


def _data():
    torch.manual_seed(0)
    init = [torch.randn(s, dtype=d) for s, d in SHAPES]
    grads = [[torch.randn(s, dtype=d) for s, d in SHAPES] for _ in range(STEPS)]
    return init, grads


def _with_torch(foreach):
    init, grads = _data()
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=foreach)
    for k in range(STEPS):
        for j, p in enumerate(params):
            p.grad = None if (k % 2 and j == SITS_OUT) else grads[k][j].clone()
        opt.step()
    return [(p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]


def _with_multi_tensor():
    init, grads = _data()
    params = [t.clone() for t in init]
    m, v = [torch.zeros_like(t) for t in init], [torch.zeros_like(t) for t in init]
    steps = [0] * len(params)
    for k in range(STEPS):
        have = [j for j in range(len(params)) if not (k % 2 and j == SITS_OUT)]
        for j in have:
            steps[j] += 1
        adamw_multi_tensor_(*([lst[j] for j in have] for lst in (params, [g for g in grads[k]], m, v, steps)),
                            lr=LR, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WD)
    assert steps[SITS_OUT] == STEPS // 2 and steps[0] == STEPS
    return list(zip(params, m, v))


@pytest.mark.parametrize("foreach", [False, True])
def test_the_update_is_torch_adamw_bitwise(foreach):
    for j, (got, want) in enumerate(zip(_with_multi_tensor(), _with_torch(foreach), strict=True)):
        for what, a, b in zip(("weights", "exp_avg", "exp_avg_sq"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), \
                f"tensor {j} {what}: max |d| {(a - b).abs().max().item():.2e} against AdamW(foreach={foreach})"


def test_foreach_none_is_what_torch_optim_picks():
    cpu = [torch.zeros(3)]
    assert default_foreach(cpu) is False  # torch.optim runs its per-tensor loop on a CPU
    meta = [torch.zeros(3, device="meta")]  # a device with no multi-tensor kernels: also the loop
    assert default_foreach(meta) is False


# --------------------------------------------------------------------------------------
# the stages, foreach=True, on two ranks with the same batch


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 9, generator=g), torch.randn(8, 5, generator=g)) for _ in range(STEPS)]


def _uses_branch(step):
    return step % 3 != 2  # the branch sits out steps 2 and 5: its step count falls behind


def _trajectory(model, opt, stage):
    snaps = []
    for step, (x, y) in enumerate(_batches()):
        torch.nn.functional.mse_loss(model(x, use_branch=_uses_branch(step)), y).backward()
        opt.step()
        opt.zero_grad()
        if stage == "zero3":
            with opt.gathered():
                snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        else:
            snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snaps


def _new_branch_net():
    torch.manual_seed(3)
    return BranchNet()


def stages_with_foreach(rank, world_size, calls):
    """Each stage with foreach=True, and AdamW on this process as the reference (same thread count)."""
    import zerokit.multi_tensor as mt
    import zerokit.ddp
    import zerokit.zero1

    seen = []

    def spy(*args, **kwargs):  # the multi-tensor path did run: count its calls
        seen.append(len(args[0]))
        return mt.adamw_multi_tensor_(*args, **kwargs)

    zerokit.ddp.adamw_multi_tensor_ = zerokit.zero1.adamw_multi_tensor_ = spy
    model = _new_branch_net()
    ref = _trajectory(model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False), "ref")
    out = {}
    hyper = dict(lr=LR, weight_decay=WD, foreach=True)
    for stage in ("ddp", "zero1", "zero2", "zero3"):
        model = _new_branch_net()
        opt = {"ddp": lambda: zerokit.DistributedAdam(model.parameters(), **hyper),
               "zero1": lambda: zerokit.ZeRO1Adam(model.parameters(), **hyper),
               "zero2": lambda: zerokit.ZeRO2Adam(model.parameters(), bucket_mb=400 * 4 / 2**20, **hyper),
               "zero3": lambda: zerokit.ZeRO3Adam(model, **hyper)}[stage]()
        seen.clear()
        snaps = _trajectory(model, opt, stage)
        out[stage] = {"calls": list(seen),
                      "diff": [max((s[n] - r[n]).abs().max().item() for n in r) for s, r in zip(snaps, ref)],
                      "equal": all(torch.equal(s[n], r[n]) for s, r in zip(snaps, ref) for n in r)}
    return out


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_every_stage_with_foreach_is_bitwise_adamw_on_two_ranks_with_the_same_batch():
    for rank, res in enumerate(run_ranks(stages_with_foreach, 2, None)):
        for stage, r in res.items():
            assert r["equal"], f"rank {rank} {stage}: max |d| per step {r['diff']} against AdamW"
            assert r["calls"], f"rank {rank} {stage}: foreach=True never called the multi-tensor update"
        # DistributedAdam: one call per step for all six parameters (four where the branch sat out)
        assert res["ddp"]["calls"] == [6 if _uses_branch(s) else 4 for s in range(STEPS)], res["ddp"]["calls"]
        # ZeRO-1, one bucket: its shard's runs in one call; where the branch sat out, its run is left out
        assert len(res["zero1"]["calls"]) == STEPS, res["zero1"]["calls"]


def default_paths(rank, world_size):
    import zerokit.ddp
    import zerokit.zero1

    calls = []
    zerokit.ddp.adamw_multi_tensor_ = zerokit.zero1.adamw_multi_tensor_ = lambda *a, **k: calls.append(1)
    out = {}
    for name, make in {"ddp": zerokit.DistributedAdam, "zero1": zerokit.ZeRO1Adam}.items():
        model = _new_branch_net()
        opt = make(model.parameters(), lr=LR)
        _trajectory(model, opt, name)
        out[name] = len(calls)
    return out


@pytest.mark.distributed
def test_foreach_none_runs_lesson_01s_loop_on_a_cpu_as_torch_does():
    assert run_ranks(default_paths, 1)[0] == {"ddp": 0, "zero1": 0}
