"""Small models the lessons, tests and benchmarks share.

Sizes are awkward on purpose: parameters straddle shard boundaries, and EdgeCaseNet's
total (745) divides by none of 2, 3 and 4, so code that assumes `numel % N == 0` fails on
it. (OddMLP's default total, 2348, needs padding only for N = 3.)
"""

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["OddMLP", "EdgeCaseNet", "TinyTransformer", "make_batch", "loss_for", "num_parameters"]


def num_parameters(model, trainable_only=True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


class OddMLP(nn.Module):
    """A multi-layer perceptron with awkward layer sizes (default: 27 -> 37 -> 29 -> 7)."""

    def __init__(self, sizes=(27, 37, 29, 7)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


class EdgeCaseNet(nn.Module):
    """Every awkward case at once: a tied weight, a frozen parameter, an unused parameter,
    a buffer, a nested module, and sizes not divisible by 2, 3 or 4.

    Input: token ids (batch, 5) in [0, 11); output: logits (batch, 5, 11).
    """

    def __init__(self, vocab=11, dim=13):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 19), nn.GELU(), nn.Linear(19, dim))
        self.norm = nn.LayerNorm(dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(dim, 3, bias=False)  # never called: its gradient is always None
        self.head = nn.Linear(dim, vocab, bias=True)
        self.head.weight = self.embed.weight  # tied: one parameter, used twice
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.block(x) * self.scale
        x = self.norm(x + self.frozen(x))
        return self.head(x)


class TinyTransformer(nn.Module):
    """A decoder-only transformer (GPT-style, pre-norm) for the benchmarks and demos.

    Defaults give about 2.7 M parameters with a model width (198) not divisible by 4.
    """

    def __init__(self, vocab=2003, dim=198, n_layers=4, n_heads=6, seq_len=64, mlp_ratio=4):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, mlp_ratio) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, mlp_ratio):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        # no bias: a key bias only shifts every score in a row equally, so its true gradient
        # is zero and Adam would amplify rounding noise in it into full-size steps
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.out = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


def make_batch(kind, batch_size, seed, **kw):
    """A deterministic (inputs, targets) batch for a model kind: "mlp", "edge" or "transformer"."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        n_in, n_out = kw.get("n_in", 27), kw.get("n_out", 7)
        x = torch.randn(batch_size, n_in, generator=g)
        return x, torch.randn(batch_size, n_out, generator=g)
    if kind == "edge":
        ids = torch.randint(0, 11, (batch_size, 5), generator=g)
        return ids, torch.randint(0, 11, (batch_size, 5), generator=g)
    if kind == "transformer":
        vocab, seq_len = kw.get("vocab", 2003), kw.get("seq_len", 64)
        ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]
    raise ValueError(f"unknown batch kind {kind!r}")


def loss_for(kind, output, target):
    if kind == "mlp":
        return F.mse_loss(output, target)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
