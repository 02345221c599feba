"""ZeRO++ and hybrid sharding (zerokit/zeropp.py), measured on 4 gloo ranks laid out as 2 "nodes" of 2.

- hpZ (ZeROppAdam(reshard_after_forward=2), FSDP2's reshard_after_forward=k): bitwise ZeRO3Adam, lesson 05's
  class; backward's all-gathers 0 bytes across nodes; the secondary shards, Ψ/k, held between
  forward and backward beside the shards and nothing after;
- qwZ: each block's error within half a quantisation step (the bound that follows from the scale),
  the values against torch's own per-channel int8 quantiser; the forward gathers' bytes Ψ + 4Ψ/B
  against ZeRO-3's 4Ψ; backward computes with forward's weights (hpZ's exact secondary copies, or
  the primary shards quantised again: the same losses and weights bit for bit); a 50-step loss
  curve on the zoo's "outlier" model (1% of the weights 50 times the rest), blocks of 32, within 4%
  of exact ZeRO-3 at every step, where one scale per shard is not;
- hybrid sharding (HybridShardAdam(node_size=2)): the weights against one process running
  torch.optim.AdamW on the whole batch, the model states at rest 16Ψ/k per rank (ZeRO-3's at N = k),
  and the bytes across nodes: the gradients' all-reduce, 2 x 4Ψ/k.

Formulas are taken over the units' padded flat buckets (FlatBucket's layout), as in
test_fully_shard_controls.py.
"""

import pytest
import torch
import torch.distributed as dist

import zerokit
from conftest import padding_bound, run_ranks
from zerokit.memory import census
from zerokit.models import build_model, model_batch, model_loss
from zerokit.reference import rank_slice
from zerokit.zeropp import (HybridShardAdam, ZeROppAdam, dequantize_blocks, n_blocks, node_group, quantize_blocks,
                            replica_group)

NODE = 2  # ranks per "node": 4 ranks are 2 nodes of 2
BATCH = 8  # the global batch: 2 samples per rank
LR = 1e-2


def _step(model, name, opt, rank, n, step):
    """Forward (counted), the parameter bytes held then, backward (counted), step: one record."""
    x, y = model_batch(name, BATCH, step)
    x, y = rank_slice(x, rank, n), rank_slice(y, rank, n)
    with zerokit.CommCounter() as fwd:
        loss = model_loss(name, model(x), y)
    held = census(model, opt, scan=False)["parameters"]
    with zerokit.CommCounter() as bwd:
        loss.backward()
    opt.step()
    at_rest = census(model, opt, scan=False)  # after the step, the gradient shards still there
    opt.zero_grad()
    return {"loss": loss.item(), "held": held, "at_rest": at_rest,
            "fwd_ag": fwd.node_split(NODE, "all_gather"), "bwd_ag": bwd.node_split(NODE, "all_gather"),
            "bwd_rs": bwd.node_split(NODE, "reduce_scatter"), "bwd_ar": bwd.node_split(NODE, "all_reduce")}


def _train(rank, n, cls, kw, name="nested", steps=3):
    model = build_model(name)
    opt = cls(model, lr=LR, **kw)
    steps = [_step(model, name, opt, rank, n, s) for s in range(steps)]
    with opt.gathered():
        weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"steps": steps, "weights": weights, "padded": [b.padded_numel for b in opt.buckets],
            "root": sum(b.padded_numel for b, u in zip(opt.buckets, opt.bucket_units) if u == 0),
            "secondary_after": [s for s in getattr(opt, "secondary", []) if s is not None]}


BLOCK = 64
RUNS = {
    "zero3": (zerokit.ZeRO3Adam, {}),
    "hpz": (ZeROppAdam, {"reshard_after_forward": NODE}),
    "qwz": (ZeROppAdam, {"quantize_block": BLOCK}),
    "qwz+hpz": (ZeROppAdam, {"quantize_block": BLOCK, "reshard_after_forward": NODE}),
    "hsdp": (HybridShardAdam, {"node_size": NODE}),
}


def _schemes_case(rank, world_size):
    return {label: _train(rank, world_size, cls, kw) for label, (cls, kw) in RUNS.items()}


@pytest.fixture(scope="module")
def schemes():
    return run_ranks(_schemes_case, 4)


@pytest.mark.distributed
def test_hpz_is_zero3_bit_for_bit_with_backward_inside_the_node(schemes):
    for rank, got in enumerate(schemes):
        z3, hpz = got["zero3"], got["hpz"]
        total, root = sum(z3["padded"]), z3["root"]
        assert [s["loss"] for s in hpz["steps"]] == [s["loss"] for s in z3["steps"]], rank
        for name, w in z3["weights"].items():
            assert torch.equal(hpz["weights"][name], w), (rank, name)
        for step, (a, b) in enumerate(zip(z3["steps"], hpz["steps"])):
            where = f"rank {rank}, step {step}"
            # ZeRO-3: forward's and backward's gathers and the reduce-scatter all span the nodes
            assert a["fwd_ag"] == {"intra": 0, "inter": 4 * total}, where
            assert a["bwd_ag"] == {"intra": 0, "inter": 4 * (total - root)}, where  # the root stays gathered
            assert a["bwd_rs"] == {"intra": 0, "inter": 4 * total}, where
            # hpZ: forward and the reduce-scatter as ZeRO-3, backward's gathers inside the node, none across
            assert b["fwd_ag"] == a["fwd_ag"] and b["bwd_rs"] == a["bwd_rs"], where
            assert b["bwd_ag"] == {"intra": 4 * total, "inter": 0}, where  # the root too: hpZ keeps a secondary
            # held between forward and backward: ZeRO-3's (the shards, the root full) + Psi/k of secondaries,
            # where hpZ's root unit keeps a secondary instead of staying full
            assert b["held"] - a["held"] == 4 * total // NODE - 4 * root, (where, b["held"], a["held"])
            assert b["at_rest"] == a["at_rest"], where  # nothing kept after backward
        assert hpz["secondary_after"] == []


@pytest.mark.distributed
def test_qwz_moves_int8_and_scales_and_backward_computes_with_forwards_weights(schemes):
    for rank, got in enumerate(schemes):
        z3, qwz, both = got["zero3"], got["qwz"], got["qwz+hpz"]
        padded = z3["padded"]
        total = sum(padded)
        # one int8 per element and one fp32 scale per block of each rank's shard: Psi + 4 Psi / B
        wire = sum(p + 4 * 4 * n_blocks(p // 4, BLOCK) for p in padded)
        assert wire < 4 * total * (1 + 4 / BLOCK) / 4 + 4 * 4 * len(padded)  # ~ Psi (1 + 4 / B) bytes
        for step in range(3):
            where = f"rank {rank}, step {step}"
            assert qwz["steps"][step]["fwd_ag"] == {"intra": 0, "inter": wire}, where
            assert z3["steps"][step]["fwd_ag"] == {"intra": 0, "inter": 4 * total}, where
            assert both["steps"][step]["bwd_ag"] == {"intra": 4 * total, "inter": 0}, where  # exact, in the node
        # backward computed with forward's (dequantised) weights either way: the same numbers bit for bit
        assert [s["loss"] for s in both["steps"]] == [s["loss"] for s in qwz["steps"]]
        for name, w in qwz["weights"].items():
            assert torch.equal(both["weights"][name], w), (rank, name)
        assert qwz["steps"][0]["loss"] != z3["steps"][0]["loss"]  # the weights forward used were int8's
    print(f"forward gathers per rank: {wire} B with int8 in blocks of {BLOCK}, {4 * total} B in fp32 "
          f"({wire / (4 * total):.3f})")


def _adamw_on_one_process(name, steps):
    model = build_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    for step in range(steps):
        x, y = model_batch(name, BATCH, step)
        model_loss(name, model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.distributed
def test_hybrid_sharding_numerics_memory_and_traffic(schemes):
    reference = _adamw_on_one_process("nested", 3)
    psi = sum(p.numel() for p in build_model("nested").parameters())
    for rank, got in enumerate(schemes):
        hsdp, z3 = got["hsdp"], got["zero3"]
        for name, w in reference.items():
            torch.testing.assert_close(hsdp["weights"][name], w, atol=1e-6, rtol=1e-5, msg=f"rank {rank}, {name}")
        padded_k = sum(hsdp["padded"])  # units padded for the node's 2 ranks (and aligned: zerokit.flat)
        n_params = sum(1 for _ in build_model("nested").parameters())
        assert psi <= padded_k < psi + padding_bound(n_params, len(hsdp["padded"]), NODE)
        for step, s in enumerate(hsdp["steps"]):
            where = f"rank {rank}, step {step}"
            rest = s["at_rest"]  # model states at rest: ZeRO-3's 4 + 4 + 8 bytes over the node's k = 2 ranks
            assert (rest["parameters"], rest["gradients"], rest["optimizer_states"]) == (
                4 * padded_k // NODE, 4 * padded_k // NODE, 8 * padded_k // NODE), where
            assert z3["steps"][step]["at_rest"]["total"] == 16 * sum(z3["padded"]) // 4, where  # 16 Psi / N
            # every gather and reduce-scatter inside the node; across nodes only the gradients' all-reduce
            assert s["fwd_ag"] == {"intra": 4 * padded_k, "inter": 0}, where
            assert s["bwd_rs"] == {"intra": 4 * padded_k, "inter": 0}, where
            assert s["bwd_ar"] == {"intra": 0, "inter": 2 * 4 * padded_k // NODE}, where


def _curve_case(rank, world_size, steps):
    out = {}
    for label, kw in (("exact", {}), ("blocks", {"quantize_block": 32}), ("per shard", {"quantize_block": 10 ** 6})):
        model = build_model("outlier")
        opt = ZeROppAdam(model, lr=1e-3, reshard_after_forward=NODE, **kw)
        losses = []
        for step in range(steps):
            x, y = model_batch("outlier", 32, step)
            loss = model_loss("outlier", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
        out[label] = losses
    return out


@pytest.mark.distributed
def test_qwz_loss_curve_stays_within_4_percent_of_exact_where_one_scale_per_shard_does_not():
    """Measured when written: blocks of 32 at most 1.3% off exact ZeRO-3 over the 50 steps (loss 4.49
    to 0.94), one scale per shard 9.3% (on four other data streams: 1.6-1.9% and 6.8-9.6%; blocks of
    64 1.8-3.9%). The tolerance of lesson 11's check_qwz_training."""
    got = run_ranks(_curve_case, 4, 50)[0]
    exact = got["exact"]
    assert exact[-1] < 0.4 * exact[0]  # it learns: the differences are not noise around a flat line
    worst = {label: max(abs(a - b) / b for a, b in zip(curve, exact)) for label, curve in got.items()}
    assert worst["blocks"] < 0.04, worst
    assert worst["per shard"] > 0.04, worst
    print(f"loss {exact[0]:.3f} -> {exact[-1]:.3f}; worst relative difference to exact: "
          + ", ".join(f"{k} {v:.4f}" for k, v in worst.items()))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated, still there in 2.13
def test_block_quantisation_error_is_within_half_a_step_and_matches_torchs_int8():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 1, 1000)  # blocks of very different sizes
    x[128:192] = 0.0  # a block of zeros
    for block in (1, 7, 64, 1000, 5000):
        q, scales = quantize_blocks(x, block)
        assert q.dtype == torch.int8 and q.shape == x.shape and scales.dtype == torch.float32
        assert scales.numel() == n_blocks(x.numel(), block) == -(-1000 // block)
        step = scales[torch.arange(1000) // block]  # each element's quantisation step
        err = (dequantize_blocks(q, scales, block) - x).abs()
        assert bool((err <= step / 2 * (1 + 1e-6) + 1e-12).all()), (block, float((err - step / 2).max()))
        assert int(q.abs().max()) == 127  # the block's largest element lands on the end of the range
        # against torch's own int8: the same codes, where x / scale is not within rounding of a tie
        width = min(block, 1000)
        padded = torch.cat([x, x.new_zeros(n_blocks(1000, width) * width - 1000)]).view(-1, width)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).double()
        theirs = torch.quantize_per_channel(padded, safe, torch.zeros_like(scales, dtype=torch.long), 0,
                                            torch.qint8).int_repr().reshape(-1)[:1000]
        ratio = (x.double() / safe[torch.arange(1000) // width]).abs()
        near_tie = (ratio - ratio.floor() - 0.5).abs() < 1e-4
        assert torch.equal(q[~near_tie], theirs[~near_tie]), block
    with pytest.raises(ValueError, match="positive number"):
        quantize_blocks(x, 0)


def _groups_case(rank, world_size):
    node, replicas = node_group(NODE), replica_group(NODE)
    for group in (node, replicas):  # used, as every group is: a rank must not leave before its peers connect
        dist.barrier(group=group)
    out = {"node": dist.get_process_group_ranks(node), "replicas": dist.get_process_group_ranks(replicas)}
    for bad in (3, 0):
        try:
            replica_group(bad)
        except ValueError as exc:
            out[bad] = str(exc)
    return out


@pytest.mark.distributed
def test_node_and_replica_groups_of_a_2x2_layout():
    got = run_ranks(_groups_case, 4)
    assert [g["node"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["replicas"] for g in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert "divides the group's 4 ranks" in got[0][3] and "divides" in got[0][0]


FOREACH_RUNS = {  # on 2 ranks: qwZ's gathers; hybrid sharding as 2 nodes of 1 rank (replicas all-reduced)
    "qwz": (ZeROppAdam, {"quantize_block": BLOCK}),
    "hsdp": (HybridShardAdam, {"node_size": 1}),
}


def _foreach_case(rank, world_size, steps=3):
    out = {}
    for label, (cls, kw) in FOREACH_RUNS.items():
        for foreach in (True, False):
            model = build_model("nested")
            opt = cls(model, lr=LR, foreach=foreach, **kw)
            for step in range(steps):
                x, y = model_batch("nested", BATCH, step)
                x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
                model_loss("nested", model(x), y).backward()
                opt.step()
                opt.zero_grad()
            with opt.gathered():
                weights = {k: v.detach().clone() for k, v in model.named_parameters()}
            out[label, foreach] = {"told": [s.foreach for s in opt.shards], "weights": weights}
    return out


@pytest.mark.distributed
def test_foreach_reaches_every_shard_and_true_and_false_train_bit_for_bit_alike():
    """foreach= as ZeRO3Adam takes it: each shard updates with the multi-tensor Adam (True) or
    lesson 01's loop (False), which on a CPU are the same arithmetic, bit for bit."""
    for rank, got in enumerate(run_ranks(_foreach_case, 2)):
        for label in FOREACH_RUNS:
            multi, loop = got[label, True], got[label, False]
            assert multi["told"] and all(multi["told"]) and not any(loop["told"]), (rank, label)
            for name, w in loop["weights"].items():
                assert torch.equal(multi["weights"][name], w), (rank, label, name)
