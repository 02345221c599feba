"""Small models the lessons, tests, checks and benchmarks share, and the zoo that names them.

Sizes are awkward on purpose: parameters straddle shard boundaries, and EdgeCaseNet's
total (745) divides by none of 2, 3 and 4, so code that assumes `numel % N == 0` fails on
it. (OddMLP's default total, 2348, needs padding only for N = 3.)

The zoo (`MODELS`) gives each model the checks and tests use one name, and says how to feed
it: `build_model(name, seed)`, `model_batch(name, size, seed)`, `model_loss(name, out, y)`.

    name         model                                   Ψ       what it is for
    mlp          OddMLP (27 -> 37 -> 29 -> 7)            2348    the default: plain layers
    small-mlp    OddMLP (27 -> 36 -> 7)                  1267    quick checks
    wide-mlp     OddMLP (27 -> 300 -> 7)                 10507   memory checks: one shard weighs
    deep-mlp     OddMLP (27 -> 768 -> 768 -> 768 -> 7)   1.2 M   peaks measured whole-process: a layer is
                                                                 a fifth of the model (lesson 07)
    edge         EdgeCaseNet                             745     tied, frozen, unused parameters
    branch       BranchNet                               566     a branch some ranks (lesson 04) or some
                                                                 steps (lesson 05: a unit skipped) leave out
    nested       NestedNet                               6478    nested units for ZeRO-3
    transformer  TinyTransformer (vocab 101, width 22)   16742   attention, embeddings, norms
    sparse-embed SparseEmbedNet                          833     embedding rows no batch looks up: a whole
                                                                 shard's gradient is zeros, not None
    awkward      AwkwardUnitsNet                         991     units returning a tuple and a dict; a
                                                                 tied embedding the root unit owns
    outlier      OutlierMLP (16 -> 64 -> 64 -> 8)        5768    1% of its weights 50x the rest, a target it
                                                                 can learn: where int8 weights need one
                                                                 scale per block, not per tensor (lesson 11)
"""

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["OddMLP", "EdgeCaseNet", "TinyTransformer", "BranchNet", "NestedNet", "SparseEmbedNet",
           "AwkwardUnitsNet", "OutlierMLP", "make_batch", "loss_for",
           "num_parameters", "MODELS", "Recipe", "build_model", "model_batch", "model_loss"]


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


class OutlierMLP(OddMLP):
    """OddMLP (16 -> 64 -> 64 -> 8) in which a fraction of the weights, at random places, are
    `scale` times larger than the rest, as a few weights of a trained language model are
    (Dettmers et al., 2022, LLM.int8()). A quantiser with one scale for a whole tensor rounds the
    small weights to a handful of levels; one scale per block of 64 spoils only the blocks that
    hold an outlier (lesson 11, qwZ)."""

    def __init__(self, sizes=(16, 64, 64, 8), fraction=0.01, scale=50.0):
        super().__init__(sizes)
        g = torch.Generator().manual_seed(1)  # the same places whatever the caller's seed
        with torch.no_grad():
            for layer in self.layers:
                layer.weight[torch.rand(layer.weight.shape, generator=g) < fraction] *= scale


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
    """A deterministic (inputs, targets) batch for a model kind: "mlp", "edge", "transformer", "teacher" or
    "sparse"."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        n_in, n_out = kw.get("n_in", 27), kw.get("n_out", 7)
        x = torch.randn(batch_size, n_in, generator=g)
        return x, torch.randn(batch_size, n_out, generator=g)
    if kind == "edge":
        vocab = kw.get("vocab", 11)
        ids = torch.randint(0, vocab, (batch_size, 5), generator=g)
        return ids, torch.randint(0, vocab, (batch_size, 5), generator=g)
    if kind == "transformer":
        vocab, seq_len = kw.get("vocab", 2003), kw.get("seq_len", 64)
        ids = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]
    if kind == "teacher":  # targets a fixed function of the inputs: a loss the model can bring down
        n_in, n_out = kw.get("n_in", 16), kw.get("n_out", 8)
        x = torch.randn(batch_size, n_in, generator=g)
        w = torch.randn(n_in, n_out, generator=torch.Generator().manual_seed(12345)) / 4
        return x, torch.tanh(x @ w) + 0.5 * torch.sin(x[:, :n_out])
    if kind == "sparse":  # ids only below `used` of a larger vocabulary: the other rows never get a gradient
        ids = torch.randint(0, kw.get("used", 6), (batch_size, 5), generator=g)
        return ids, torch.randint(0, kw.get("n_out", 5), (batch_size,), generator=g)
    raise ValueError(f"unknown batch kind {kind!r}")


def loss_for(kind, output, target):
    if kind in ("mlp", "teacher"):
        return F.mse_loss(output, target)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


class BranchNet(nn.Module):
    """An MLP with a side branch that a caller may skip (data-dependent control flow, as in a
    mixture of experts): where it is skipped, the branch's parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(9, 17)
        self.branch = nn.Linear(17, 17)
        self.out = nn.Linear(17, 5)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.inp(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


class NestedNet(nn.Module):
    """Nested modules: a stem, residual blocks (a LayerNorm and a two-layer MLP inside a
    Sequential, inside the block), and a head. Eleven units of similar size, so a ZeRO-3
    that never frees holds several times what one that frees does."""

    def __init__(self, n_in=13, dim=23, hidden=41, n_blocks=3, n_out=7):
        super().__init__()
        self.stem = nn.Linear(n_in, dim)
        self.blocks = nn.ModuleList(Residual(dim, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(dim, n_out)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Residual(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class SparseEmbedNet(nn.Module):
    """An embedding of 64 rows of which the batches look up only the first 6 (as a large
    vocabulary's rare tokens): the other rows' gradient is exactly zero on every rank, a
    tensor of zeros, not None. The embedding comes first in parameter order and fills most
    of the model, so for N = 2, 3 and 4 some rank's whole segment of it is zero.

    Input: ids (batch, 5) in [0, 6); output: logits (batch, 5 classes)."""

    def __init__(self, vocab=64, dim=12, n_out=5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, n_out)

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids).mean(dim=1)))


class _TupleOut(nn.Module):
    """Returns (output, attention weights), as nn.MultiheadAttention does."""

    def __init__(self, dim):
        super().__init__()
        self.qk = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        return weights @ x, weights


class _DictOut(nn.Module):
    """Returns {"hidden": ..., "gate": ...}, as many library blocks return a dict or dataclass."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, 1)

    def forward(self, x):
        return {"hidden": torch.tanh(self.fc(x)), "gate": torch.sigmoid(self.gate(x))}


class AwkwardUnitsNet(nn.Module):
    """Units whose outputs are not one tensor, and a root unit that owns parameters.

    The embedding and the head share one weight (a language model's tied embedding), so
    under ZeRO-3 the root unit owns it: it must be gathered from the start of forward to
    the end of backward, and be freed at rest (after an eval forward under no_grad too).
    `attn` returns a tuple, `mix` a dict: a hook that expects one tensor breaks on either.

    Input: ids (batch, 5) in [0, 17); output: logits (batch, 5, 17)."""

    def __init__(self, vocab=17, dim=15):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = _TupleOut(dim)
        self.mix = _DictOut(dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        y, _ = self.attn(x)
        out = self.mix(x + y)
        return self.head(self.norm(x + out["hidden"] * out["gate"]))


# ---------------------------------------------------------------------------------------
# the zoo


@dataclass(frozen=True)
class Recipe:
    """A named model: how to build it and how to feed it (`make_batch`'s kind and options).

    first_seed shifts the model's data stream, so two models of one batch kind see
    different data at the same seed.
    """

    build: Callable[[], nn.Module]
    batch: str
    batch_kw: dict = field(default_factory=dict)
    first_seed: int = 0


MODELS = {
    "mlp": Recipe(OddMLP, "mlp"),
    "small-mlp": Recipe(partial(OddMLP, (27, 36, 7)), "mlp"),
    "wide-mlp": Recipe(partial(OddMLP, (27, 300, 7)), "mlp"),
    "deep-mlp": Recipe(partial(OddMLP, (27, 768, 768, 768, 7)), "mlp"),
    "edge": Recipe(EdgeCaseNet, "edge"),
    "branch": Recipe(BranchNet, "mlp", {"n_in": 9, "n_out": 5}, first_seed=7_000),
    "nested": Recipe(NestedNet, "mlp", {"n_in": 13, "n_out": 7}, first_seed=5_000),
    "transformer": Recipe(partial(TinyTransformer, vocab=101, dim=22, n_layers=2, n_heads=2, seq_len=9),
                          "transformer", {"vocab": 101, "seq_len": 9}),
    "sparse-embed": Recipe(SparseEmbedNet, "sparse"),
    "awkward": Recipe(AwkwardUnitsNet, "edge", {"vocab": 17}),
    "outlier": Recipe(OutlierMLP, "teacher", {"n_in": 16, "n_out": 8}),
}


def _recipe(name):
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, not {name!r}")
    return MODELS[name]


def build_model(name, seed=0):
    """The zoo's model `name`, initialised from `seed` (the same weights on every rank)."""
    recipe = _recipe(name)
    torch.manual_seed(seed)
    return recipe.build()


def model_batch(name, batch_size, seed):
    """A deterministic (inputs, targets) batch for the zoo's model `name`."""
    recipe = _recipe(name)
    return make_batch(recipe.batch, batch_size, seed=recipe.first_seed + seed, **recipe.batch_kw)


def model_loss(name, output, target):
    """The loss the zoo's model `name` trains on (mean squared error or cross-entropy)."""
    return loss_for(_recipe(name).batch, output, target)
