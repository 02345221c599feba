"""The workload every configuration shares: one model, one data stream, one update rule.

Every rank builds each model fresh from the same seed and trains it on the same global
batches, rank r taking its slice of each, so that all configurations compute AdamW on the
mean gradient of the same data and must end at the same loss.
"""

import torch
from torch import nn

from zerokit.models import TinyTransformer, loss_for, make_batch

# TinyTransformer sizes: widths not divisible by 4 (shards are never assumed even). "mlp": a plain
# MLP of a few million parameters (no attention, no embedding), the other shape ZeRO-1 is timed on.
MODELS = {
    "mlp": dict(kind="mlp", sizes=(511, 1021, 1021, 1021, 1021, 127), batch=64),
    "tiny": dict(vocab=101, dim=22, n_layers=2, n_heads=2, seq_len=9, mlp_ratio=3, batch=2),
    "small": dict(vocab=2003, dim=222, n_layers=4, n_heads=6, seq_len=64, mlp_ratio=3, batch=4),
    "medium": dict(vocab=8191, dim=510, n_layers=6, n_heads=6, seq_len=128, mlp_ratio=3, batch=4),
    "large": dict(vocab=16381, dim=1022, n_layers=8, n_heads=14, seq_len=256, mlp_ratio=3, batch=4),
}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class MLP(nn.Module):
    """Linear + tanh blocks and a linear head: `blocks` gives the wrappers their units, as
    TinyTransformer's do."""

    def __init__(self, sizes):
        super().__init__()
        pairs = zip(sizes[:-2], sizes[1:-1])
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in pairs)
        self.head = nn.Linear(sizes[-2], sizes[-1])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def kind(model_cfg):
    return model_cfg.get("kind", "transformer")


def model_kwargs(model_cfg):
    return {k: v for k, v in model_cfg.items() if k not in ("batch", "kind")}


def make_model(model_cfg, device, seed):
    """The preset's model, with the same initial weights on every rank (the same seed)."""
    torch.manual_seed(seed)
    if kind(model_cfg) == "mlp":
        return MLP(model_cfg["sizes"]).to(device)
    return TinyTransformer(**model_kwargs(model_cfg)).to(device)


def loss_of(model_cfg, output, target):
    return loss_for(kind(model_cfg), output, target)


def _batch(model_cfg, size, seed):
    if kind(model_cfg) == "mlp":
        return make_batch("mlp", size, seed=seed, n_in=model_cfg["sizes"][0], n_out=model_cfg["sizes"][-1])
    return make_batch("transformer", size, seed=seed, vocab=model_cfg["vocab"], seq_len=model_cfg["seq_len"])


def rank_batch(model_cfg, step, rank, world_size, device):
    """This rank's slice of global batch number `step` (the same stream for every config)."""
    micro = model_cfg["batch"]
    x, y = _batch(model_cfg, micro * world_size, 1000 + step)
    sl = slice(rank * micro, (rank + 1) * micro)
    return x[sl].to(device), y[sl].to(device)


def eval_batch(model_cfg, device):
    x, y = _batch(model_cfg, 2 * model_cfg["batch"], 999_999)
    return x.to(device), y.to(device)


def describe(model_cfg, name, parameters):
    """The model in one line, for the table."""
    if kind(model_cfg) == "mlp":
        widths = "-".join(map(str, model_cfg["sizes"]))
        per_rank = model_cfg["batch"]
        return f"MLP '{name}': {parameters / 1e6:.2f} M parameters (widths {widths}), {per_rank} samples per rank"
    return (f"TinyTransformer '{name}': {parameters / 1e6:.2f} M parameters (dim {model_cfg['dim']}, "
            f"{model_cfg['n_layers']} layers, vocab {model_cfg['vocab']}), {model_cfg['batch']} x "
            f"{model_cfg['seq_len']} tokens per rank")


def train_step(model, opt, x, y, model_cfg=None):
    loss = loss_for(kind(model_cfg or {}), model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def accumulate_step(model, opt, x, y, model_cfg=None, micro=2):
    """train_step's gradient in `micro` equal slices of the rank's batch, all but the last with
    gradient sync off (model.set_requires_gradient_sync: FSDP2 and zerokit.FullyShard): the
    mean of the slices' mean losses is the batch's, so the loss matches the other rows."""
    xs, ys = x.chunk(micro), y.chunk(micro)
    losses = []
    for k, (xk, yk) in enumerate(zip(xs, ys)):
        model.set_requires_gradient_sync(k == micro - 1)
        loss = loss_for(kind(model_cfg or {}), model(xk), yk)
        (loss / micro).backward()
        losses.append(loss.detach())
    opt.step()
    opt.zero_grad(set_to_none=True)
    return sum(losses) / micro
