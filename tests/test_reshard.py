"""zerokit.zeropp.ZeROppAdam's reshard_after_forward: lesson 05's ZeRO3Adam with FSDP2's
reshard_after_forward on its flat buckets (k: lesson 11's hpZ).

Each setting is measured on real ranks by zerokit.memory.census and zerokit.CommCounter and held
to the table of zeropp.py's docstring, on 4 ranks laid out as 2 "nodes" of 2: the parameter bytes held
between forward and backward, backward's all-gather bytes, and how many of them cross a node.
The formulas are taken over the units' padded flat buckets (FlatBucket's layout: a unit's
elements end to end, padded so that N equal shards cut it), which are checked to hold the
model's Ψ and padding only. Every setting computes what ZeRO3Adam computes (the same gathered
weights, the same reduced gradients), so each is bitwise ZeRO3Adam's training.

zerokit.fully_shard's own reshard_after_forward (per parameter, FSDP2's design) is measured in
test_fully_shard_controls.py.
"""

import pytest
import torch

import zerokit
from conftest import padding_bound, run_ranks
from test_fully_shard_controls import NODE, loss_of, uneven
from zerokit.zeropp import ZeROppAdam
from zerokit.memory import census

SETTINGS = (True, False, None, NODE)


def _reshard_case(rank, world_size):
    out = {}
    for setting in SETTINGS:
        model = uneven()
        opt = ZeROppAdam(model, lr=1e-2, reshard_after_forward=setting)
        padded = [b.padded_numel for b in opt.buckets]
        root = [b.padded_numel for b, u in zip(opt.buckets, opt.bucket_units) if u == 0]
        losses, steps = [], []
        for step in range(3):
            with zerokit.CommCounter() as fwd:
                loss = loss_of(model, rank, step)
            held = census(model, opt, scan=False)["parameters"]
            with zerokit.CommCounter() as bwd:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            steps.append({"held": held, "fwd_ag": fwd.node_split(NODE, "all_gather"),
                          "bwd_ag": bwd.node_split(NODE, "all_gather"),
                          "bwd_rs": bwd.node_split(NODE, "reduce_scatter"), "bwd_ag_calls": bwd.count("all_gather")})
        with opt.gathered():
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[setting] = {"padded": padded, "root": sum(root), "losses": losses, "steps": steps, "weights": weights}
    model = uneven()
    opt = zerokit.ZeRO3Adam(model, lr=1e-2)  # lesson 05's class, Adam as in the others (weight_decay 0)
    losses = []
    for step in range(3):
        loss = loss_of(model, rank, step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with opt.gathered():
        out["zero3"] = {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def _refused(rank, world_size):
    said = []
    for bad in (3, 0, "2", 2.0):
        with pytest.raises((ValueError, TypeError)) as info:
            ZeROppAdam(uneven(), reshard_after_forward=bad)
        said.append(str(info.value))
    return said


def _cases(rank, world_size):
    return {"reshard": _reshard_case(rank, world_size), "refused": _refused(rank, world_size)}


@pytest.fixture(scope="module")
def four_ranks():
    """Both cases on 4 ranks, in one launch."""
    return run_ranks(_cases, 4)


@pytest.mark.distributed
def test_reshard_after_forward_memory_and_traffic_against_the_formula(four_ranks):
    n = 4
    psi = sum(p.numel() for p in uneven().parameters())
    n_params = sum(1 for _ in uneven().parameters())
    for rank, got in enumerate(r["reshard"] for r in four_ranks):
        padded = got[True]["padded"]
        total = sum(padded)
        assert psi <= total < psi + padding_bound(n_params, len(padded), n)  # the model, and padding only
        shard_bytes = 4 * total // n
        # what each setting holds between forward and backward beyond the shards (fp32: 4 bytes)
        beyond = {True: 0, False: 4 * total, None: 4 * got[True]["root"], NODE: 4 * total // NODE}
        # backward's all-gather volume: every unit again (True), all but the root (None), none (False),
        # every unit from its secondary shards inside the node (hpZ)
        regathered = {True: total, False: 0, None: total - got[True]["root"], NODE: total}
        for setting in SETTINGS:
            for step, s in enumerate(got[setting]["steps"]):
                where = f"rank {rank}, reshard_after_forward={setting}, step {step}"
                assert s["held"] == shard_bytes + beyond[setting], (where, s["held"], shard_bytes, beyond[setting])
                assert s["fwd_ag"] == {"intra": 0, "inter": 4 * total}, where  # forward: over all 4 ranks
                assert s["bwd_rs"] == {"intra": 0, "inter": 4 * total}, where  # the gradients: over all 4 ranks
                if setting == NODE:  # hpZ: backward's gathers never leave the node
                    assert s["bwd_ag"] == {"intra": 4 * total, "inter": 0}, where
                else:
                    assert s["bwd_ag"] == {"intra": 0, "inter": 4 * regathered[setting]}, where
                if setting is False:
                    assert s["bwd_ag_calls"] == 0, where
        for setting in SETTINGS:  # the same arithmetic as ZeRO3Adam: bitwise the same training
            assert got[setting]["losses"] == got["zero3"]["losses"], setting
            for name, w in got["zero3"]["weights"].items():
                assert torch.equal(got[setting]["weights"][name], w), (setting, name)
    print(f"Psi = {psi}, N = 4 as 2 x 2: parameter bytes held after forward (rank 0): "
          + ", ".join(f"{c}: {got[c]['steps'][0]['held']}" for c in SETTINGS))


@pytest.mark.distributed
def test_a_node_size_that_does_not_divide_the_ranks_is_refused(four_ranks):
    said = four_ranks[0]["refused"]
    assert len(said) == 4, said
    assert "must divide the 4 ranks" in said[0] and "must divide the 4 ranks" in said[1]
    assert "must be True, False, None or an int" in said[2] and "must be True, False, None or an int" in said[3]


def _foreach_case(rank, world_size, steps=3):
    out = {}
    for foreach in (True, False):
        model = uneven()
        opt = ZeROppAdam(model, lr=1e-2, reshard_after_forward=False, foreach=foreach)
        for step in range(steps):
            loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
        with opt.gathered():
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[foreach] = {"told": [s.foreach for s in opt.shards], "weights": weights}
    return out


@pytest.mark.distributed
def test_foreach_reaches_every_shard_and_true_and_false_train_bit_for_bit_alike():
    """foreach= as ZeRO3Adam takes it: each shard updates with the multi-tensor Adam (True) or
    lesson 01's loop (False), which on a CPU are the same arithmetic, bit for bit."""
    for rank, got in enumerate(run_ranks(_foreach_case, 2)):
        multi, loop = got[True], got[False]
        assert multi["told"] and all(multi["told"]) and not any(loop["told"]), rank
        for name, w in loop["weights"].items():
            assert torch.equal(multi["weights"][name], w), (rank, name)
