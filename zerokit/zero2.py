r"""ZeRO stage 2 ($P_{os+g}$): shard the gradients too.

ZeRO-1 still holds the full gradient ($G\Psi$ bytes) until step(). ZeRO-2 reduce-scatters
gradients *during backward*, bucket by bucket, as soon as every parameter of a bucket has
its gradient, and then frees them: each rank keeps only the mean gradient of its own
shard, $G\Psi/N$. Communication is unchanged ($\Psi$ reduce-scatter + $\Psi$ all-gather), and
sending during backward overlaps it with the rest of the backward computation.

How gradients are caught: `register_post_accumulate_grad_hook` runs right after autograd
writes a parameter's .grad (the hook receives the parameter). Two hooks per parameter:
`_mark_present` notes that it got a gradient and has autograd call `_finish_backward` once
backward is over; `_on_grad_ready` counts it in its bucket, and a bucket whose parameters
are all in is flattened, reduce-scattered asynchronously (`send`), and its parameters'
.grad set to None. Buckets are sent strictly in order (0, 1, 2, ...), so every rank issues
the same collectives in the same order even if gradients arrive in a different order; at
the end of backward (`_end_of_backward`) the remaining buckets are sent, with zeros for
parameters that got no gradient on this rank, and all transfers are awaited.

This class has the shape of lesson 04's scaffold (`MyZeRO2Adam`): the same methods, split
the same way, so the exercise's three methods (`_on_grad_ready`, `send`,
`_end_of_backward`) can be read side by side with a student's. `send` is public because code
outside the class calls it (lesson 04's checks; ZeRO-3 extends it to free a unit's weights);
the other two only the class itself calls. Lines marked "beyond the
exercise" are what the scaffold leaves out: `no_sync()`, the `max_in_flight` cap,
mixed precision's reduce dtype and bucket size (lesson 06), and the recovery from a
backward that raised.

Gradient accumulation over k micro-batches: each backward reduce-scatters, k times in all.
The cheaper path keeps full gradients locally and reduces once, at the cost of holding
them (ZeRO-1's memory) between micro-batches:

    with opt.no_sync():           # micro-batches 1 .. k-1: gradients accumulate in .grad
        loss_fn(model(x1), y1).backward()
    loss_fn(model(xk), yk).backward()   # the last one reduce-scatters the sum, once
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from .collectives import reduce_scatter  # torch's, but direct on gloo (the ring's bytes)
from .hooks import EndOfBackward, weak_hook
from .zero1 import ZeRO1Adam

__all__ = ["ZeRO2Adam"]


class ZeRO2Adam(ZeRO1Adam):
    """AdamW with optimizer state and gradients sharded across ranks (ZeRO stage 2).

    ZeRO1Adam's constructor. bucket_mb: size of a gradient bucket, in MiB (default 25, DDP's).
    Smaller buckets start sending earlier and hold less memory in flight; larger ones make
    fewer, more efficient collectives.
    """

    reduces_in_backward = True  # tells ZeRO1Adam: the hooks below reduce the gradients, step() finds them ready
    bucket_mb = 25.0  # ZeRO1Adam's bucket_mb=None takes this

    def _shard(self, group, precision, offload):
        self.grad_shards = []  # this rank's shard of the mean gradient, per bucket
        self._has_grad = []  # per bucket, per parameter: did it get a gradient in this step
        self._where = {}  # parameter -> (its bucket, its index in the bucket)
        self._sync = True  # beyond the exercise: False inside no_sync()
        # beyond the exercise (lesson 08): the end of backward, once, and no backward inside another
        self._backward_end = EndOfBackward(self._finish_backward, "ZeRO-2/3 reduce-scatter each bucket once, when "
                                           "the outer backward has produced its gradients")
        super()._shard(group, precision, offload)

    def _shard_groups(self, first):
        new = super()._shard_groups(first)
        for bi in new:
            bucket = self.buckets[bi]
            self.grad_shards.append(None)
            self._has_grad.append([False] * len(bucket.params))
            for j, p in enumerate(bucket.params):
                self._where[p] = (bi, j)
                # weak_hook: a hook held by the parameter must not keep the optimizer alive
                p.register_post_accumulate_grad_hook(weak_hook(self._mark_present))  # hooks run in this order
                p.register_post_accumulate_grad_hook(weak_hook(self._on_grad_ready))
        self._begin_backward()
        return new

    def _begin_backward(self):
        self._ready = [0] * len(self.buckets)  # parameters of each bucket whose gradient has arrived
        self._next = 0  # the next bucket to send: buckets go out in order
        self._in_flight = []  # (work, bucket index, output shard, flat input)
        self._backward_end.reset()

    def _mark_present(self, param):
        """Note that param got a gradient (step() skips parameters no rank has one for, as
        AdamW does), and have autograd call _finish_backward when this backward is over."""
        bi, j = self._where[param]
        self._has_grad[bi][j] = True
        self._backward_end.arm()

    def _finish_backward(self):
        self._end_of_backward()
        self._begin_backward()

    # ---- the exercise of lesson 04 ---------------------------------------------------

    def _on_grad_ready(self, param):
        """The hook: param's gradient has arrived; send every bucket now complete, in order."""
        bi, _ = self._where[param]
        self._ready[bi] += 1  # counted inside no_sync() too: ZeRO-3 then frees a unit whose gradients are in
        if not self._sync:  # beyond the exercise: inside no_sync(), gradients accumulate in .grad
            return
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next].params):
            self.send(self._next)

    @torch.no_grad()
    def send(self, bi):
        """Start bucket bi's reduce-scatter (mean, asynchronous) and free its full gradients."""
        bucket = self.buckets[bi]
        while len(self._in_flight) >= self.max_in_flight:  # beyond the exercise: see max_in_flight
            self._receive()
        # beyond the exercise (lesson 06): reduce_dtype, the dtype to average in (None: the gradients');
        # the exercise: `flat = bucket.flatten([p.grad for p in bucket.params])`
        flat = bucket.flatten([p.grad for p in bucket.params], dtype=self.reduce_dtype)
        for p in bucket.params:
            p.grad = None  # the full gradient is gone as soon as its bucket is on its way
        out = torch.empty(bucket.shard_numel, dtype=flat.dtype, device=flat.device)
        # beyond the exercise (lesson 11's hybrid sharding swaps the collective, see reduce_collective);
        # the exercise: `work = reduce_scatter(out, flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)`
        work = self.reduce_collective(out, flat, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
        self._in_flight.append((work, bi, out, flat))
        self._next = bi + 1

    @torch.no_grad()
    def _end_of_backward(self):
        """Send the buckets not sent yet, in order; wait for every transfer; keep the shards."""
        if self._sync:  # beyond the exercise: inside no_sync() nothing is sent
            while self._next < len(self.buckets):  # buckets with a parameter that got no gradient
                self.send(self._next)
        while self._in_flight:
            self._receive()

    def _receive(self):
        """Wait for the oldest transfer in flight and keep its output in grad_shards.

        The body of the exercise's waiting loop, in a method of its own because the
        max_in_flight cap (beyond the exercise) waits for transfers in send() too.
        """
        work, bi, out, _flat = self._in_flight.pop(0)  # the flat input is dropped once received
        work.wait()
        if self.grad_shards[bi] is None:
            self.grad_shards[bi] = out
        else:
            self.grad_shards[bi].add_(out)  # gradient accumulation across backward calls

    # ---- what step() reads -----------------------------------------------------------

    def _local_presence(self):
        return self._has_grad

    def _grad_shard(self, i):
        if self._in_flight:  # beyond the exercise: a clear message instead of a half-reduced gradient
            raise RuntimeError("step() called while gradients are still being reduced (inside backward?)")
        if self.grad_shards[i] is None:  # no backward since zero_grad(): a zero gradient
            return torch.zeros(self.buckets[i].shard_numel, device=self.flat_params[i].device)
        return self.grad_shards[i]

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        # beyond the exercise: a backward that raised never reached _finish_backward. Wait for
        # its transfers and start clean, or the next backward would believe its callback queued.
        while self._in_flight:
            self._receive()
        self._begin_backward()
        self.grad_shards = [None] * len(self.buckets)
        self._has_grad = [[False] * len(b.params) for b in self.buckets]

    def memory_categories(self):
        cats = super().memory_categories()
        # a reduce-scatter in flight: its flat input and its output shard are gradients on their way
        cats["gradients"] = [g for g in self.grad_shards if g is not None] + [
            t for sent in self._in_flight for t in sent if isinstance(t, torch.Tensor)]
        return cats

    # ---- beyond the exercise -----------------------------------------------------------

    # At most this many buckets' flat gradients wait in transit; a further send first waits
    # for the oldest, so the full-size gradient copies alive stay bounded (not Psi by the end).
    # It waits before making its own copy: waiting after holds one copy more. Measured with a
    # copy of this code that waits after (while more than max_in_flight are in flight, after the
    # append), `python -m zerokit.bench -n 2`, 5 runs each in turns on 2 CPU cores: ZeRO-2's
    # gradients peak at 12.98 MiB per rank with the wait before, 14.68 after (one 1.70 MiB bucket
    # copy more), its whole peak 40.82-40.96 against 40.83-42.59. ZeRO-3's peak is 39.31 MiB either
    # way (0.98 of FSDP2's): it also receives every transfer before each new all-gather
    # (zero3.py, start_gather).
    max_in_flight = 2

    # The collective of the gradients, swappable as FSDP2's set_custom_reduce_scatter: lesson 11's
    # hybrid sharding (zerokit.zeropp.HybridShardAdam) averages each shard across nodes as well.
    reduce_collective = staticmethod(reduce_scatter)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (full .grad) instead of reduce-scattering each backward."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True
