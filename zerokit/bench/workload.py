"""The workload every configuration shares: one model, one data stream, one update rule.

Every rank builds each model fresh from the same seed and trains it on the same global
batches, rank r taking its slice of each, so that all configurations compute AdamW on the
mean gradient of the same data and must end at the same loss.
"""

import torch

from zerokit.models import TinyTransformer, loss_for, make_batch

# TinyTransformer sizes: widths not divisible by 4 (shards are never assumed even).
MODELS = {
    "tiny": dict(vocab=101, dim=22, n_layers=2, n_heads=2, seq_len=9, mlp_ratio=3, batch=2),
    "small": dict(vocab=2003, dim=222, n_layers=4, n_heads=6, seq_len=64, mlp_ratio=3, batch=4),
    "medium": dict(vocab=8191, dim=510, n_layers=6, n_heads=6, seq_len=128, mlp_ratio=3, batch=4),
    "large": dict(vocab=16381, dim=1022, n_layers=8, n_heads=14, seq_len=256, mlp_ratio=3, batch=4),
}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def model_kwargs(model_cfg):
    return {k: v for k, v in model_cfg.items() if k != "batch"}


def make_model(model_cfg, device, seed):
    """The preset's model, with the same initial weights on every rank (the same seed)."""
    torch.manual_seed(seed)
    return TinyTransformer(**model_kwargs(model_cfg)).to(device)


def rank_batch(model_cfg, step, rank, world_size, device):
    """This rank's slice of global batch number `step` (the same stream for every config)."""
    micro = model_cfg["batch"]
    x, y = make_batch("transformer", micro * world_size, seed=1000 + step,
                      vocab=model_cfg["vocab"], seq_len=model_cfg["seq_len"])
    sl = slice(rank * micro, (rank + 1) * micro)
    return x[sl].to(device), y[sl].to(device)


def eval_batch(model_cfg, device):
    x, y = make_batch("transformer", 2 * model_cfg["batch"], seed=999_999,
                      vocab=model_cfg["vocab"], seq_len=model_cfg["seq_len"])
    return x.to(device), y.to(device)


def train_step(model, opt, x, y):
    loss = loss_for("transformer", model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()
