"""The zoo's fixture models create the situations their docstrings promise."""

import pytest
import torch

from zerokit.flat import FlatBucket
from zerokit.models import build_model, model_batch, model_loss, num_parameters
from zerokit.zero3 import assign_units, default_units


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sparse_embed_gives_some_rank_a_whole_segment_of_zero_gradient(world_size):
    model = build_model("sparse-embed")
    x, y = model_batch("sparse-embed", 8, seed=3)
    model_loss("sparse-embed", model(x), y).backward()
    params = list(model.parameters())
    assert all(p.grad is not None for p in params)
    zero_segments = 0
    for rank in range(world_size):
        bucket = FlatBucket(params, world_size, rank)
        for s in bucket.segments:
            grad = params[s.index].grad.reshape(-1)[s.param_lo:s.param_hi]
            zero_segments += bool(grad.numel()) and not grad.any()
    assert zero_segments >= 1
    assert num_parameters(model) % world_size != 0


def test_awkward_units_return_a_tuple_and_a_dict_and_the_root_owns_the_tied_weight():
    model = build_model("awkward")
    x, _ = model_batch("awkward", 4, seed=0)
    assert isinstance(model.attn(model.embed(x)), tuple)
    assert isinstance(model.mix(model.embed(x)), dict)
    units = [model] + [m for m in default_units(model) if m is not model]
    owner = assign_units(units)
    assert owner[model.embed.weight] == 0  # the root unit
    assert model.head.weight is model.embed.weight
    assert torch.isfinite(model(x)).all()


def _explicit_block(block, x):
    """zerokit.models.Block with attention written out: softmax(q k^T / sqrt(d_head), causal) v."""
    import math

    from torch.nn import functional as F

    b, t, d = x.shape
    heads = block.n_heads
    q, k, v = block.qkv(block.norm1(x)).split(d, dim=2)
    q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(d // heads)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    x = x + block.proj(y.transpose(1, 2).reshape(b, t, d))
    return x + block.out(F.gelu(block.fc(block.norm2(x))))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_blocks_attention_is_scaled_dot_product_attention_written_out(dtype):
    """TinyTransformer's blocks attend through F.scaled_dot_product_attention(is_causal=True) (flash attention
    on a GPU; the capstone's zerokit.train runs it): the same function as the explicit causal softmax, forward
    and every gradient. In float64 to 1e-12 (the same arithmetic up to rounding); in float32 to torch's own
    float32 tolerances (rtol 1.3e-6, atol 1e-5): the kernel sums in another order (an online softmax), which
    moved the output by 5e-7 and the gradients by 7e-6 on values up to 32 here."""
    from zerokit.models import Block

    torch.manual_seed(0)
    block = Block(48, 4, 4).to(dtype)  # 4 heads of width 12, on a sequence of 37
    x = torch.randn(3, 37, 48, dtype=dtype)
    weights = torch.linspace(-1, 1, x.numel(), dtype=dtype).view_as(x)
    got = []
    for forward in (block, lambda x: _explicit_block(block, x)):
        block.zero_grad()
        inp = x.clone().requires_grad_()
        out = forward(inp)
        (out * weights).sum().backward()
        got.append([out.detach(), inp.grad] + [p.grad for p in block.parameters()])
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1.3e-6, atol=1e-5)
    for name, a, b in zip(["output", "input grad"] + [n for n, _ in block.named_parameters()], *got):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")
