r"""How a group's bytes move: the all-gather's copy-in and copy-out, the reduce-scatter's chunk-cat.

A group (one `fully_shard` call) sends all its parameters in one collective, as a flat buffer
does, but its parameters are separate tensors, each cut on dim 0. So each collective is framed
by copies that a flat buffer never needs.

**All-gather.** With the padded shards $s_1, \dots, s_m$ of this rank ($S = \sum_i |s_i|$
elements), the output is one buffer of $NS$ elements, viewed as $N$ rows of $S$: row r is what
rank r sent. The *copy-in* writes this rank's shards (cast to the compute dtype) end to end into
its own row, which is also the collective's input, so nothing else is allocated; the *copy-out*
splits every row by the sizes $|s_i|$ and copies column block i into parameter i's gathered
buffer, viewed as $N \times |s_i|$: rows of parameter i's shards, which is the parameter,
padded rows last (`torch.split_with_sizes_copy`). Cost beyond the transfer: $S$ elements copied
in and $NS$ copied out.

**Reduce-scatter.** The full local gradients $g_i$ must be laid out so that chunk r of the input
is what rank r keeps: rank r's rows of every parameter, end to end. That is `torch._chunk_cat`:
each $g_i$ padded on dim 0 to a multiple of N, cut into N chunks, and chunk r of every gradient
concatenated into row r of an $N \times S$ buffer. After the reduce-scatter this rank's row is
the mean gradient of its shards, $S$ elements, and shard i's gradient is a view into it. Cost
beyond the transfer: the $NS$ elements of the chunk-cat.

The collectives themselves are torch's, as FSDP2 calls them (`all_gather_single`,
`reduce_scatter_single` with `ReduceOp.AVG` in fp32 and bf16; in fp16 a sum with the division
split before and after, to keep clear of fp16's range), held by objects a group can swap
(`AllGather`, `ReduceScatter`): lesson 12 measures them, lesson 11's ideas slot in there.
"""

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .param import dim0_chunk

__all__ = ["AllGather", "ReduceScatter", "Gathering", "all_gather_copy_in", "all_gather_copy_out",
           "reduce_scatter_copy_in", "shard_grads", "divide_factors"]


class AllGather:
    """The all-gather a group calls: torch's, into the buffer the copy-in filled."""

    def __call__(self, output, input, group, async_op=False):
        return dist.all_gather_single(output, input, group=group, async_op=async_op)


class ReduceScatter:
    """The reduce-scatter a group calls: torch's, from the chunk-cat buffer into this rank's row."""

    def __call__(self, output, input, group, op, async_op=False):
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


class Gathering(NamedTuple):
    """An all-gather in flight: its output buffer, the work to wait on (None if it ran synchronously),
    and the per-parameter sizes the copy-out splits each row by."""
    output: torch.Tensor
    work: object
    split_sizes: list


@torch.no_grad()
def all_gather_copy_in(inputs, world_size, rank, dtype, device):
    """The all-gather's output (world_size * S elements) with this rank's row filled: `inputs` (1-D
    padded shards) end to end, cast to `dtype`. Returns (output, this rank's row: the input)."""
    sizes = [t.numel() for t in inputs]
    total = sum(sizes)
    output = torch.empty(world_size * total, dtype=dtype, device=device)
    row = output.narrow(0, rank * total, total)
    torch._foreach_copy_(list(torch.split(row, sizes)), list(inputs))
    return output, row


@torch.no_grad()
def all_gather_copy_out(output, split_sizes, outs):
    """Split each of the world_size rows of `output` by `split_sizes` and copy piece i of every row into
    outs[i] (parameter i's gathered buffer, world_size * split_sizes[i] elements). Autograd's version
    counters are left alone: backward reads these buffers after forward saved them (as FSDP2 does)."""
    world_size = output.numel() // sum(split_sizes)
    views = [o.view(world_size, -1) for o in outs]
    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
        torch.split_with_sizes_copy(output.view(world_size, -1), split_sizes, dim=1, out=views)


@torch.no_grad()
def reduce_scatter_copy_in(grads, world_size, dtype):
    """The reduce-scatter's input: each gradient padded on dim 0 to a multiple of world_size, cut into
    world_size chunks, chunk r of every gradient end to end in row r (torch._chunk_cat), in `dtype`."""
    rows = [-(-g.size(0) // world_size) * world_size for g in grads]
    total = sum(r * (g.numel() // max(g.size(0), 1)) for r, g in zip(rows, grads))
    flat = torch.empty(total, dtype=dtype, device=grads[0].device)
    torch._chunk_cat(grads, 0, world_size, out=flat.view(world_size, -1))
    return flat


def shard_grads(output, params):
    """This rank's reduce-scatter output (S elements: the padded shard gradients end to end, in the order of
    `params`, the sharded parameters whose gradients were reduced) as one DTensor gradient per parameter:
    its real rows, a view of `output`, placed as the parameter is."""
    grads, offset = [], 0
    for p in params:
        mesh = p.device_mesh
        # beyond the exercise: a 2-D mesh (HSDP) shards over its last dimension;
        # the exercise: `_, length, padded_rows = dim0_chunk(p.size(0), mesh.size(), mesh.get_local_rank())`
        _, length, padded_rows = dim0_chunk(p.size(0), mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))
        local = output.as_strided((length, *p.shape[1:]), p.stride(), offset)
        # beyond the exercise: DTensor's constructor with the parameter's own spec (what FSDP2 does), once per
        # parameter and step: from_local costs about 10x more (measured 40-80 us against 4-12 us);
        # the exercise: `grads.append(DTensor.from_local(local, mesh, p.placements, run_check=False,
        #     shape=p.shape, stride=p.stride()))`
        grads.append(DTensor(local, p._spec, requires_grad=False))
        offset += padded_rows * math.prod(p.shape[1:])
    return grads


def divide_factors(dtype, data_parallel_size):
    """(divide before, divide after, op) for the mean over every data-parallel rank (HSDP: both mesh
    dimensions), as FSDP2 chooses them: fp32 and bf16 average in the collectives; fp16 sums, divided by
    about sqrt(N) before and by the rest after, to keep the sum inside fp16's range."""
    if dtype in (torch.float32, torch.bfloat16):
        return None, None, (dist.ReduceOp.AVG if data_parallel_size > 1 else dist.ReduceOp.SUM)
    before = 1
    while data_parallel_size % before == 0 and data_parallel_size / before > before:
        before *= 2
    return before, data_parallel_size / before, dist.ReduceOp.SUM
