"""Flat buffers and shards: the bookkeeping every ZeRO stage shares.

A `FlatBucket` lays a list of parameters end to end in one 1-D buffer, pads it to a
multiple of the world size N and cuts it into N equal shards; rank r owns elements
[r*S, (r+1)*S) with S = padded / N. Parameter sizes are never assumed divisible by N:
a parameter may straddle two shards, and the last shard may end in padding.

    params:   |--- w1 (5) ---|-- b1 (2) --|--- w2 (4) ---|pad|      numel 11, N = 3
    shards:   |   rank 0 (4)  |   rank 1 (4)  |   rank 2 (4)  |     padded 12, S = 4

Equal shards are what the collectives want: `reduce_scatter_single` takes N*S elements and
hands each rank its S, `all_gather_single` does the reverse, and neither would accept a
ragged split. `segments()` tells a rank which (piece of which) parameter its shard holds,
which is what the optimizer needs to apply per-parameter rules such as step counts.
"""

from dataclasses import dataclass

import torch

__all__ = ["FlatBucket", "Segment", "padded_numel", "shard_range", "make_buckets"]


def padded_numel(numel: int, world_size: int) -> int:
    """The smallest multiple of world_size that holds numel elements."""
    return -(-numel // world_size) * world_size


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's shard in a buffer of numel elements padded for world_size ranks."""
    size = padded_numel(numel, world_size) // world_size
    return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class Segment:
    """The part of parameter `index` that lies in this rank's shard.

    [shard_lo, shard_hi) are positions inside the shard; [param_lo, param_hi) are
    positions inside the flattened parameter.
    """

    index: int
    shard_lo: int
    shard_hi: int
    param_lo: int
    param_hi: int


class FlatBucket:
    """Parameters laid end to end in one padded buffer, cut into world_size equal shards."""

    def __init__(self, params, world_size: int, rank: int):
        self.params = list(params)
        if not self.params:
            raise ValueError("a FlatBucket needs at least one parameter")
        self.world_size, self.rank = world_size, rank
        self.numels = [p.numel() for p in self.params]
        self.shapes = [p.shape for p in self.params]  # kept: ZeRO-3 empties the parameters
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        self.padded_numel = padded_numel(total, world_size)
        self.shard_numel = self.padded_numel // world_size
        self.shard_start, self.shard_end = shard_range(total, world_size, rank)
        self.segments = self._segments()

    def _segments(self):
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(off, self.shard_start), min(off + n, self.shard_end)
            if lo < hi:
                out.append(Segment(i, lo - self.shard_start, hi - self.shard_start, lo - off, hi - off))
        return out

    def empty(self, dtype=None, device=None):
        """A zero-filled full-size (padded) flat buffer."""
        p = self.params[0]
        return torch.zeros(self.padded_numel, dtype=dtype or p.dtype, device=device or p.device)

    def scratch(self, dtype=None, device=None):
        """A full-size flat buffer for the caller to overwrite whole: zero only in its padding.
        (Zero-filling all of it would be one more pass over memory, on every step.)"""
        p = self.params[0]
        flat = torch.empty(self.padded_numel, dtype=dtype or p.dtype, device=device or p.device)
        flat[self.numel:].zero_()
        return flat

    def flatten(self, tensors, dtype=None, device=None):
        """Copy tensors (one per parameter, None meaning zeros) into a new padded flat buffer."""
        tensors = list(tensors)
        # zero-filled only where a tensor is missing: otherwise the copies overwrite it all anyway
        flat = self.empty(dtype, device) if any(t is None for t in tensors) else self.scratch(dtype, device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            if t is not None:
                flat[off:off + n].copy_(t.reshape(-1))
        return flat

    def views(self, flat):
        """Views of `flat` shaped like each parameter: writing into the buffer writes them."""
        return [flat[off:off + n].view(shape) for shape, off, n in zip(self.shapes, self.offsets, self.numels)]

    def shard(self, flat):
        """This rank's shard of a full flat buffer (a view, not a copy)."""
        return flat[self.shard_start:self.shard_end]

    def shard_of(self, tensors, dtype=None, device=None):
        """This rank's shard of the flattened `tensors`, built without the full buffer."""
        p = self.params[0]
        out = torch.zeros(self.shard_numel, dtype=dtype or p.dtype, device=device or p.device)
        for s in self.segments:
            t = tensors[s.index]
            if t is not None:
                out[s.shard_lo:s.shard_hi].copy_(t.reshape(-1)[s.param_lo:s.param_hi])
        return out


def make_buckets(params, world_size, rank, bucket_numel=None):
    """Split params into FlatBuckets of at most bucket_numel elements (None: one bucket).

    Buckets are filled in reverse order of `params`: backward produces gradients roughly
    from the last layer to the first, so the first bucket to fill is the first to send.
    A parameter larger than bucket_numel gets a bucket of its own.
    """
    params = list(params)
    if not params:
        return []
    if bucket_numel is None:
        return [FlatBucket(params, world_size, rank)]
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > bucket_numel:
            buckets.append(FlatBucket(current, world_size, rank))
            current, size = [], 0
        current.append(p)
        size += p.numel()
    buckets.append(FlatBucket(current, world_size, rank))
    return buckets
