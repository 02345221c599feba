"""zerokit.fully_shard against data parallel and against torch's fully_shard, the way FSDP2 tests itself.

The recipe of PyTorch's test_fully_shard_training.py (train parity): layers of uneven shapes
((7, 15), (15, 3), (3, 16), (16, 17) and a root parameter), 10 iterations of Adam at lr 1e-2,
zero_grad alternating set_to_none, each rank its own batch, and after every backward each
rank's local rows of every parameter and of its gradient (a DTensor placed Shard(0): rows
[r c, r c + c) of the full tensor, c = ceil(rows / N)) compared with those rows of a
data-parallel reference's parameter and gradient. Both data-parallel references run on the same
ranks: torch's DistributedDataParallel and zerokit.DataParallel, each trained once per launch and
micro-batching (every control but no-sync takes the same steps) and compared with every control. And beside torch's own
fully_shard given the same calls with the same settings (fully_shard on each layer, then on the
root): the loss of every step and the final weights, bit for bit.

One launch per world size (2 and 4) runs every control: reshard_after_forward True, False, None
and 2 (hpZ; at N = 4 only: at N = 2 a node of 2 ranks is every rank, and 2 is True), gradient sync off for the first of two micro-batches, explicit
prefetch, two layers in one call, unshard() before forward, and bf16 compute with fp32 outputs
(against torch's fully_shard only: the data-parallel references compute in fp32).

What is bitwise and what is not, and why:
- zerokit against torch's fully_shard: bitwise at N = 2 and 4, fp32 and bf16. The same forward and
  backward on the same gathered weights, the same collectives on the same bytes in the same order
  (the all-gather of one copied-in buffer per call, the reduce-scatter of the chunk-cat laid out the
  same way, averaged by gloo the same way), Adam elementwise on the same fp32 rows.
- zerokit against either data-parallel reference: their all-reduce sums the whole gradient in its own
  order (torch's DDP pre-divides by N, then sums over gloo's ring; zerokit.DataParallel sums, then
  divides): equal to rounding, within 1e-5 after 10 Adam steps (Adam divides by the square root of
  a running mean of squares, which magnifies the last bit of a small gradient).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import zerokit
from conftest import run_ranks
from test_fully_shard_controls import layers, rows_held, uneven
from zerokit.fully_shard.api import fully_shard as zerokit_fully_shard

ITERATIONS, LR = 10, 1e-2
CONTROLS = {
    "reshard True": {"reshard_after_forward": True},
    "reshard False": {"reshard_after_forward": False},
    "reshard None": {},
    "reshard 2 (hpZ)": {"reshard_after_forward": 2},
    "no-sync": {"micro": 2},
    "explicit prefetch": {"prefetch": True},
    "grouped": {"group": True},
    "unshard": {"unshard": True},
    "bf16, fp32 out": {"bf16": True},
}


def data(rank, step, n=4):
    """Each rank its own rows, with a target the model can learn (so that the loss falls)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(n, 7, generator=g)
    target = torch.Generator().manual_seed(7)
    return x, torch.sin(x @ torch.randn(7, 17, generator=target))


def _fully_shard(system, control):
    """The model under zerokit's fully_shard or torch's: the same calls, with the control's settings."""
    shard = zerokit_fully_shard if system == "zerokit" else torch_fully_shard
    model = uneven()
    units = [[model.inp, model.mid], model.up, model.out] if control.get("group") else layers(model)
    kw = {"reshard_after_forward": control["reshard_after_forward"]} if "reshard_after_forward" in control else {}
    if control.get("bf16"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                               output_dtype=torch.float32)
    for unit in units:
        shard(unit, **kw)
    shard(model, **kw)
    if control.get("prefetch"):  # each layer prefetches the next in forward and the previous in backward
        each = layers(model)
        for i, layer in enumerate(each):
            layer.set_modules_to_forward_prefetch(each[i + 1:i + 2])
            layer.set_modules_to_backward_prefetch(each[max(i - 1, 0):i])
    return model


def _replicated(system):
    model = uneven()
    if system == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return zerokit.DataParallel(model)


def _step(model, rank, it, control):
    """One iteration's forward and backward (two micro-batches, the first unsynchronised, for no-sync)."""
    micro = control.get("micro", 1)
    losses = []
    for k in range(micro):
        last = k == micro - 1
        if control.get("unshard") and hasattr(model, "unshard"):
            model.inp.unshard(async_op=True)  # the forward waits for it
        x, y = data(rank, micro * it + k)
        if micro > 1 and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)
        if micro > 1 and not last and hasattr(model, "no_sync"):  # the data-parallel references
            with model.no_sync():
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        losses.append(loss.detach())
    return sum(losses) / micro


def _mean_over_ranks(loss):
    loss = loss.clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def _reference_run(system, rank, micro):
    """A data-parallel reference's parameters and gradients after every backward (before its step): the same
    for every control with the same micro-batches, so each is trained once per launch and compared many times."""
    model = _replicated(system)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    snaps = []
    for it in range(ITERATIONS):
        _step(model, rank, it, {"micro": micro})
        snaps.append({n: (p.detach().clone(), None if p.grad is None else p.grad.clone())
                      for n, p in model.module.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=it % 2 == 0)
    return snaps


def _against(sharded, snap, rank, world_size, worst):
    """Each parameter's and gradient's local rows against the same rows of a reference's snapshot; the number
    of gradients compared."""
    checked = 0
    for name, p in sharded.named_parameters():
        full, full_grad = snap[name]
        start, length = rows_held(full.shape[0], world_size, rank)
        local = p.to_local()
        worst[0] = max(worst[0], (local - full[start:start + length]).abs().max().item() if length else 0.0)
        if p.grad is not None:
            grad = p.grad.to_local()
            worst[1] = max(worst[1], (grad - full_grad[start:start + length]).abs().max().item() if length else 0.0)
            checked += 1
    return checked


def _controls(world_size):
    """The controls that differ at this world size: at N = 2, reshard_after_forward=2 is True."""
    return {k: c for k, c in CONTROLS.items() if c.get("reshard_after_forward") != world_size}


def _parity(rank, world_size):
    references = {(ref, micro): _reference_run(ref, rank, micro) for ref in ("ddp", "dp") for micro in (1, 2)}
    out = {}
    for name, control in _controls(world_size).items():
        fp32 = not control.get("bf16")
        systems = {"zerokit": _fully_shard("zerokit", control), "torch": _fully_shard("torch", control)}
        opts = {s: torch.optim.Adam(m.parameters(), lr=LR) for s, m in systems.items()}
        losses = {s: [] for s in systems}
        worst = {"ddp": [0.0, 0.0], "dp": [0.0, 0.0]}  # (rows, gradient rows) against each reference's
        grads_checked = 0
        for it in range(ITERATIONS):
            for s, model in systems.items():
                losses[s].append(_mean_over_ranks(_step(model, rank, it, control)))
            if fp32:
                for ref in ("ddp", "dp"):
                    snap = references[(ref, control.get("micro", 1))][it]
                    grads_checked += _against(systems["zerokit"], snap, rank, world_size, worst[ref])
            for s in systems:
                opts[s].step()
                opts[s].zero_grad(set_to_none=it % 2 == 0)
        weights = {s: {n: p.full_tensor() for n, p in systems[s].named_parameters()} for s in ("zerokit", "torch")}
        out[name] = {"losses": losses, "worst": worst, "grads_checked": grads_checked,
                     "apart": max((weights["zerokit"][n] - w).abs().max().item() for n, w in weights["torch"].items()),
                     "bitwise": all(torch.equal(weights["zerokit"][n], w) for n, w in weights["torch"].items())}
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_control_trains_as_data_parallel_and_bitwise_as_torchs_fully_shard(world_size):
    results = run_ranks(_parity, world_size, timeout=240)
    assert len(results[0]) == len(CONTROLS) - (world_size == 2)
    lines = []
    for name, control in _controls(world_size).items():
        got = results[0][name]
        ours, theirs = got["losses"]["zerokit"], got["losses"]["torch"]
        assert sum(ours[-3:]) < sum(ours[:3]), (name, ours)  # it trains: a real comparison
        assert ours == theirs, (name, ours, theirs)  # the same calls, the same collectives: bit for bit
        assert got["bitwise"], (name, got["apart"])
        for rank_result in results:
            r = rank_result[name]
            if not control.get("bf16"):
                assert r["grads_checked"] > 0
                for ref in ("ddp", "dp"):
                    assert r["worst"][ref][0] <= 1e-5 and r["worst"][ref][1] <= 1e-5, (name, ref, r["worst"])
        ddp = results[0][name]["worst"]["ddp"]
        lines.append(f"{name}: torch's fully_shard bitwise"
                     + (f", DDP rows {ddp[0]:.1e} gradient {ddp[1]:.1e}" if not control.get("bf16") else ""))
    print(f"N = {world_size}:\n  " + "\n  ".join(lines))
