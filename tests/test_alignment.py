"""Every pointer zerokit's flat buffers hand to a kernel starts on 16 bytes (zerokit.flat).

GPU kernels take other code paths on a misaligned pointer (vectorised loads want 16 bytes),
and some refuse one; production flat buffers pad each parameter (FSDP1 and DeepSpeed to 16
bytes, Megatron to 128). On a model of odd sizes (an embedding of 211 x 96, a hidden size of
381, a LayerNorm, a frozen layer; sizes that end off 8 elements: 381, 211, 4,953, 13),
on N = 2 and 3 gloo ranks, in fp32 and under bf16 mixed precision, two training steps of each
class, and every pointer seen, `data_ptr() % 16 == 0`:

| class | what is seen |
|---|---|
| DataParallel | the views of each bucket's flat copy (what .grad is copied into and out of) |
| ZeRO1Adam, ZeRO2Adam | the parameters (views of the flat buffer), ZeRO-1's .grad (views of its gradient buffer), the shards (weights, fp32 master, m, v, reduced gradients) and every slice Adam steps (zerokit.zero1.adamw_update_'s four tensors) |
| ZeRO3Adam | the same shards and Adam's slices, and every parameter when a gather installs it |
| ZeRO1(AdamW), ZeRO2(AdamW) | the parameters, and the segment Parameters the local torch.optim.AdamW steps with their gradients |

Not zerokit.FullyShard: it has no flat buffer. It is FSDP2's per-parameter layout (lesson 12), in
which each parameter's shard, its gathered copy and its optimizer state are allocations of their
own, but each gradient shard is a view into its group's reduce-scatter output, at the sum of the
padded sizes before it (the chunk-cat), which nothing rounds to 16 bytes. torch's fully_shard lays
them out the same way: on this model at N = 3, one gradient shard of the 11 is off 16 bytes in both
(side.bias, after side.weight's 5 x 381 floats), and every parameter shard is aligned.

The spies record pointers only; the numbers are other tests' business. One launch per N runs
every class. A control builds ZeRO1Adam inside zerokit.flat.aligned(1), lesson 03's layout, and
must see misaligned pointers: the check can tell.
"""

import pytest
import torch
from torch import nn

import zerokit
import zerokit.zero1
from conftest import run_ranks
from zerokit.flat import aligned
from zerokit.models import make_batch

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

ALIGN = 16  # bytes: what every pointer must be a multiple of
VOCAB, DIM, HIDDEN = 211, 96, 381
CLASSES = ("DataParallel", "ZeRO1Adam", "ZeRO2Adam", "ZeRO3Adam", "ZeRO1", "ZeRO2")
PRECISIONS = ("fp32", "bf16")


class OddShapes(nn.Module):
    """The issue's model of odd sizes: token ids (batch, 5) in [0, 211) -> logits (batch, 5, 211)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)  # 20,256 elements: the one multiple of 8
        self.up = nn.Linear(DIM, HIDDEN)  # 36,576 and 381
        self.down = nn.Linear(HIDDEN, DIM)  # 36,576 and 96
        self.side = nn.Linear(HIDDEN, 13)  # 4,953 and 13: a unit whose second parameter starts unaligned unpadded
        self.norm = nn.LayerNorm(DIM)
        self.frozen = nn.Linear(DIM, 7)  # 672 and 7, left alone
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB)  # 20,256 and 211

    def forward(self, ids):
        x = self.embed(ids)
        hidden = torch.nn.functional.gelu(self.up(x))
        x = self.norm(x + self.down(hidden))
        return self.head(x + self.frozen(x).sum(-1, keepdim=True)) + self.side(hidden).sum(-1, keepdim=True)


class Seen:
    """(where, data_ptr) of every pointer a spy saw."""

    def __init__(self):
        self.pointers = []

    def add(self, where, *tensors):
        self.pointers += [(where, t.data_ptr()) for t in tensors if t is not None and t.numel()]


class RecordingAdamW(torch.optim.AdamW):
    """torch's AdamW (one tensor at a time) that notes each parameter it steps and its gradient."""

    seen = None

    def __init__(self, params, **kw):
        super().__init__(params, foreach=False, **kw)

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    RecordingAdamW.seen.add("a parameter AdamW steps, and its gradient", p, p.grad)
        return super().step(closure)


def _spy_gathers(opt, seen):
    """ZeRO-3: note every parameter a gather installs (forward, backward, prefetch)."""
    finish = opt.finish_gather

    def spied(bi):
        finish(bi)
        seen.add("a gathered parameter", *opt.buckets[bi].params)

    opt.finish_gather = spied


def _spy_bucket_views(buckets, seen):
    """DataParallel: note the views of each flat copy (its _send and _receive take them)."""
    for b in buckets:
        views = b.views

        def spied(flat, views=views):
            out = views(flat)
            seen.add("a view of a bucket's flat copy", *out)
            return out

        b.views = spied


def _shards(opt, seen):
    """ZeRO1/2/3Adam and the wrappers: this rank's shards of the weights, master, m, v, gradients."""
    for i, b in enumerate(opt.buckets):
        flat = opt.flat_params[i]
        seen.add("a shard of the weights", flat if flat.numel() == b.shard_numel else b.shard(flat))
        seen.add("a shard of the state", *(t for t in opt.shards[i].tensors() if isinstance(t, torch.Tensor)))
    for g in getattr(opt, "grad_shards", None) or []:
        seen.add("a shard of the reduced gradient", g)


def _build(name, model, precision):
    """(the object to call forward on, the optimizer)."""
    mixed = zerokit.MixedPrecision("bf16") if precision == "bf16" else None
    trainable = model.parameters()  # the frozen layer too: the optimizer casts it to 16 bits, and leaves it be
    if name == "DataParallel":
        if precision == "bf16":
            model = model.bfloat16()
        return zerokit.DataParallel(model, bucket_mb=0.1), RecordingAdamW(model.parameters(), lr=1e-3)
    if name == "ZeRO1Adam":
        return model, zerokit.ZeRO1Adam(trainable, lr=1e-3, precision=mixed)
    if name == "ZeRO2Adam":
        return model, zerokit.ZeRO2Adam(trainable, lr=1e-3, precision=mixed, bucket_mb=0.1)
    if name == "ZeRO3Adam":
        return model, zerokit.ZeRO3Adam(model, lr=1e-3, precision=mixed)
    if name == "ZeRO1":
        return model, zerokit.ZeRO1(trainable, RecordingAdamW, lr=1e-3, precision=mixed)
    return model, zerokit.ZeRO2(trainable, RecordingAdamW, lr=1e-3, precision=mixed, bucket_mb=0.1)


def _train(name, precision, rank, seen):
    torch.manual_seed(0)
    model = OddShapes()
    net, opt = _build(name, model, precision)
    sharding = opt if name.startswith("ZeRO") else None
    if isinstance(sharding, zerokit.ZeRO3Adam):
        _spy_gathers(sharding, seen)
    if name == "DataParallel":
        _spy_bucket_views(net.buckets, seen)
    if name in ("ZeRO1Adam", "ZeRO2Adam", "ZeRO1", "ZeRO2"):
        seen.add("a parameter (a view of the flat buffer)", *(p for p in model.parameters() if p.requires_grad))
    for step in range(2):
        ids, targets = make_batch("edge", 4, seed=10 * step + rank, vocab=VOCAB)
        logits = net(ids)
        nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)).backward()
        if name == "ZeRO1Adam":
            seen.add("a gradient (a view of the flat gradient buffer)", *(p.grad for p in model.parameters()))
        if sharding is not None:
            _shards(sharding, seen)
        opt.step()
        opt.zero_grad()
    return len(opt.buckets if sharding is None and hasattr(opt, "buckets") else
               getattr(sharding, "buckets", getattr(net, "buckets", [])))


def _worker(rank, world_size):
    adam = zerokit.zero1.adamw_update_
    out = {}
    for precision in PRECISIONS:
        for name in CLASSES:
            seen = Seen()
            RecordingAdamW.seen = seen

            def spied(param, grad, exp_avg, exp_avg_sq, step, **kw):
                seen.add("a slice Adam steps (weights, gradient, m, v)", param, grad, exp_avg, exp_avg_sq)
                return adam(param, grad, exp_avg, exp_avg_sq, step, **kw)

            zerokit.zero1.adamw_update_ = spied
            try:
                buckets = _train(name, precision, rank, seen)
            finally:
                zerokit.zero1.adamw_update_ = adam
            out[name, precision] = {"buckets": buckets, "seen": seen.pointers}
    # the control: lesson 03's layout, end to end, must show misaligned pointers to this check
    seen = Seen()
    with aligned(1):
        _train("ZeRO1Adam", "bf16", rank, seen)
    out["control"] = seen.pointers
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_pointer_of_the_flat_buffers_is_16_byte_aligned(world_size):
    for rank, out in enumerate(run_ranks(_worker, world_size)):
        for name in CLASSES:
            for precision in PRECISIONS:
                got = out[name, precision]
                label = f"{name} {precision}, N = {world_size}, rank {rank}"
                kinds = {where for where, _ in got["seen"]}
                assert len(got["seen"]) >= 12 and len(kinds) >= 2, (label, kinds)  # the spies saw something
                off = [(where, ptr % ALIGN) for where, ptr in got["seen"] if ptr % ALIGN]
                assert not off, f"{label}: {len(off)} of {len(got['seen'])} pointers misaligned, e.g. {off[:3]}"
                assert got["buckets"] >= 1, label
        control = [ptr % ALIGN for _, ptr in out["control"]]
        assert any(control), "lesson 03's layout showed no misaligned pointer: the check could not tell"
