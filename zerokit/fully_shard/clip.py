r"""Gradient clipping when each rank holds a piece of the gradient (FullyShard, fully_shard).

A rank's shard parameters are disjoint flat pieces of the model's parameters, so the global
norm is a sum over the ranks: $\|g\|_p^p = \sum_r \sum_{i \in r} |g_i|^p$, one all-reduce of one
number ($\max$ for $p = \infty$), as ZeRO1Adam.clip_grad_norm_ does with its reduced shards.
Then every piece is scaled by torch's own rule, $\min(1, c / (\|g\| + 10^{-6}))$.

`torch.nn.utils.clip_grad_norm_(model.parameters(), c)` would compute each rank's own norm
and clip with it, silently. FSDP2 makes it right because its gradients are DTensors, whose norm
is reduced over the ranks. zerokit's are plain tensors of a subclass, `ShardGrad`, whose norms
raise instead (`torch.linalg.vector_norm`, `torch.norm`, `Tensor.norm`, `torch._foreach_norm`,
`torch.linalg.norm`): clip with the model's `clip_grad_norm_`, or reduce the squares yourself.
Every other operation on a ShardGrad is a plain tensor operation (its result a plain tensor),
at the price of one Python call per operation (about 12 to 25 us per parameter in AdamW's step).
"""

import math

import torch
import torch.distributed as dist

__all__ = ["ShardGrad", "clip_sharded_grad_norm_", "sharded_grad_norm"]

_NORMS = frozenset({torch.linalg.vector_norm, torch.linalg.norm, torch.norm, torch.Tensor.norm, torch._foreach_norm})


class ShardGrad(torch.Tensor):
    """The .grad of a shard parameter: this rank's piece of a gradient, whose norm alone would be
    the wrong number for clipping; every other operation is a plain tensor's."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _NORMS:
            raise RuntimeError(
                "this .grad is one rank's piece of a sharded gradient (zerokit.FullyShard / zerokit.fully_shard): "
                "its norm is not the gradient's, and torch.nn.utils.clip_grad_norm_ would clip with this rank's "
                "norm alone. Clip with model.clip_grad_norm_(max_norm) (the norm over every rank), or sum "
                "g.pow(2) over your pieces and all-reduce it")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs) if kwargs else func(*args)


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, ShardGrad) else t


@torch.no_grad()
def sharded_grad_norm(grads, group=None, norm_type=2.0, device=None):
    """The p-norm of a gradient cut into disjoint pieces across the ranks of `group` (a
    collective: every rank calls it), as an fp32 tensor."""
    p = float(norm_type)
    grads = [_plain(g) for g in grads]
    device = device or (grads[0].device if grads else "cpu")
    if math.isinf(p):
        local = max((g.detach().abs().max().float() for g in grads if g.numel()), default=None)
        total = torch.zeros((), device=device) if local is None else local.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += g.detach().float().abs().pow(p).sum() if p != 2 else g.detach().float().pow(2).sum()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.pow(1.0 / p)


@torch.no_grad()
def clip_sharded_grad_norm_(params, max_norm, group=None, norm_type=2.0, error_if_nonfinite=False, device=None):
    """Scale the .grad of `params` (this rank's shard parameters) so that the norm of the whole
    gradient, over every rank of `group`, is at most max_norm; return that norm (before clipping).
    A collective: every rank calls it."""
    grads = [p.grad for p in params if p.grad is not None]
    total = sharded_grad_norm(grads, group, norm_type, device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), "
                           "so it cannot be clipped (error_if_nonfinite=True)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
    for g in grads:
        _plain(g).mul_(coef.to(g.device))
    return total
