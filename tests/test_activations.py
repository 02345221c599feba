"""zerokit.activations and recomputation under ZeRO-3 (lesson 08).

One process: the saved-tensor count against the closed form, exactly, for a transformer
block and the whole TinyTransformer at several batch x sequence sizes; views of one
storage counted once; parameters left out, also where they are views of a flat buffer;
checkpointing keeps only each block's input and changes no gradient.

Two gloo ranks, one launch: ZeRO-3 with checkpointed blocks, for units inside the
checkpointed region (every module that owns parameters, early stop on and off) and for
units that are the blocks themselves, against one process running torch.optim.AdamW after
every step; exactly two all-gathers and one reduce-scatter per bucket per step (the
recomputation costs no communication); no unit full after its gradients are sent; every
parameter empty at rest; the saved activations of a checkpointed block are its input. Lesson
05's hooks, which know nothing of recomputation, gather again (early stop) or crash (no early
stop): the trap is real. A reentrant checkpoint is refused with a message that says why.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import zerokit
from conftest import run_ranks
from zerokit.activations import (SavedActivations, checkpoint_modules, korthikanti_layer_bytes, layer_activation_bytes,
                                 transformer_activation_bytes)
from zerokit.hooks import in_backward
from zerokit.models import Block, TinyTransformer, build_model, make_batch, model_batch, model_loss
from zerokit.reference import rank_slice, reference_trajectory

V, H, L, A, S = 101, 22, 2, 2, 9  # the zoo's "transformer"
STEPS, BATCH, LR, WD = 3, 4, 1e-2, 0.1
TOL = 1e-5


def tiny(seed=0):
    torch.manual_seed(seed)
    return TinyTransformer(vocab=V, dim=H, n_layers=L, n_heads=A, seq_len=S)


# --------------------------------------------------------------------------------------
# counting, one process


@pytest.mark.parametrize("b, s, h, a", [(2, 9, 22, 2), (3, 16, 24, 4), (1, 5, 30, 3)])
def test_block_saves_exactly_the_closed_form(b, s, h, a):
    torch.manual_seed(0)
    block = Block(h, a, 4)
    x = torch.randn(b, s, h, requires_grad=True)  # a layer deep inside a model: its input needs a gradient
    with SavedActivations(block) as acts:
        block(x)
    assert acts.bytes == layer_activation_bytes(b, s, h, a) == 4 * b * s * (16 * h + 4 + a)
    # Korthikanti et al. count the same 16 bsh elements (in 2 bytes) plus dropout masks and the s x s matrix
    assert korthikanti_layer_bytes(b, s, h, a) == s * b * h * 34 + 5 * a * s * s * b


@pytest.mark.parametrize("b, s", [(2, 9), (4, 9), (3, 5)])
def test_transformer_per_block_and_total_as_batch_and_sequence_grow(b, s):
    model = tiny()
    x, y = make_batch("transformer", b, seed=0, vocab=V, seq_len=s)
    layers = {f"blocks.{i}": blk for i, blk in enumerate(model.blocks)}
    with SavedActivations(model, layers) as acts:
        model_loss("transformer", model(x), y)
    want = transformer_activation_bytes(b, s, H, A, L, V)
    assert [acts.per_layer[f"blocks.{i}"] for i in range(L)] == [layer_activation_bytes(b, s, H, A)] * L
    assert acts.bytes == want["total"], (acts.bytes, want)
    assert acts.per_layer["other"] == want["embeddings"] + want["head"] + want["loss"]


def test_views_of_one_storage_count_once_and_parameters_not_at_all():
    x = torch.randn(5, 7, requires_grad=True)
    with SavedActivations() as acts:
        torch.sin(x) * torch.cos(x)  # sin and cos both save x; mul saves both of their outputs
    assert acts.tensors == 4 and acts.bytes == 3 * x.numel() * 4
    qkv = torch.randn(2, 3, 8, 12, requires_grad=True)
    with SavedActivations() as acts:
        q, k, v = qkv.split(4, dim=-1)
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # q, k, v: three views of qkv's storage, counted once; then the output (2, 3, 8, 4) and a
    # logsumexp per row (2, 3, 8), in fp32
    assert acts.bytes == qkv.numel() * 4 + (2 * 3 * 8 * 4) * 4 + (2 * 3 * 8) * 4, acts.bytes
    # a linear layer whose weight is a view of a flat buffer (ZeRO's layout): the weight is model state
    layer = torch.nn.Linear(7, 3)
    flat = torch.cat([layer.weight.detach().reshape(-1), layer.bias.detach()])
    layer.weight.data, layer.bias.data = flat[:21].view(3, 7), flat[21:]
    with SavedActivations(layer) as acts:
        layer(x)
    assert acts.bytes == x.numel() * 4
    assert not in_backward()


def test_checkpointing_keeps_each_block_input_and_changes_no_gradient():
    b, s = 3, 8
    x, y = make_batch("transformer", b, seed=1, vocab=V, seq_len=s)
    grads = []
    for ckpt in (False, True):
        model = tiny()
        if ckpt:
            checkpoint_modules(model.blocks)
        layers = {f"blocks.{i}": blk for i, blk in enumerate(model.blocks)}
        with SavedActivations(model, layers) as acts:
            loss = model_loss("transformer", model(x), y)
        want = 4 * b * s * H if ckpt else layer_activation_bytes(b, s, H, A)
        assert [acts.per_layer[n] for n in layers] == [want] * L
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    with pytest.raises(ValueError, match="checkpointed twice"):
        checkpoint_modules(model.blocks[:1])


# --------------------------------------------------------------------------------------
# ZeRO-3 with recomputation, two ranks


class Lesson05Hooks(zerokit.ZeRO3Adam):
    """ZeRO-3 whose forward hooks know nothing of recomputation: a recomputed forward is
    treated as a forward (gather with forward prefetch; free after)."""

    def _pre_recompute(self, u):
        self.gather_unit(u, prefetch_next=self.next_in_forward(u))

    def _post_recompute(self, u):
        for bi in self.buckets_of_unit[u]:
            self.free(bi)


def _reference():
    return reference_trajectory("transformer", STEPS, BATCH, lr=LR, weight_decay=WD)


def _train(rank, world_size, cls, units, early_stop):
    net = build_model("transformer")
    opt = cls(net, lr=LR, weight_decay=WD, units=list(net.blocks) if units == "blocks" else None)
    checkpoint_modules(net.blocks, early_stop=early_stop)
    buckets = opt.buckets
    worst = {"full_after_sent": [], "full_in_backward": 0}

    def on_grad(_param):  # after the optimizer's own hooks: what has been sent is sent
        full = [bi for bi in range(len(buckets)) if opt.full[bi] is not None or bi in opt.gathering]
        worst["full_in_backward"] = max(worst["full_in_backward"], len(full))
        worst["full_after_sent"] += [bi for bi in full if bi < opt._next]

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(on_grad)
    snaps, traffic, saved = [], [], []
    for step in range(STEPS):
        x, y = model_batch("transformer", BATCH, step)
        x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        with zerokit.CommCounter() as comm:
            with SavedActivations(net, {f"blocks.{i}": blk for i, blk in enumerate(net.blocks)}) as acts:
                loss = model_loss("transformer", net(x), y)
            loss.backward()
        saved.append([acts.per_layer[f"blocks.{i}"] for i in range(L)])
        opt.step()
        opt.zero_grad()
        traffic.append([(c.op, c.numel) for c in comm.calls if c.op != "all_reduce"])
        assert all(p.numel() == 0 for p in net.parameters()), "a parameter is full at rest"
        with opt.gathered():
            snaps.append({n: p.detach().clone() for n, p in net.named_parameters()})
    padded = [b.padded_numel for b in buckets]
    root = [bi for bi, u in enumerate(opt.bucket_units) if u == 0]
    return {"snaps": snaps, "traffic": traffic, "padded": padded, "root": root, "worst": worst, "saved": saved,
            "micro": x.shape}


def _reentrant_refused(rank, world_size, stage):
    """stage 2, 3 or "dp" (zerokit.DataParallel, whose end of backward is ZeRO-2's, hooks.EndOfBackward)."""
    net = build_model("transformer")
    opt = {2: lambda: zerokit.ZeRO2Adam(net.parameters(), lr=LR), 3: lambda: zerokit.ZeRO3Adam(net, lr=LR),
           "dp": lambda: zerokit.DataParallel(net)}[stage]()
    model = opt if stage == "dp" else net
    for block in net.blocks:
        block.forward = lambda h, f=block.forward: checkpoint(f, h, use_reentrant=True)
    x, y = model_batch("transformer", BATCH, 0)
    try:
        model_loss("transformer", model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
    except RuntimeError as exc:
        return str(exc)
    finally:
        del opt, model
    return None


def _all_cases(rank, world_size):
    out = {}
    for name, cls, units, early in (("inner units", zerokit.ZeRO3Adam, None, True),
                                     ("inner units, no early stop", zerokit.ZeRO3Adam, None, False),
                                     ("block units", zerokit.ZeRO3Adam, "blocks", True),
                                     ("lesson 05 hooks", Lesson05Hooks, None, True)):
        out[name] = _train(rank, world_size, cls, units, early)
    try:
        _train(rank, world_size, Lesson05Hooks, None, False)
        out["lesson 05 hooks, no early stop"] = None
    except RuntimeError as exc:
        out["lesson 05 hooks, no early stop"] = str(exc)
    out["reentrant"] = {stage: _reentrant_refused(rank, world_size, stage) for stage in (2, 3, "dp")}
    return out


@pytest.fixture(scope="module")
def zero3_runs():
    return run_ranks(_all_cases, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["inner units", "inner units, no early stop", "block units", "lesson 05 hooks"])
def test_zero3_with_recomputation_matches_adamw(zero3_runs, case):
    ref = _reference()
    for rank, runs in enumerate(zero3_runs):
        for step, (got, want) in enumerate(zip(runs[case]["snaps"], ref)):
            worst = max((got[n] - want[n]).abs().max().item() for n in want)
            assert worst < TOL, f"rank {rank}, {case}, step {step + 1}: {worst:.2e} from AdamW"


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["inner units", "inner units, no early stop", "block units"])
def test_recomputation_costs_no_communication(zero3_runs, case):
    run = zero3_runs[0][case]
    for calls in run["traffic"]:
        gathers = [n for op, n in calls if op == "all_gather"]
        scatters = [n for op, n in calls if op == "reduce_scatter"]
        # every bucket twice (forward, backward), the root's once (it stays gathered through backward)
        want = sorted(n for bi, n in enumerate(run["padded"]) for _ in range(1 if bi in run["root"] else 2))
        assert sorted(gathers) == want, case
        assert sorted(scatters) == sorted(run["padded"]), f"{case}: one reduce-scatter per bucket"


@pytest.mark.distributed
def test_recomputed_units_are_freed_once_sent_and_the_block_keeps_only_its_input(zero3_runs):
    for case in ("inner units", "inner units, no early stop", "block units"):
        run = zero3_runs[0][case]
        assert run["worst"]["full_after_sent"] == [], case
        b, s = run["micro"]
        assert run["saved"] == [[4 * b * s * H] * L] * STEPS, case
    # one block's six units at most, and one prefetched beside them
    assert zero3_runs[0]["inner units"]["worst"]["full_in_backward"] <= 7


@pytest.mark.distributed
def test_lesson05_hooks_gather_again_or_crash_under_recomputation(zero3_runs):
    run = zero3_runs[0]["lesson 05 hooks"]
    gathers = sum(op == "all_gather" for op, _ in run["traffic"][-1])
    assert gathers > 2 * len(run["padded"]), "lesson 05's hooks should re-gather the recomputed units"
    assert "storage" in zero3_runs[0]["lesson 05 hooks, no early stop"], zero3_runs[0]["lesson 05 hooks, no early stop"]


@pytest.mark.distributed
def test_a_reentrant_checkpoint_is_refused_with_the_reason(zero3_runs):
    for stage, who in ((2, "ZeRO-2/3"), (3, "ZeRO-2/3"), ("dp", "zerokit.DataParallel")):
        message = zero3_runs[0]["reentrant"][stage]
        assert message is not None and "use_reentrant=False" in message and who in message, (stage, message)
