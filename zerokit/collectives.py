r"""The reduce-scatter and the all-gather every ZeRO stage is built from, as zerokit calls them.

    reduce_scatter(output, input, op=SUM, group=None, async_op=False)  # input: N*S, output: S
    all_gather(output, input, group=None, async_op=False)              # input: S, output: N*S

The same contract as torch's `reduce_scatter_single` and `all_gather_single` (their names
in torch 2.13; `*_tensor` before), which the lessons call through `zerokit.comm`; zerokit's
stages call these. On NCCL, and on gloo with GPU tensors (`ZEROKIT_DEVICE=cuda`), they are
torch's.

On gloo they are built from simpler collectives, because gloo's own are slow (lesson 00):
its reduce-scatter runs its all-reduce over the whole input, twice the ring's bytes, and
copies the input in and the shard out; its all-gather, measured, takes about twice as long
as N broadcasts of the same bytes. Here instead:
- **reduce-scatter**: each rank sends chunk j of its input straight to rank j (N - 1 sends)
  and receives its own chunk from every other rank, then sums the N chunks in rank order,
  its own in place: $S(N-1)$ elements out per rank, the ring's bytes. It needs a receive
  buffer of $(N-1)S$ elements until the sum (gloo's own holds a full-size temporary). Point-
  to-point, not gloo's all-to-all (the same bytes): the all-to-all also copies this rank's own
  chunk, needs an $NS$ buffer, and takes longer (below);
- **all-gather**, in place, with no temporary at all: at N = 2 rank i broadcasts its chunk of
  the output, for every i (what torch's ZeroRedundancyOptimizer does with its updated shards);
  from N = 3 on each rank sends its chunk straight to every other rank and receives theirs,
  all at once: N broadcasts are N rounds, one per source rank, where the sends and
  receives are all posted together.
  At N = 2 the two move the same bytes, and the broadcasts stay: measured alone the sends
  were as fast or faster, but inside ZeRO-3's prefetch they were slower (below).

Measured on a 2-core CPU (gloo, fp32, median of 40), in ms, torch's / zerokit's:

| elements | N | reduce-scatter | all-gather |
|---|---|---|---|
| 500,000 | 2 | 2.9 / 1.4 | 2.2 / 1.1 |
| 500,000 | 4 | 7.9 / 3.6 | 4.9 / 3.0 |
| 2,880,000 | 2 | 16.0 / 9.0 | 9.1 / 5.0 |
| 2,880,000 | 4 | 35.3 / 14.2 | 16.3 / 11.1 |

(reduce-scatter with the all-to-all; the sends and receives that replaced it, medians of 3
runs of 30 each on the same machine: 2,880,000 at N = 2, 9.1-11.8 ms all-to-all, 5.3-6.9
point-to-point; at N = 4, 15.1-16.2 and 10.8-11.6.)

The all-gather's two forms, on a later day's machine (faster: its torch column is lower than
above), medians of 40 after 10, the range over 5 runs, in ms:

| elements | N | torch's | N broadcasts | sends and receives |
|---|---|---|---|---|
| 500,000 | 2 | 0.8-1.7 | 0.5-0.9 | 0.3-0.5 |
| 2,880,000 | 2 | 5.6-6.8 | 3.7-5.2 | 2.7-4.5 |
| 500,000 | 4 | 3.6-5.6 | 2.7-4.6 | 0.9-2.2 |
| 2,880,000 | 4 | 10.7-12.8 | 8.5-10.2 | 6.2-7.4 |

In the bench at N = 4 (`python -m zerokit.bench -n 4`, in turns with the broadcasts, 4 runs
each), ZeRO-3 took 1.31-1.36 of its floor instead of 1.41-1.44 (0.67-0.71 of FSDP2's time
instead of 0.71-0.74); ZeRO-1 stayed at the peer's time (1.01-1.03, before 0.99-1.04). At
N = 2 the sends made ZeRO-3 slower, 1.25-1.29 of its floor against 1.16-1.20 (4 runs each;
why was not found), and ZeRO-1 and ZeRO-2 no faster.

`zerokit.CommCounter` counts each as the one collective it stands for (the paper's volume),
not as the sends, receives or broadcasts it is made of; `WireCounter` sees the real bytes.

`device_flags` makes the presence flags the stages send beside their gradients (which
parameters got one on this rank) as a tensor on the gradients' device, with no copy from the
host: data parallel's all-reduce (lesson 02), ZeRO-1's flag all-reduce, DataParallel's buckets.
"""

import os
import queue
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter", "all_gather", "device_flags"]

# the public spelling changed in torch 2.13: *_tensor is deprecated in favour of *_single
_torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Composite(threading.local):
    """The collective being built from others on this thread, for CommCounter: (op, tensor
    whose size is its size, group size), and the counters that have recorded it already."""

    current = None
    recorded_by = ()


COMPOSITE = Composite()


@contextmanager
def _counted_as(op, sized_by, group_size):
    COMPOSITE.current, COMPOSITE.recorded_by = (op, sized_by, group_size), set()
    try:
        yield
    finally:
        COMPOSITE.current = None


class _Done:
    """The work handle of a composite collective: wait() waits for its parts (the all-gather's
    broadcasts, or its sends and receives)."""

    def __init__(self, parts):
        self._parts = parts

    def wait(self, *args, **kwargs):
        while self._parts:
            self._parts.pop(0).wait()
        return True

    def is_completed(self):
        return not self._parts


def _direct(group, tensor):
    """Build it here: gloo, with tensors in host memory (the only case measured)."""
    return tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _exchange(send, receive, group, n, rank):
    """With every other rank j: send send(j) to it and receive receive(j) from it, all posted at once.
    Each pair sends and receives in the same order on both sides, the reduce-scatter and the
    all-gather alike, so gloo matches each message with its receive."""
    works = []
    for j in range(n):
        if j != rank:
            works.append(dist.isend(send(j), group=group, group_dst=j))
            works.append(dist.irecv(receive(j), group=group, group_src=j))
    return works


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """output = op over the ranks of this rank's chunk of input; op SUM or AVG on gloo."""
    n = dist.get_world_size(group)
    if not _direct(group, input) or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or not output.is_floating_point():
        return _torch_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: the input has {input.numel()} elements, not {n} x the output's "
                         f"{output.numel()}")
    rank = dist.get_rank(group)
    rows = input.contiguous().view(n, -1)  # row j goes to rank j; it must outlive the sends
    if output.data_ptr() == rows[rank].data_ptr():  # in place: our own row would be overwritten by the sum
        rows = rows.clone()
    received = torch.empty(n - 1, rows.shape[1], dtype=input.dtype, device=input.device)
    with _counted_as("reduce_scatter", input, n):
        works = []
        if n == 1:  # no peer to send to, but one collective all the same: CommCounter counts it as at any N
            works.append(dist.all_to_all_single(output.view(-1), rows.view(-1), group=group, async_op=True))
        works += _exchange(lambda j: rows[j], lambda j: received[j - (j > rank)], group, n, rank)

    def finish():
        # the chunks in rank order (as a sum over dim 0 of the N rows would add them), ours in place
        parts = [rows[j] if j == rank else received[j - (j > rank)] for j in range(n)]
        out = output.view(-1)
        if n > 1:  # (at N = 1 the all-to-all wrote it)
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
        if op == dist.ReduceOp.AVG:
            out.div_(n)

    if not async_op:
        for work in works:
            work.wait()
        finish()
        return None
    return _Finishing(works, finish)


class _Finishing:
    """The handle of an asynchronous reduce-scatter: its sends and receives, then the sum.

    gloo's point-to-point works have no futures to chain the sum on, so one thread per process
    waits for them and sums, in the order they were issued, as soon as each transfer is done:
    the receive buffer is freed then, not when the caller gets round to wait() (ZeRO-1 sends
    every bucket during backward, and waits in step()).
    """

    _queue, _pid = None, None

    def __init__(self, works, finish):
        self._done, self._error = threading.Event(), None
        self._queue_for_this_process().put((works, finish, self))

    @classmethod
    def _queue_for_this_process(cls):
        if cls._pid != os.getpid():  # a forked child has none of its parent's threads
            cls._queue, cls._pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(target=cls._finisher, args=(cls._queue,), name="zerokit-reduce-scatter",
                             daemon=True).start()
        return cls._queue

    @staticmethod
    def _finisher(jobs):
        while True:
            handle = _Finishing._finish(*jobs.get())
            # only now, when nothing of the job is left (its buffers went with _finish's frame):
            # a caller that measures memory right after wait() must not see them alive
            handle._done.set()

    @staticmethod
    def _finish(works, finish, handle):
        try:
            for work in works:
                work.wait()
            finish()
        except BaseException as exc:  # a peer gone, a timeout: the caller's wait() raises it
            handle._error = exc
        return handle

    def wait(self, *args, **kwargs):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done.is_set()


def all_gather(output, input, group=None, async_op=False):
    """output = the ranks' inputs, in rank order; `input` may be this rank's chunk of `output`."""
    if not _direct(group, output):
        return _torch_all_gather(output, input, group=group, async_op=async_op)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: the output has {output.numel()} elements, not {n} x the input's "
                         f"{input.numel()}")
    chunks = output.view(-1).chunk(n)
    if chunks[rank].data_ptr() != input.data_ptr():  # not in place: this rank's chunk is a copy of input
        chunks[rank].copy_(input.view(-1))
    with _counted_as("all_gather", output, n):
        if n <= 2:  # N broadcasts (at N = 1 one collective all the same: CommCounter counts it as at any N)
            works = [dist.broadcast(c, group_src=i, group=group, async_op=True) for i, c in enumerate(chunks)]
        else:  # every transfer at once: each rank sends its chunk to each other rank
            works = _exchange(lambda j: chunks[rank], lambda j: chunks[j], group, n, rank)
    done = _Done(works)
    return done if async_op else done.wait() and None


def device_flags(flags, dtype, device):
    """A list of bools as a tensor on `device`, 1 for True, made without copying from the host.

    torch.tensor(flags, device=...) would copy from ordinary (pageable) host memory, which CUDA does
    synchronously: the host waits for the GPU to finish what is queued. A fill per run of equal
    flags (usually one or two) queues like any other operation."""
    out = torch.empty(len(flags), dtype=dtype, device=device)
    start = 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            out[start:i].fill_(1 if flags[start] else 0)
            start = i
    return out
