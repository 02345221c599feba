r"""FSDP2's parameters in a checkpoint's flat layout: a dim-0 shard is a contiguous flat range.

zerokit.fully_shard (lesson 12) and torch's fully_shard make each parameter a DTensor placed
`Shard(0)`: rank r of N holds the rows $[rc, \min((r+1)c, R))$ of a parameter of $R$ rows, with
$c = \lceil R / N \rceil$, as `torch.chunk` cuts them (zerokit.fully_shard.param.dim0_chunk).
Flattened, rows $[s, s + l)$ of a parameter whose rows hold $w$ elements each are the elements
$[s w, (s + l) w)$, one contiguous range: so one parameter is one bucket of lesson 07's format,
of `numel` $R w$, cut into shards of `shard_numel` $S = c w$ elements (rank r's shard is
elements $[r S, (r+1) S)$, its rows and then zeros up to $S$), and every reader that goes by
offsets and S (`covering`, `_plan`, `consolidate`) reads it as it reads a flat bucket. No other
field is needed: $S \ge \lceil R w / N \rceil$, as the format asks of a shard.

What a checkpoint holds whole (frozen parameters) is written from `whole(t)`, an all-gather of
a DTensor on every rank, and loaded into this rank's rows (`local_rows`).
"""

import math

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..flat import Segment
from ..fully_shard.param import dim0_chunk

__all__ = ["is_dtensor", "local", "whole", "row_span", "local_rows", "RowBucket", "check_row_sharded"]


def is_dtensor(t):
    return isinstance(t, DTensor)


def local(t):
    """A DTensor's local tensor (this rank's rows, sharing their storage); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def whole(t):
    """The full tensor: a DTensor's gathered from every rank (a collective: every rank calls it), a plain one itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def row_span(t):
    """(start, length, padded): the rows of the full tensor that this rank's local tensor of the DTensor t
    holds, and the rows its shard is padded to (ceil(R / N) for Shard(0) over N ranks; all of them where
    t is replicated). Placements other than Replicate and Shard(0) cannot be read as rows: ValueError."""
    start, length, padded = 0, t.shape[0], t.shape[0]
    mesh = t.device_mesh
    for d, placement in enumerate(t.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard(0):
            raise ValueError(f"zerokit.checkpoint reads DTensors sharded along dim 0 (Shard(0), FSDP2's) or "
                             f"replicated; this one is placed {t.placements}")
        if length != t.shape[0]:
            raise ValueError(f"zerokit.checkpoint reads a DTensor sharded along dim 0 once, not {t.placements}")
        start, length, padded = dim0_chunk(t.shape[0], mesh.size(d), mesh.get_local_rank(d))
    if local(t).shape[0] != length:  # another cut than torch.chunk's: refuse rather than misplace rows
        raise ValueError(f"a DTensor of {t.shape[0]} rows holds {local(t).shape[0]} of them on this rank, not the "
                         f"{length} torch.chunk gives it")
    return start, length, padded


def local_rows(t, full):
    """The rows of `full` (a tensor of t's full shape) that this rank holds of the DTensor t."""
    start, length, _ = row_span(t)
    return full[start:start + length]


def check_row_sharded(name, t):
    """ValueError unless t is a DTensor sharded Shard(0) over every rank of the default group, mesh rank r being
    global rank r: then rank r's rows are shard r of the checkpoint's bucket, and its file is rank r's."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = t.device_mesh
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim != 1 or tuple(t.placements) != tuple(t.placements[:1]) or not t.placements[0].is_shard(0) \
            or ranks != list(range(world)):
        raise ValueError(f"zerokit.checkpoint saves a sharded parameter as shard r of rank r: {name} must be placed "
                         f"Shard(0) on a 1-D mesh of every rank in order (fully_shard's default mesh), not "
                         f"{tuple(t.placements)} on ranks {ranks} of {world} (HSDP's 2-D meshes: save it with DCP)")


class RowBucket:
    """One DTensor parameter as a bucket of the checkpoint format (the module's docstring): its numel, its
    shard size S = ceil(R / N) rows, and the segment this rank holds (none where its rows are none), with
    the fields zerokit.flat.FlatBucket gives the writers (params, shapes, offsets, segments)."""

    def __init__(self, param):
        start, length, padded = row_span(param)
        row = math.prod(param.shape[1:])  # elements per row (1 for a vector)
        self.params, self.shapes, self.offsets = [param], [param.shape], [0]
        self.numel, self.shard_numel = param.numel(), padded * row
        lo, hi = start * row, (start + length) * row
        self.segments = [Segment(0, 0, hi - lo, lo, hi)] if hi > lo else []
