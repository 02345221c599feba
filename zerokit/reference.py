"""The yardstick for every stage: one process, torch.optim.AdamW, the whole batch.

On N ranks, each with its own micro-batch of the same global batch, every optimizer in
this course must produce the same parameters, step after step, as this single process.
`reference_trajectory` computes that; `rank_trajectory` runs a candidate optimizer on one
rank (call it inside zerokit.launch) and records the same snapshots for comparison.
"""

import torch

from .models import build_model, model_batch, model_loss

__all__ = ["build_model", "global_batch", "rank_slice", "reference_trajectory", "rank_trajectory", "max_abs_diff"]


def global_batch(kind, step, global_batch_size, seed=0):
    """The global batch of `step` for the zoo's model `kind` (zerokit.models.MODELS)."""
    return model_batch(kind, global_batch_size, 10_000 * seed + step)


def rank_slice(t, rank, world_size):
    """This rank's equal share of a global batch (rows rank*m .. (rank+1)*m - 1)."""
    micro = t.shape[0] // world_size
    if micro * world_size != t.shape[0]:
        raise ValueError(f"a batch of {t.shape[0]} does not split into {world_size} equal micro-batches")
    return t[rank * micro:(rank + 1) * micro]


def _snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def reference_trajectory(kind="mlp", steps=5, global_batch_size=12, lr=1e-2, weight_decay=0.0,
                         betas=(0.9, 0.999), eps=1e-8, seed=0):
    """Parameters after each of `steps` AdamW steps on the full batch: a list of {name: tensor}."""
    model = build_model(kind, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    out = []
    for step in range(steps):
        x, y = global_batch(kind, step, global_batch_size, seed)
        loss = model_loss(kind, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(_snapshot(model))
    return out


def rank_trajectory(rank, world_size, make_optimizer, kind="mlp", steps=5, global_batch_size=12, seed=0,
                    snapshot=None, after_step=None):
    """Train on this rank's slice of each global batch with `make_optimizer(model)`.

    Returns the parameters after each step ({name: tensor}); `snapshot(model, opt)` may
    replace how they are read (ZeRO-3 must gather them first). The model is built with
    the same seed on every rank and the optimizer must make the replicas agree.
    `after_step(step, model, opt)` runs after each step (for measurements).
    """
    if global_batch_size % world_size:
        raise ValueError(f"global batch {global_batch_size} does not split over {world_size} ranks")
    model = build_model(kind, seed)
    opt = make_optimizer(model)
    out = []
    for step in range(steps):
        x, y = global_batch(kind, step, global_batch_size, seed)
        x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        loss = model_loss(kind, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(snapshot(model, opt) if snapshot else _snapshot(model))
        if after_step:
            after_step(step, model, opt)
    return out


def max_abs_diff(a, b):
    """Largest |a - b| over all parameters of two snapshots."""
    return max((a[k] - b[k]).abs().max().item() for k in a)
