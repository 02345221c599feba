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
- **reduce-scatter**: one all-to-all sends chunk j of each rank's input straight to rank j,
  and each rank sums the N chunks it received: $S(N-1)$ elements out per rank, the ring's
  bytes. It needs a receive buffer the size of the input until the transfer is done (gloo's
  own holds a full-size temporary too);
- **all-gather**: rank i broadcasts its chunk of the output, for every i, in place: no
  temporary at all (what torch's ZeroRedundancyOptimizer does with its updated shards).

Measured on a 2-core CPU (gloo, fp32, median of 40), in ms, torch's / zerokit's:

| elements | N | reduce-scatter | all-gather |
|---|---|---|---|
| 500,000 | 2 | 2.9 / 1.4 | 2.2 / 1.1 |
| 500,000 | 4 | 7.9 / 3.6 | 4.9 / 3.0 |
| 2,880,000 | 2 | 16.0 / 9.0 | 9.1 / 5.0 |
| 2,880,000 | 4 | 35.3 / 14.2 | 16.3 / 11.1 |

`zerokit.CommCounter` counts each as the one collective it stands for (the paper's volume),
not as the all-to-all or the N broadcasts it is made of; `WireCounter` sees the real bytes.
"""

import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter", "all_gather"]

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
    """The work handle of a composite collective: wait() waits for its parts (works, or futures)."""

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


def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """output = op over the ranks of this rank's chunk of input; op SUM or AVG on gloo."""
    n = dist.get_world_size(group)
    if not _direct(group, input) or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or not output.is_floating_point():
        return _torch_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: the input has {input.numel()} elements, not {n} x the output's "
                         f"{output.numel()}")
    received = [torch.empty_like(input)]  # row j: what rank j sent for this rank's chunk
    with _counted_as("reduce_scatter", input, n):
        work = dist.all_to_all_single(received[0], input.contiguous(), group=group, async_op=True)

    def finish(_):
        # on gloo's thread, as soon as the transfer is done: the receive buffer is freed here,
        # not when the caller gets round to wait() (ZeRO-1 sends every bucket during backward)
        rows = received.pop().view(n, -1)
        torch.sum(rows, dim=0, out=output.view(-1))
        if op == dist.ReduceOp.AVG:
            output.div_(n)

    done = _Done([work.get_future().then(finish)])
    return done if async_op else done.wait() and None


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
        works = [dist.broadcast(c, group_src=i, group=group, async_op=True) for i, c in enumerate(chunks)]
    done = _Done(works)
    return done if async_op else done.wait() and None
