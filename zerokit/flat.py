"""Flat buffers and shards: the bookkeeping every ZeRO stage shares.

A `FlatBucket` lays a list of parameters end to end in one 1-D buffer, pads it to a
multiple of the world size N and cuts it into N equal shards; rank r owns elements
[r*S, (r+1)*S) of the padded buffer. Parameter sizes are never assumed divisible by N:
a parameter may straddle two shards, and the last shard may end in padding.

    params:   |--- w1 (5) ---|-- b1 (2) --|--- w2 (4) ---|pad|      numel 11, N = 3
    shards:   |   rank 0 (4)  |   rank 1 (4)  |   rank 2 (4)  |     padded 12, S = 4

That is lesson 03's layout (`shard_range`: S = ceil(numel / N)), and a FlatBucket's default.
Production buffers add one rule: every parameter, and every shard, starts on an aligned
boundary. GPU kernels take other code paths on a misaligned pointer (vectorised loads want
16 bytes), and some refuse one; PyTorch's FSDP1 pads each parameter to 16 bytes, DeepSpeed
to 16, Megatron to 128. zerokit's optimizers build their buckets that way (align_bytes=None:
ALIGN_BYTES, 16). A parameter's offset is rounded up to a multiple of `align` elements, the
gap before it is padding (zeros), and S is ceil(numel / N) rounded up to a multiple of
`align` too, so that each rank's shard, and each segment in it, starts aligned as well:

    params:   |-- w1 (5) --|pad|- b1 -|pad|-- w2 (4) --|....pad....|     align 4: offsets 0, 8, 12, numel 16
    shards:   |   rank 0 (8)    |   rank 1 (8)    |   rank 2 (8)    |     S = 8, padded 24

The padding costs less than one alignment per parameter and per shard.

Equal shards are what the collectives want: `reduce_scatter_single` takes N*S elements and
hands each rank its S, `all_gather_single` does the reverse, and neither would accept a
ragged split. `segments()` tells a rank which (piece of which) parameter its shard holds,
which is what the optimizer needs to apply per-parameter rules such as step counts.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["FlatBucket", "Segment", "ALIGN_BYTES", "align_numel", "aligned", "padded_numel", "shard_range",
           "make_buckets"]

# Every parameter and every shard of zerokit's flat buffers (the buckets its optimizers and
# wrappers build: FlatBucket(..., align_bytes=None)) starts on a multiple of this many bytes.
# 16: what a GPU's vectorised loads and stores want (4 floats, 8 halves), and what FSDP1 and
# DeepSpeed pad to; Megatron pads to 128 ("helps cuBLAS pick more efficient algorithms").
# Which of 16 and 128 is faster is measured on a GPU, not assumed: a bench sets this module
# constant (or builds inside `aligned(128)`) before building its optimizers; it is read when
# a bucket is built. 1 turns alignment off: lesson 03's layout.
ALIGN_BYTES = 16
# The narrowest dtype one bucket's layout is used in: its 16-bit compute copy (lesson 06),
# beside fp32 masters and gradients of the same layout. Aligned in 16-bit elements, every
# wider dtype's views are aligned too.
NARROWEST_ITEMSIZE = 2


def align_numel(align_bytes=None) -> int:
    """Elements between aligned starts: align_bytes (None: ALIGN_BYTES, read now) in the narrowest
    dtype a flat buffer holds, so that the same offsets are aligned in bf16, fp16 and fp32 alike."""
    align_bytes = ALIGN_BYTES if align_bytes is None else align_bytes
    if not (isinstance(align_bytes, int) and align_bytes >= 1 and align_bytes & (align_bytes - 1) == 0):
        raise ValueError(f"align_bytes must be a power of two (1: no alignment), not {align_bytes!r}")
    return max(1, align_bytes // NARROWEST_ITEMSIZE)


@contextmanager
def aligned(align_bytes):
    """zerokit's buckets built inside the block (align_bytes=None) align to align_bytes
    (1: lesson 03's unaligned layout; 128: Megatron's)."""
    global ALIGN_BYTES
    align_numel(align_bytes)  # refuse a bad value before changing anything
    before, ALIGN_BYTES = ALIGN_BYTES, align_bytes
    try:
        yield
    finally:
        ALIGN_BYTES = before


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_numel(numel: int, world_size: int) -> int:
    """The smallest multiple of world_size that holds numel elements (lesson 03, unaligned)."""
    return _round_up(numel, world_size)


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's shard in a buffer of numel elements padded for world_size ranks
    (lesson 03's shard maths; a FlatBucket built with an alignment rounds S up to it)."""
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
    """Parameters laid end to end in one padded buffer, cut into world_size equal shards; with
    an alignment, each parameter at an aligned offset and each shard a multiple of it.

    align_bytes: 1 (the default): lesson 03's layout, end to end, S = ceil(numel / N); None:
        ALIGN_BYTES, read now, as zerokit's optimizers build their buckets; or a power of two.
        `align` is that many bytes in elements of the narrowest dtype (align_numel).
    numel: the buffer's elements up to the end of the last parameter, the gaps between
        parameters included (unaligned: the sum of the parameters' numels, Psi_b).
    param_numel: the parameters' elements alone, Psi_b (what the ZeRO paper's formulas count).
    shard_numel: S, ceil(numel / world_size) rounded up to a multiple of `align`;
        padded_numel = world_size * S.
    """

    def __init__(self, params, world_size: int, rank: int, align_bytes=1):
        self.params = list(params)
        if not self.params:
            raise ValueError("a FlatBucket needs at least one parameter")
        self.world_size, self.rank = world_size, rank
        self.align = align_numel(align_bytes)
        self.numels = [p.numel() for p in self.params]
        self.shapes = [p.shape for p in self.params]  # kept: ZeRO-3 empties the parameters
        self.offsets = []
        total = 0
        for n in self.numels:
            total = _round_up(total, self.align)  # the gap before this parameter is padding
            self.offsets.append(total)
            total += n
        self.numel = total
        self.param_numel = sum(self.numels)
        self.shard_numel = _round_up(-(-total // world_size), self.align)
        self.padded_numel = self.shard_numel * world_size
        self.shard_start, self.shard_end = rank * self.shard_numel, (rank + 1) * self.shard_numel
        # the padding inside [0, numel): [end of one parameter, start of the next), where non-empty
        self.gaps = [(off + n, nxt) for off, n, nxt in zip(self.offsets, self.numels, self.offsets[1:])
                     if off + n < nxt]
        self._gap_index = {}  # device -> the gaps' positions, one tensor (scratch zeroes them in one call)
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
        """A full-size flat buffer for the caller to overwrite whole: zero only in its padding,
        the gaps between parameters and the end. (Zero-filling all of it would be one more pass
        over memory, on every step.) The padding must be zeros, not garbage: it is reduced,
        stepped and checked for inf with the rest."""
        p = self.params[0]
        flat = torch.empty(self.padded_numel, dtype=dtype or p.dtype, device=device or p.device)
        flat[self.numel:].zero_()
        return self.zero_gaps_(flat)

    def zero_gaps_(self, flat):
        """Zero the gaps between the parameters in `flat` (in place, one call) and return it."""
        if self.gaps:
            index = self._gap_index.get(flat.device)
            if index is None:
                index = torch.cat([torch.arange(a, b) for a, b in self.gaps]).to(flat.device)
                self._gap_index[flat.device] = index
            flat.index_fill_(0, index, 0)
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


def make_buckets(params, world_size, rank, bucket_numel=None, align_bytes=1):
    """Split params into FlatBuckets of at most bucket_numel parameter elements (None: one
    bucket), each built with align_bytes (FlatBucket's). The cap counts the parameters alone,
    so which parameters share a bucket does not depend on the alignment; its padding comes on
    top, less than one alignment per parameter and per shard.

    Buckets are filled in reverse order of `params`: backward produces gradients roughly
    from the last layer to the first, so the first bucket to fill is the first to send.
    A parameter larger than bucket_numel gets a bucket of its own.
    """
    params = list(params)
    if not params:
        return []
    if bucket_numel is None:
        return [FlatBucket(params, world_size, rank, align_bytes)]
    buckets, current, size = [], [], 0
    for p in reversed(params):
        if current and size + p.numel() > bucket_numel:
            buckets.append(FlatBucket(current, world_size, rank, align_bytes))
            current, size = [], 0
        current.append(p)
        size += p.numel()
    buckets.append(FlatBucket(current, world_size, rank, align_bytes))
    return buckets
