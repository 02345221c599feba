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
masters (see zerokit.mixed_precision). Without it an optimizer holds a FullPrecision (below):
the same calls, each doing nothing, so the fp32 path needs no branch.

Beyond the lesson, on a GPU: lesson 01's Adam goes one parameter at a time, about eight kernels
each; `foreach` (torch.optim.AdamW's option, and its default) runs the same update on all of
them at once (zerokit.multi_tensor). And a GPU runs ahead of the Python that queues its work
until something reads a GPU tensor back (`.item()`, `.tolist()`, `if tensor:`, a blocking copy):
then the host waits for everything queued. A step here reads nothing back unless some
parameter has no gradient on this rank (see average_gradients).
"""

import torch
import torch.distributed as dist

from .adam import Adam
from .collectives import device_flags
from .multi_tensor import adamw_multi_tensor_, default_foreach

__all__ = ["DistributedAdam", "broadcast_parameters", "average_gradients", "write_means", "FullPrecision",
           "precision_state"]


@torch.no_grad()
def broadcast_parameters(params, group=None):
    """Copy rank 0's values into every rank's parameters, so all replicas start equal."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in params:
        if getattr(p, "zerokit_placeholder", False):  # lesson 07: no values yet (zerokit.checkpoint.placeholders)
            continue
        dist.broadcast(p.data, src=src, group=group)


class FullPrecision:
    """The precision state of an fp32 run: what the stages call on a MixedPrecisionState,
    each doing nothing.

    It lets a stage write its fp32 path once, without a branch for lesson 06 at every step:
    the parameters and gradients keep their own dtype, no master copy is made (master_copy
    gives None: Adam updates the weights themselves), the loss is not scaled and no step is
    skipped. step_on_masters and clip_scaled_ are left out: without masters nobody calls them.
    """

    config = scaler = None
    param_dtype = reduce_dtype = None  # the parameters' and the gradients' own
    loss_scale = 1.0
    found_inf = False

    @staticmethod
    def master_copy(tensor):
        return None  # no master: the fp32 weights are updated in place

    @staticmethod
    def to_half(tensor):
        return tensor

    @staticmethod
    def cast_parameters_(params):
        pass

    @staticmethod
    def scale_loss(loss):
        return loss

    @staticmethod
    def fp32_gradients(grads):
        return list(grads)  # already fp32, and not scaled

    @staticmethod
    def should_step() -> bool:
        return True

    @staticmethod
    def take_masters(params):
        return None


def precision_state(precision, group=None):
    """What an optimizer built with `precision=` holds: a FullPrecision for None (fp32); for a
    zerokit.MixedPrecision (lesson 06), the MixedPrecisionState it makes (MixedPrecision.state)."""
    if precision is None:
        return FullPrecision()
    if not callable(getattr(precision, "state", None)):
        raise TypeError(f"precision= takes a zerokit.MixedPrecision, not {type(precision).__name__}")
    return precision.state(group)


@torch.no_grad()
def average_gradients(params, group=None, reduce_dtype=None):
    """All-reduce the mean gradient of `params` in one collective per dtype.

    reduce_dtype: communicate (and sum) in this dtype, default each gradient's own; the mean is
    written back into .grad in the parameter's dtype.

    A parameter with no gradient on some rank counts as zero there. The flat buffer carries
    one extra slot per parameter that counts the ranks which did produce a gradient: a
    parameter no rank used keeps .grad = None and is skipped by Adam, exactly as when a
    single process trains on the whole batch. The counts are read only where this rank has no
    gradient for some parameter: a gradient here means a count of at least 1, and on a GPU the
    read would wait for the all-reduce and everything before it.
    """
    world = dist.get_world_size(group)
    by_dtype = {}
    for p in params:
        if p.requires_grad:
            by_dtype.setdefault((reduce_dtype or p.dtype, p.device), []).append(p)
    for (dtype, device), ps in by_dtype.items():
        here = [p.grad is not None for p in ps]
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for p in ps]
            + [device_flags(here, dtype, device)]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        total = flat.numel() - len(ps)
        flat[:total].div_(world)  # the mean, in one operation for every parameter
        counts = here if all(here) else flat[total:].tolist()
        means = flat[:total].split([p.numel() for p in ps])
        write_means(ps, [m.view_as(p) for m, p in zip(means, ps)], counts)


@torch.no_grad()
def write_means(params, means, counts):
    """Each parameter's .grad becomes its mean gradient: None where no rank had one (count 0: as
    on one process, the optimizer skips it), a copy where this rank had none, else written into
    the .grad it has. `means` are views of the all-reduced buffer, which is freed after: copies,
    not views, are kept; the copies into existing .grad are one multi-tensor call, not one each."""
    keep = []
    for p, mean, count in zip(params, means, counts):
        if count == 0:
            p.grad = None
        elif p.grad is None:
            p.grad = mean.to(p.dtype, copy=True)
        else:
            keep.append((p.grad, mean))
    if keep:
        torch._foreach_copy_([g for g, _ in keep], [m for _, m in keep])


class DistributedAdam(Adam):
    """Adam for data parallel training: average the gradients across ranks, then step.

    Use inside an initialised process group. The parameters are broadcast from rank 0
    when the optimizer is built, so every replica starts from the same weights.
    precision: a zerokit.MixedPrecision for 16-bit weights and gradients (None: fp32).
    foreach: as torch.optim.AdamW's. None: its default for these parameters, the multi-tensor
        update on a GPU (zerokit.multi_tensor) and lesson 01's loop on a CPU; True or False: that one.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, group=None,
                 precision=None, foreach=None):
        if not dist.is_initialized():
            raise RuntimeError("DistributedAdam needs torch.distributed to be initialised (see zerokit.launch)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.group = group
        self.foreach = foreach  # beyond the lesson: None, torch.optim.AdamW's default (see _update)
        self._averaged = False  # set by clip_grad_norm_, which must average first
        broadcast_parameters(self.all_params(), group)
        # lesson 06: the dtypes and the loss scale (fp32: FullPrecision, which does nothing), and
        # fp32 masters of the (broadcast) weights while the model goes 16-bit (fp32: None)
        self.precision = precision_state(precision, group)
        self.masters = self.precision.take_masters(self.all_params())

    def all_params(self):
        """Every parameter of every param group, in order (lesson 02's scaffold gives the same): the
        order `masters` follows (its i-th entry is the fp32 master of the i-th parameter, None where
        it needs none)."""
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def _update(self):
        """Lesson 01's Adam on every parameter with a gradient; beyond the lesson, where torch.optim.AdamW
        would take its multi-tensor version (foreach), the same update one param group at a time."""
        foreach = self.foreach if self.foreach is not None else default_foreach(self.all_params())
        if not foreach:
            return super()._update()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("zerokit.DistributedAdam does not support sparse gradients")
            states = [self.state[p] for p in params]
            for p, state in zip(params, states):
                if not state:  # as zerokit.Adam: zero moments, made at a parameter's first update
                    state.update(step=0, exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                 exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
                state["step"] += 1
            beta1, beta2 = group["betas"]
            adamw_multi_tensor_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr=group["lr"],
                                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._averaged:
            average_gradients(self.all_params(), self.group, self.precision.reduce_dtype)
        self._averaged = False
        if self.masters is None:
            self._update()
        else:  # lesson 06: unscale, skip on overflow, else the same Adam on the fp32 masters
            self.precision.step_on_masters(self.all_params(), self.masters, self._update)
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
        average_gradients(self.all_params(), self.group, self.precision.reduce_dtype)
        self._averaged = True
        grads = [p for p in self.all_params() if p.grad is not None]
        if self.masters is not None:  # lesson 06: 16-bit gradients that may still carry the loss scale
            return self.precision.clip_scaled_([p.grad for p in grads], max_norm)
        return torch.nn.utils.clip_grad_norm_(grads, max_norm)

    def memory_categories(self):
        """Mixed precision: the fp32 master weights are optimizer state (the paper's K = 12)."""
        return {"optimizer_states": [m for m in self.masters or [] if m is not None]}
