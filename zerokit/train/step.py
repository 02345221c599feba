"""One optimizer step of the job: the micro-batch loop, the loss scale, clipping.

train_step is the loop lesson 10 teaches, on the rank's device: forward, the loss divided by
the number of micro-batches, backward, for each micro-batch, every backward but the last
without communication (gradient_sync); then clipping and opt.step().
"""

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from zerokit.stages import get_stage

from .data import global_batch
from .options import HALF


class LossScaling:
    """fp16 at stages 0 and 3, whose optimizer is a plain torch one: lesson 06's dynamic loss scale
    around it, through the same MixedPrecisionState that zerokit.ZeRO1/ZeRO2 hold for
    MixedPrecision("fp16") at stages 1 and 2. After backward the gradients (fp32: DataParallel's
    replicated mean, FullyShard's reduced shards) are divided by the scale in place, and one
    all-reduce of a flag tells every rank whether any rank saw an inf or nan: then every rank skips
    the step and the scale halves, so the ranks' scales and weights never part."""

    def __init__(self):
        from zerokit.mixed_precision import MixedPrecision

        self.precision = MixedPrecision("fp16").state()
        self.scaler = self.precision.scaler  # the LossScaler: its scale and counters

    def load(self, state):
        """From a checkpoint's train.json: a resumed run goes on with the scale it had."""
        self.scaler.scale, self.scaler.clean_steps, self.scaler.skipped_steps = state

    def state(self):
        return [self.scaler.scale, self.scaler.clean_steps, self.scaler.skipped_steps]

    def scale(self, loss):
        return self.precision.scale_loss(loss)

    @torch.no_grad()
    def unscale_and_check(self, model):
        """Divide the gradients by the scale; True when every rank's are finite (the step may go on)."""
        # fp32 gradients: fp32_gradients divides these very tensors (.float() of fp32 is itself); FullyShard's
        # are DTensors, whose local rows are this rank's shard: each rank checks its own, one all-reduce of a flag
        self.precision.fp32_gradients([_local(p.grad) for p in model.parameters() if p.grad is not None])
        return self.precision.should_step()


def _local(t):
    """A DTensor's local tensor (this rank's rows, the same storage); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def loss_scaling(args):
    """A LossScaling where this job needs one of its own (fp16, stage 0 or 3), else None."""
    # a plain torch optimizer beside the model's wrapper (DataParallel, FullyShard); ZeRO1/ZeRO2 and the
    # lessons' classes (--offload) scale their loss themselves
    own = get_stage(args.stage).loss_scaling == "job" and not args.offload
    return LossScaling() if args.precision == "fp16" and own else None


def skipped_steps(opt, scaler):
    """Steps an fp16 loss scale skipped (an inf or nan on some rank), or None without one."""
    inner = getattr(getattr(opt, "precision", None), "scaler", None)  # ZeRO1/ZeRO2's MixedPrecision("fp16")
    found = scaler.scaler if scaler is not None else inner
    return None if found is None else found.skipped_steps


def autocast_for(args, device=None):
    """torch.autocast on `device`'s type (default the CPU) in the job's 16-bit dtype where the stage
    computes under it (uses_autocast), else off."""
    kind = torch.device(device or "cpu").type
    return torch.autocast(kind, dtype=HALF.get(args.precision, torch.bfloat16), enabled=uses_autocast(args))


def train_step(args, model, opt, train_text, step, rows, autocast, scaler=None, device=None):
    """Forward, backward (over --accum micro-batches), clipping and opt.step() of `step` on this
    rank's `rows` of the global batch; the rank's mean loss (a tensor on `device`, default the CPU).
    The caller zeroes the gradients. scaler: fp16's LossScaling at stages 0 and 3 (a step with an
    inf or nan on some rank is skipped)."""
    x, y = global_batch(train_text, step, args.batch, args.seq_len, args.seed)  # drawn on the CPU
    x, y = x[rows].to(device, non_blocking=True), y[rows].to(device, non_blocking=True)
    total = torch.zeros((), device=device)
    for k in range(args.accum):
        xs, ys = x[k::args.accum], y[k::args.accum]
        with gradient_sync(args, model, opt, last=k == args.accum - 1):
            with autocast:
                logits = model(xs)
            loss = F.cross_entropy(logits.float().reshape(-1, 256), ys.reshape(-1))
            scaled = loss / args.accum
            if scaler is not None:
                scaled = scaler.scale(scaled)
            elif hasattr(opt, "scale_loss"):  # zerokit.ZeRO1/ZeRO2: the loss scale of MixedPrecision("fp16"), or 1
                scaled = opt.scale_loss(scaled)
            scaled.backward()
        total += loss.detach() / args.accum
    if scaler is not None and not scaler.unscale_and_check(model):
        return total  # an overflow on some rank: every rank skips this step
    if args.clip is not None:
        clip_(args, model, opt)
    opt.step()
    return total


def gradient_sync(args, model, opt, last):
    """The context a micro-batch's forward and backward run in: on every micro-batch but the last,
    gradients accumulate where backward leaves them, with no communication (lesson 08's no_sync);
    the last one's backward reduces their sum once. Each stage's own switch:
        0  DataParallel.no_sync() (DDP's under --impl torch)
        1  none: ZeRO-1 reduces once, in step(), whatever backward did
        2  ZeRO2's no_sync() (FSDP2's set_requires_gradient_sync under --impl torch)
        3  FullyShard's set_requires_gradient_sync(False), as FSDP2's
    With one reduction a step every stage sums the same gradients in the same order, so at N = 2
    (where a sum of two is one addition and the mean a halving, both exact) the stages agree to the
    bit. --sync-each-micro-batch reduces every micro-batch instead: k reductions, and at stages 2
    and 3 only a shard of the gradient held between micro-batches (4 Psi / N, not 4 Psi)."""
    if last or args.sync_each_micro_batch:
        return nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):  # FullyShard, FSDP2's fully_shard
        return _sync_off(model)
    for owner in (model, opt):  # DataParallel and DDP (the model); ZeRO2, ZeRO2Adam, ZeRO3Adam (the optimizer)
        if hasattr(owner, "no_sync"):
            return owner.no_sync()
    return nullcontext()  # ZeRO-1 (and Muon's owners): nothing is reduced before step()


@contextmanager
def _sync_off(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def uses_autocast(args):
    """16 bits by torch.autocast: zerokit's stage 0 and the DDP-based peers (stages 0 and 1), whose
    weights stay fp32; the other stages hold 16-bit weights themselves (MixedPrecision, compute_dtype,
    FSDP2's MixedPrecisionPolicy)."""
    s = get_stage(args.stage)
    return args.precision != "fp32" and (s.peer_autocast if args.impl == "torch" else s.autocast)


def clip_(args, model, opt):
    """Scale the gradient to global norm --clip; the norm before. Each stage knows its gradients:
    replicated and averaged (0), flat shards whose squares add up over the ranks (1, 2: the
    optimizers' own clip_grad_norm_), or DTensor shards (3: FullyShard's parameters, as FSDP2's),
    whose norm torch's clip_grad_norm_ takes over every rank's rows itself."""
    how = "torch" if args.impl == "torch" else get_stage(args.stage).clip
    if args.offload or how == "optimizer":  # the lessons' ZeRO1/2/3Adam, ZeRO1/ZeRO2: their reduced flat shards
        return float(opt.clip_grad_norm_(args.clip))
    if how == "torch":
        # DDP's gradients are the replicated mean, FSDP2's and FullyShard's DTensor shards: torch's clip knows
        # both (a DTensor's norm is a collective over the ranks' rows)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        sq = torch.zeros((), device=next(model.parameters()).device)
    else:
        sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
    norm = float(sq.sqrt())
    if norm > args.clip:
        for g in grads:
            g.mul_(args.clip / (norm + 1e-6))
    return norm
