"""Data parallel as a module wrapper: lesson 02's all-reduce, moved into backward.

    model = zerokit.DataParallel(model)          # ~ torch.nn.parallel.DistributedDataParallel
    opt = torch.optim.AdamW(model.parameters())  # any optimizer: it sees ordinary .grad
    loss_fn(model(x_local), y_local).backward(); opt.step(); opt.zero_grad()

Lesson 02's DistributedAdam averages every gradient in step(), after backward is over: the
network sits idle for the whole backward, then the computation sits idle for the whole
all-reduce. Here the average is taken by the model instead of the optimizer, in buckets, as
backward produces the gradients, so any torch optimizer finds the mean gradient in .grad and
most of the communication overlaps the rest of backward (the buckets of the last layers,
whose gradients come first, are on the wire while the first layers still differentiate).

The bucket machinery is lesson 04's (zerokit/zero2.py) with an all-reduce for a
reduce-scatter: buckets are filled from the last parameter backwards and sent strictly in
order, so every rank issues the same collectives in the same order whatever order its
gradients arrive in; a bucket goes when all its gradients are in; at the end of backward the
rest go, and `finish_gradient_synchronization()` waits for them all.

What is sent and how it is averaged, as in lesson 02's `average_gradients`: each bucket is a
flat copy of its gradients (zeros where this rank has none) plus one presence slot per
parameter, all-reduced with SUM and divided by N. A parameter with no gradient on any rank
keeps .grad = None, so torch optimizers skip it as on one process. SUM-then-divide, not
ReduceOp.AVG: it runs on every backend, and with two ranks holding the same gradient x,
(x + x) / 2 is exactly x (gloo's AVG is the same sum and division, bitwise; NCCL's AVG
multiplies each input by 1/N before summing, which at N = 3 rounds differently).

Memory: .grad stays full size, as an optimizer needs it. The flat copies are what travels:
at most `max_in_flight` buckets' copies exist at once; sending one more first waits for the
oldest and writes its mean back into .grad. (PyTorch's DDP instead makes each .grad a view
into its bucket, "gradient_as_bucket_view", which saves even those copies.)
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from .collectives import device_flags
from .ddp import broadcast_parameters, write_means
from .flat import make_buckets
from .hooks import EndOfBackward, weak_hook

__all__ = ["DataParallel", "plan_buckets"]


def plan_buckets(params, bucket_numel):
    """Lesson 04's buckets (zerokit.flat.make_buckets: filled from the last parameter backwards,
    the order backward tends to produce them in), one dtype and device per bucket, since a
    bucket travels as one flat tensor; world size 1: an all-reduce keeps everything."""
    groups = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    # align_bytes=None: each gradient's place in the flat copy starts on zerokit.flat.ALIGN_BYTES
    return [b for ps in groups.values() for b in make_buckets(ps, 1, 0, bucket_numel, align_bytes=None)]


class DataParallel(nn.Module):
    """Replicate `module` on every rank of `group` and average its gradients during backward.

    Parameters and buffers are broadcast from the group's rank 0 here, so every replica
    starts equal. Frozen parameters (requires_grad=False) are not communicated; a parameter
    used twice (tied) is one parameter and is sent once. As with DDP, every rank runs each
    backward through the model: the collectives are matched across ranks, bucket by bucket.
    bucket_mb: a bucket's size in MiB. Smaller buckets start sending earlier; larger ones make
    fewer, more efficient collectives.
    """

    # flat copies waiting on the wire at most; sending one more first receives the oldest
    max_in_flight = 2

    def __init__(self, module, group=None, bucket_mb=25.0):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("zerokit.DataParallel needs an initialised torch.distributed process group: "
                               "run your code on several ranks with zerokit.launch (or torchrun)")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        broadcast_parameters(list(module.parameters()) + list(module.buffers()), group)
        trainable = [p for p in module.parameters() if p.requires_grad]  # parameters() yields a tied one once
        itemsize = trainable[0].element_size() if trainable else 4
        self.buckets = plan_buckets(trainable, max(1, int(bucket_mb * 2**20) // itemsize))
        self._where = {}  # parameter -> its bucket's index
        for bi, bucket in enumerate(self.buckets):
            for p in bucket.params:
                self._where[p] = bi
                # weak: the parameter holds the hook, and must not keep this wrapper alive
                p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        self._sync = True  # False inside no_sync()
        # the end of each backward sends the rest; a backward inside another one is refused
        self._backward_end = EndOfBackward(self.finish_gradient_synchronization, "zerokit.DataParallel sends "
                                           "each bucket once, when the outer backward has produced its gradients")
        self._in_flight = []  # (work, bucket index, flat copy, every gradient here), oldest first
        self._begin_backward()

    def forward(self, *args, **kwargs):
        if self._backward_end.pending:  # a backward raised before its end: start clean
            self._drain()
            self._begin_backward()
        return self.module(*args, **kwargs)

    def _begin_backward(self):
        self._ready = [0] * len(self.buckets)  # gradients arrived, per bucket
        self._next = 0  # the next bucket to send
        self._backward_end.reset()  # no backward's end pending

    # ---- during backward ---------------------------------------------------------------

    def _on_grad_ready(self, param):
        """The hook (it receives the parameter, whose .grad now holds this backward's share)."""
        if not self._sync:
            return  # no_sync(): the gradient stays in .grad, to be summed with the next ones
        self._backward_end.arm()  # its end sends the buckets left and waits for them all
        bi = self._where[param]
        self._ready[bi] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self._send(self._next)

    @torch.no_grad()
    def _send(self, bi):
        """Start bucket bi's all-reduce. The .grad each parameter holds now is its whole local
        gradient: this backward's share plus what no_sync() (or an earlier backward without
        zero_grad) accumulated, so the sum is reduced once, and a parameter that got nothing
        this time still sends what it holds, as the other ranks do.

        On a GPU nothing here waits for it: the gradients go in with one multi-tensor copy, not a
        copy per parameter, each at its aligned offset (zerokit.flat), the gaps between them
        zeroed in one call, and the presence slots are filled on the device (device_flags)."""
        bucket = self.buckets[bi]
        p0 = bucket.params[0]
        here = [p.grad is not None for p in bucket.params]
        flat = torch.empty(bucket.numel + len(bucket.params), dtype=p0.dtype, device=p0.device)
        bucket.zero_gaps_(flat)
        views = bucket.views(flat)
        pairs = [(v, p.grad) for v, p in zip(views, bucket.params) if p.grad is not None]
        if pairs:
            torch._foreach_copy_([v for v, _ in pairs], [g for _, g in pairs])
        for v, p in zip(views, bucket.params):
            if p.grad is None:
                v.zero_()  # sent as zeros: this rank adds nothing to it
        flat[bucket.numel:].copy_(device_flags(here, p0.dtype, p0.device))
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._in_flight.append((work, bi, flat, all(here)))
        self._next = bi + 1
        while len(self._in_flight) > self.max_in_flight:
            self._receive()

    @torch.no_grad()
    def _receive(self):
        """Wait for the oldest bucket and write its mean into .grad (writing now is safe: a
        parameter's hook runs after autograd's last write to its .grad in this backward).

        The presence counts are read back (on a GPU, a wait for everything queued) only where
        some parameter of the bucket had no gradient here: a gradient here is a count of 1 at least."""
        work, bi, flat, all_here = self._in_flight.pop(0)
        work.wait()
        bucket = self.buckets[bi]
        counts = [1] * len(bucket.params) if all_here else flat[bucket.numel:].tolist()
        flat[:bucket.numel].div_(self.world_size)
        write_means(bucket.params, bucket.views(flat), counts)  # lesson 02's, as average_gradients writes them

    def _drain(self):
        while self._in_flight:
            self._receive()

    # ---- public ------------------------------------------------------------------------

    def finish_gradient_synchronization(self):
        """Send the buckets not sent yet (in order), wait for every bucket, and leave the mean
        gradient in each .grad. Runs by itself at the end of each backward; calling it again
        does nothing."""
        if self._backward_end.pending:
            while self._next < len(self.buckets):  # a bucket where some parameter got no gradient here
                self._send(self._next)
        self._drain()
        self._begin_backward()

    @contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients locally in .grad and sends nothing; the next
        backward outside reduces the accumulated sum, once (gradient accumulation)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True
