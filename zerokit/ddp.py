"""Data parallel Adam: every rank holds everything, gradients are averaged with all-reduce.

Each of N ranks computes gradients on its own micro-batch. The gradient of the mean loss
over the whole batch is the mean of the ranks' gradients (equal micro-batch sizes), so one
all-reduce (sum, then divide by N) gives every rank the same gradient, and the same Adam
step on the same starting weights keeps the N replicas identical.

Memory per rank is the full model state: parameters, gradients and both Adam moments,
N times over across the job. That redundancy is what ZeRO removes.
Communication per step: one all-reduce of Psi elements, which a ring implements as a
reduce-scatter plus an all-gather: 2 * Psi * (N-1)/N elements sent per rank.

Mixed precision (`precision=MixedPrecision(...)`, lesson 06): the parameters become 16-bit,
the optimizer keeps an fp32 master copy of each, and the unchanged Adam above updates the
masters (see zerokit.mixed_precision).
"""

import torch
import torch.distributed as dist

from .adam import Adam
from .mixed_precision import precision_state

__all__ = ["DistributedAdam", "broadcast_parameters", "average_gradients"]


@torch.no_grad()
def broadcast_parameters(params, group=None):
    """Copy rank 0's values into every rank's parameters, so all replicas start equal."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in params:
        if getattr(p, "zerokit_placeholder", False):  # lesson 07: no values yet (zerokit.checkpoint.placeholders)
            continue
        dist.broadcast(p.data, src=src, group=group)


@torch.no_grad()
def average_gradients(params, group=None, reduce_dtype=None):
    """All-reduce the mean gradient of `params` in one collective per dtype.

    reduce_dtype: communicate (and sum) in this dtype, default each gradient's own; the mean is
    written back into .grad in the parameter's dtype.

    A parameter with no gradient on some rank counts as zero there. The flat buffer carries
    one extra slot per parameter that counts the ranks which did produce a gradient: a
    parameter no rank used keeps .grad = None and is skipped by Adam, exactly as when a
    single process trains on the whole batch.
    """
    world = dist.get_world_size(group)
    by_dtype = {}
    for p in params:
        if p.requires_grad:
            by_dtype.setdefault((reduce_dtype or p.dtype, p.device), []).append(p)
    for (dtype, device), ps in by_dtype.items():
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in ps]
            + [torch.tensor([float(p.grad is not None) for p in ps], dtype=dtype, device=device)]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        counts = flat[-len(ps):]
        offset = 0
        for p, count in zip(ps, counts.tolist()):
            n = p.numel()
            if count == 0:
                p.grad = None
            else:
                mean = flat[offset:offset + n].view_as(p).div_(world)
                if p.grad is None:
                    p.grad = mean.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(mean)
            offset += n


class DistributedAdam(Adam):
    """Adam for data parallel training: average the gradients across ranks, then step.

    Use inside an initialised process group. The parameters are broadcast from rank 0
    when the optimizer is built, so every replica starts from the same weights.
    precision: a zerokit.MixedPrecision for 16-bit weights and gradients (None: fp32).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, group=None,
                 precision=None):
        if not dist.is_initialized():
            raise RuntimeError("DistributedAdam needs torch.distributed to be initialised (see zerokit.launch)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.group = group
        self._averaged = False  # set by clip_grad_norm_, which must average first
        broadcast_parameters(self._params(), group)
        # lesson 06: the dtypes and the loss scale (fp32: FullPrecision, which does nothing), and
        # fp32 masters of the (broadcast) weights while the model goes 16-bit (fp32: None)
        self.precision = precision_state(precision, group)
        self.masters = self.precision.take_masters(self._params())

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._averaged:
            average_gradients(self._params(), self.group, self.precision.reduce_dtype)
        self._averaged = False
        if self.masters is None:
            self._update()
        else:  # lesson 06: unscale, skip on overflow, else the same Adam on the fp32 masters
            self.precision.step_on_masters(self._params(), self.masters, self._update)
        return loss

    def scale_loss(self, loss):
        """loss times the loss scale (mixed precision fp16); the loss itself otherwise."""
        return self.precision.scale_loss(loss)

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        self._averaged = False  # a clip without a step must not leave the next step unaveraged

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm):
        """Average the gradients now, then clip their global norm (as on one process)."""
        average_gradients(self._params(), self.group, self.precision.reduce_dtype)
        self._averaged = True
        grads = [p for p in self._params() if p.grad is not None]
        if self.masters is not None:  # lesson 06: 16-bit gradients that may still carry the loss scale
            return self.precision.clip_scaled_([p.grad for p in grads], max_norm)
        return torch.nn.utils.clip_grad_norm_(grads, max_norm)

    def memory_categories(self):
        """Mixed precision: the fp32 master weights are optimizer state (the paper's K = 12)."""
        return {"optimizer_states": [m for m in self.masters or [] if m is not None]}
