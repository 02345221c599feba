r"""Muon on ZeRO-1: an optimizer that does not shard for free (lesson 09).

Adam's update of an element reads only that element's state, so ZeRO can cut a flat buffer
anywhere, even through a matrix, and each rank updates its slice alone. Muon cannot:

$$B_t = \mu B_{t-1} + g_t,\qquad O_t = \mathrm{NS}_k(g_t + \mu B_t),\qquad
\theta_t = \theta_{t-1}(1 - \gamma\lambda) - \gamma\sqrt{\max(1, m/n)}\; O_t$$

$\mathrm{NS}_k$ (k Newton-Schulz iterations) pushes every singular value of the whole $m \times n$
update towards 1: orthogonalising two halves of a matrix separately is not orthogonalising the
matrix. So here each 2-D parameter has an *owner*, one rank that holds its momentum and
runs its update on the whole matrix:

1. the mean gradient of each matrix goes to its owner only (a `reduce`, $\Psi$ in the paper's count);
2. the owner updates the matrix (momentum, Newton-Schulz, decay, step);
3. the owner sends the new matrix to every rank (a `broadcast`, $\Psi$ again).

$2\Psi$, as ZeRO-1 AdamW, and the momentum ($4\Psi$ bytes in fp32) is divided among the
ranks by matrix, not by element. One Newton-Schulz iteration on a wide $m \times n$ matrix
($m \le n$) costs $2m^2n + m^3$ multiply-adds, so owners are chosen to balance that cost
(`assign_owners`), not the element count.

Only 2-D parameters, as `torch.optim.Muon`: biases, norms and (as torch's documentation
advises) embeddings and the output head go to an elementwise optimizer on flat shards, e.g.
`zerokit.ZeRO1Adam`, beside this one, as `torch.optim.Muon` is paired with `AdamW`.
The owner runs torch's own operations in torch's order (`muon_update_`), so two ranks that
see the same batch end bit for bit where one process running `torch.optim.Muon` does.
"""

import math

import torch
import torch.distributed as dist

from .ddp import broadcast_parameters
from .flat import FlatBucket

__all__ = ["ZeRO1Muon", "muon_update_", "newton_schulz", "newton_schulz_cost", "assign_owners",
           "straddling_matrices"]

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)


def newton_schulz(update, coefficients=NS_COEFFICIENTS, steps=5, eps=1e-7):
    """Approximately orthogonalise a matrix: the same singular vectors, singular values near 1.

    In bfloat16, on the wide orientation (rows <= columns), after scaling to Frobenius norm 1
    so that every singular value starts at most 1: torch.optim.Muon's arithmetic, op for op."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·G + c·G²
        x = torch.addmm(x, poly, x, beta=a)  # a·X + (b·G + c·G²)·X
    return x.T if tall else x


def _lr_ratio(shape, adjust_lr_fn):
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))  # the update's RMS, equal for tall and wide matrices
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))  # Moonlight: AdamW's update RMS, so its lr carries over
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', not {adjust_lr_fn!r}")


@torch.no_grad()
def muon_update_(param, grad, momentum_buffer, *, lr, weight_decay, momentum, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None):
    """One Muon step of one whole matrix, in place (param and momentum_buffer)."""
    momentum_buffer.lerp_(grad, 1 - momentum)  # μB + (1 - μ)g: torch's form of the momentum
    update = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    update = newton_schulz(update, ns_coefficients, ns_steps, eps)
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr * _lr_ratio(param.shape, adjust_lr_fn))


def newton_schulz_cost(shape):
    """Multiply-adds of one Newton-Schulz iteration on a matrix of `shape`: with m ≤ n its two
    sides (the iteration runs on the wide orientation), A = X Xᵀ costs m²n, A² costs m³ and
    (bA + cA²) X costs m²n: 2m²n + m³. (The m·n of the scalings is left out.) For a thin matrix
    that is about 2m²n; for a square one 3m³: per element, a square matrix costs 1.5 times what
    m·n·min(m, n) says, which matters when thin and square matrices share the owners."""
    m, n = sorted(shape[:2])
    return 2 * m * m * n + m ** 3


def assign_owners(shapes, world_size):
    """The owner rank of each matrix, balancing Newton-Schulz cost: the costliest matrix first,
    each to the rank with the least work so far (ties: the lowest rank). Every rank computes
    the same answer from the same shapes, so no communication is needed to agree on it."""
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-newton_schulz_cost(shapes[i]), i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += newton_schulz_cost(shapes[i])
    return owners


def straddling_matrices(params, world_size):
    """How many 2-D parameters a flat shard boundary cuts (ZeRO-1/2's layout, FlatBucket)."""
    params = list(params)
    pieces = [0] * len(params)  # how many ranks hold a piece of each parameter
    for rank in range(world_size):
        for s in FlatBucket(params, world_size, rank).segments:
            pieces[s.index] += 1
    return sum(1 for p, n in zip(params, pieces) if p.dim() == 2 and n > 1)


class ZeRO1Muon(torch.optim.Optimizer):
    """torch.optim.Muon with each matrix owned whole by one rank of a process group.

    Same arguments as torch.optim.Muon, plus `group`. Parameters are broadcast from the
    group's first rank at construction; every parameter must be 2-D. `self.state[p]` (the
    momentum) exists on p's owner only, so state_dict() is this rank's part. step() reduces
    the gradients in place: afterwards a .grad holds the mean on its matrix's owner and a
    partial sum elsewhere; zero_grad() clears them as usual. zerokit.checkpoint saves and loads
    it at any world size, as torch.optim.Muon's state (checkpoint/optimizers.py, MuonJob).
    """

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None, group=None):
        if not dist.is_initialized():
            raise RuntimeError("ZeRO1Muon needs torch.distributed to be initialised (see zerokit.launch)")
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}")
        _lr_ratio((1, 1), adjust_lr_fn)  # an unknown adjust_lr_fn fails here, not at the first step
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn))
        self.group, self.world_size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for g in self.param_groups for p in g["params"]]
        for p in self.params:
            if p.dim() != 2:
                raise ValueError(f"Muon updates 2-D parameters only, got one of shape {tuple(p.shape)}: give "
                                 "biases, norms and embeddings to an elementwise optimizer (zerokit.ZeRO1Adam)")
        broadcast_parameters([p for p in self.params if p.requires_grad], group)
        self.owners = assign_owners([p.shape for p in self.params], self.world_size)
        self._owner_of = dict(zip(self.params, self.owners))
        self._global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]

    def owned(self):
        """The parameters this rank owns (updates, and keeps momentum for)."""
        return [p for p, owner in zip(self.params, self.owners) if owner == self.rank]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for p in self.params if p.requires_grad]
        # a matrix some rank has a gradient for is updated (zeros stand in elsewhere); one no
        # rank has a gradient for is skipped whole, as torch.optim.Muon skips .grad None
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=_device(params))
        dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.group)
        live = [(p, self._owner_of[p]) for p, has in zip(params, present.tolist()) if has]
        # 1. each matrix's gradient summed on its owner (gloo reduces SUM only; the owner divides)
        grads = {p: (p.grad if p.grad is not None else torch.zeros_like(p)) for p, _ in live}
        works = [dist.reduce(grads[p], dst=self._global[owner], op=dist.ReduceOp.SUM, group=self.group,
                             async_op=True) for p, owner in live]
        for work in works:
            work.wait()
        # 2. the owner's update of each whole matrix
        group_of = {p: g for g in self.param_groups for p in g["params"]}
        for p, owner in live:
            if owner != self.rank:
                continue
            g = group_of[p]
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            muon_update_(p, grads[p].div_(self.world_size), state["momentum_buffer"], lr=g["lr"],
                         weight_decay=g["weight_decay"], momentum=g["momentum"], nesterov=g["nesterov"],
                         ns_coefficients=g["ns_coefficients"], eps=g["eps"], ns_steps=g["ns_steps"],
                         adjust_lr_fn=g["adjust_lr_fn"])
        # 3. every rank receives each updated matrix from its owner
        works = [dist.broadcast(p.data, src=self._global[owner], group=self.group, async_op=True) for p, owner in live]
        for work in works:
            work.wait()
        return loss


def _device(params):
    return params[0].device if params else torch.device("cpu")
