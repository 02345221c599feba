r"""Mixed precision: half-precision weights and gradients, fp32 master weights and Adam state.

The model computes in a 16-bit format (bf16 or fp16): its parameters and gradients take
2 bytes each. The optimizer keeps what must not be rounded to 16 bits in fp32: a *master
copy* of the weights, and Adam's m and v. An update $\eta\,\hat m/\sqrt{\hat v}$ is often
smaller than half a unit in the last place of a bf16 weight (bf16 keeps 8 significant
bits: $1 + 2^{-9}$ rounds back to 1), so applied to bf16 weights most updates would
vanish; applied to the fp32 master they accumulate, and the model gets a fresh 16-bit
copy after each step. Per parameter: 2 (weights) + 2 (gradients) + 4 + 4 + 4 (master, m,
v; the paper's K = 12) = 16 bytes. ZeRO shards the K part with the optimizer state: the
fp32 master copy of a shard lives on the rank that updates it, beside m and v.

bf16 or fp16. bf16 has fp32's exponent range (about 1e-38 to 3e38) and few mantissa bits;
fp16 has more mantissa bits but a narrow range: numbers below about 6e-8 flush to zero
and numbers above 65504 become inf. Gradients are often tiny, so in fp16 many would
underflow to zero during backward. The cure is **loss scaling**: backpropagate
loss * S (S = 2**16 to start), so every gradient is S times larger and stays in range;
then divide by S in fp32 before the update ("unscale"). If S was too large some gradient
overflows to inf/nan: the step is skipped and S halved. After `growth_interval` clean
steps S is doubled again, so S hovers just below the largest safe value ("dynamic" loss
scaling). bf16 needs none of this, and gets none.

The overflow decision must be the same on every rank. With ZeRO each rank sees only its
shard of the reduced gradient, so an inf that one rank produced may land in another rank's
shard only: one rank would skip, the others step, and the replicas drift apart (or hang,
waiting in a collective the skipping rank never joins). One tiny all-reduce (MAX) of a
found-inf flag gives every rank the same answer, and so the same loss scale.

How the stages use this module (one option, the same for all): pass
`precision=MixedPrecision(...)` to DistributedAdam or ZeRO{1,2,3}Adam. The optimizer casts
the model's parameters to the 16-bit type and keeps the fp32 master of what it updates:

- DistributedAdam: a full fp32 master per parameter; lesson 01's Adam runs unchanged on
  the masters (`step_on_masters`), then each master is cast back into its parameter.
- ZeRO-1/2: the master of this rank's shard, in `ShardedAdamState.master`;
  `_param_shard` hands it to Adam and `_publish` casts it into the half flat buffer
  before the all-gather. Gradients are reduce-scattered in `reduce_dtype`.
- ZeRO-3: the parameters are sharded like the optimizer state, so the fp32 master shard
  can itself be the parameter storage at rest, cast to 16 bits just before each
  all-gather: no separate half shard (this is how PyTorch's FSDP2 works), and the model
  state is 14 bytes per parameter / N instead of 16. `half_shard=True` keeps the paper's
  layout instead: a 16-bit shard at rest beside the fp32 master (2 more bytes / N).

Usage (the training loop is the same for fp32, bf16 and fp16):

    opt = zerokit.ZeRO2Adam(model.parameters(), lr=1e-3, precision=MixedPrecision("fp16"))
    loss = loss_fn(model(x.half()).float(), y)   # the model now computes in fp16
    opt.scale_loss(loss).backward()             # loss * S (S = 1 without loss scaling)
    opt.step()                                  # unscale, overflow check, update or skip
    opt.zero_grad()
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["MixedPrecision", "LossScaler", "MixedPrecisionState", "as_dtype"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def as_dtype(d):
    """A torch.dtype from a dtype or one of its names ("bf16", "fp16", "fp32", ...)."""
    if isinstance(d, torch.dtype):
        return d
    if d not in _DTYPES:
        raise ValueError(f"unknown dtype {d!r}; use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[d]


@dataclass(frozen=True)
class MixedPrecision:
    """What to compute and communicate in; pass it as `precision=` to any zerokit optimizer.

    param_dtype: the model's weights and gradients, torch.bfloat16 or torch.float16
        ("bf16", "fp16" also accepted).
    reduce_dtype: the dtype gradients are averaged in across ranks (None: param_dtype,
        the paper's 2-byte gradients; torch.float32 sums more accurately). With ZeRO the
        reduced gradient shard is kept in this dtype.
    loss_scaling: dynamic loss scaling with overflow skip; None means on for fp16, off for bf16.
    init_scale, growth_factor, backoff_factor, growth_interval: the dynamic loss scale
        starts at init_scale, is multiplied by backoff_factor on an overflow (and the step
        skipped), and by growth_factor after growth_interval steps in a row without one.
    half_shard: ZeRO-3 only. False: the fp32 master shard is the parameter storage at rest
        and is cast just before each all-gather. True: also keep a 16-bit parameter shard.
    """

    param_dtype: torch.dtype | str = torch.bfloat16
    reduce_dtype: torch.dtype | str | None = None
    loss_scaling: bool | None = None
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    half_shard: bool = False

    def __post_init__(self):
        param_dtype = as_dtype(self.param_dtype)
        if param_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"param_dtype must be bf16 or fp16, not {param_dtype}")
        reduce_dtype = param_dtype if self.reduce_dtype is None else as_dtype(self.reduce_dtype)
        loss_scaling = param_dtype == torch.float16 if self.loss_scaling is None else bool(self.loss_scaling)
        if not (self.init_scale > 0 and self.growth_factor >= 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise ValueError("need init_scale > 0, growth_factor >= 1, 0 < backoff_factor < 1, growth_interval >= 1")
        # frozen dataclass: normalise the fields once, here
        object.__setattr__(self, "param_dtype", param_dtype)
        object.__setattr__(self, "reduce_dtype", reduce_dtype)
        object.__setattr__(self, "loss_scaling", loss_scaling)

    def state(self, group=None):
        """What an optimizer built with precision=self holds at run time (zerokit.ddp.precision_state
        asks for it: the stages, lessons 02-05, import nothing of this lesson)."""
        return MixedPrecisionState(self, group)


class LossScaler:
    """The dynamic loss scale S. Every rank calls update() with the same (all-reduced)
    flag, so S and the counters stay identical on all ranks."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0  # steps since the last overflow or growth
        self.skipped_steps = 0

    def update(self, found_inf: bool):
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.clean_steps = 0


class MixedPrecisionState:
    """What one optimizer needs at run time: the dtypes, the loss scaler, and the small
    operations every stage shares (make a master, cast, unscale and check, cast back)."""

    def __init__(self, config: MixedPrecision, group=None):
        if not isinstance(config, MixedPrecision):
            raise TypeError(f"precision= takes a zerokit.MixedPrecision, not {type(config).__name__}")
        self.config, self.group = config, group
        self.param_dtype, self.reduce_dtype = config.param_dtype, config.reduce_dtype
        self.scaler = LossScaler(config.init_scale, config.growth_factor, config.backoff_factor,
                                 config.growth_interval) if config.loss_scaling else None
        self.found_inf = False

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    # ---- weights --------------------------------------------------------------------

    @staticmethod
    def master_copy(tensor):
        """A new fp32 tensor with tensor's values (the master weights it stands for)."""
        return tensor.detach().to(torch.float32, copy=True)

    def to_half(self, tensor):
        """tensor in the 16-bit compute dtype (itself, not a copy, if it already is)."""
        return tensor.to(self.param_dtype)

    @torch.no_grad()
    def cast_parameters_(self, params):
        """Make the parameters 16-bit in place (the Parameter objects stay the same)."""
        for p in params:
            p.data = self.to_half(p.data)

    # ---- gradients ------------------------------------------------------------------

    def scale_loss(self, loss):
        return loss * self.scaler.scale if self.scaler else loss

    @torch.no_grad()
    def fp32_gradients(self, grads):
        """The (mean) gradients in fp32, divided by the loss scale: a 16-bit gradient is copied,
        an fp32 one is divided in place and handed back as itself (the callers' fp32 gradients
        are theirs to overwrite: zerokit.train's stages 0 and 3 unscale their .grad this way).
        Lesson 06's `unscale` exercise is another contract: it leaves its inputs untouched.

        With loss scaling it also decides, for all ranks at once, whether any gradient on
        any rank is inf or nan (`found_inf`): one all-reduce of one flag. Call it exactly
        once per step on every rank, with this rank's gradients (or gradient shards).
        """
        out = [g.float() for g in grads]  # .float() copies a 16-bit tensor, not an fp32 one
        if self.scaler is None:
            return out
        for g in out:
            g.div_(self.scaler.scale)  # a power of two: exact in fp32
        local = any(not torch.isfinite(g).all() for g in out)
        device = out[0].device if out else "cpu"
        flag = torch.tensor([float(local)], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.found_inf = bool(flag.item())
        return out

    def should_step(self) -> bool:
        """Update the loss scale from this step's verdict; False: skip the update everywhere."""
        if self.scaler is None:
            return True
        self.scaler.update(self.found_inf)
        return not self.found_inf

    @torch.no_grad()
    def clip_scaled_(self, grads, max_norm):
        """Clip gradients that still carry the loss scale as if they did not; returns the
        true norm. The norm is summed in fp32 so a large scaled norm cannot overflow fp16."""
        sq = sum((g.float().pow(2).sum() for g in grads), torch.zeros(()))
        norm = sq.sqrt() / self.loss_scale
        coef = max_norm / (norm.item() + 1e-6)  # the same rule as torch.nn.utils.clip_grad_norm_
        if coef < 1:
            for g in grads:
                g.mul_(coef)
        return norm

    # ---- data parallel: every rank updates every parameter --------------------------

    def take_masters(self, params):
        """fp32 masters of the trainable params (None for frozen ones); all become 16-bit."""
        masters = [self.master_copy(p) if p.requires_grad else None for p in params]
        self.cast_parameters_(params)
        return masters

    @torch.no_grad()
    def step_on_masters(self, params, masters, fp32_step):
        """Run `fp32_step` (an unchanged fp32 optimizer step) on the master weights.

        For the duration of the step each parameter *is* its master: its .data is the fp32
        master and its .grad the unscaled fp32 gradient, so the optimizer creates fp32 state
        and updates the masters. Then every master is cast back into its 16-bit parameter.
        Returns False when the step was skipped (overflow on some rank).
        """
        pairs = [(p, m) for p, m in zip(params, masters) if m is not None and p.grad is not None]
        grads = self.fp32_gradients([p.grad for p, _ in pairs])
        if not self.should_step():
            return False
        saved = []
        for (p, master), grad in zip(pairs, grads):
            saved.append((p.data, p.grad))
            p.grad = None  # a .grad must match its parameter's dtype: swap data first
            p.data, p.grad = master, grad
        try:
            fp32_step()
        finally:
            for (p, master), (half, half_grad) in zip(pairs, saved):
                half.copy_(master)  # the rounding to 16 bits happens here, once per step
                p.grad = None
                p.data, p.grad = half, half_grad
        return True
