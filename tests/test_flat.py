"""Flat buffers and shards (zerokit.flat): padding, ranges, segments, views, buckets.

Sizes are chosen so that neither the parameters nor their total divide evenly by N. Each
layout test runs unaligned (align_bytes=1: lesson 03's layout, offsets end to end and
S = ceil(numel / N)) and aligned to 16 and 128 bytes, where every parameter and every shard
starts on a multiple of that many bytes in the narrowest dtype a buffer holds (16-bit): the
expected offsets are computed here, by the rule, not read from the bucket.
"""

import math

import pytest
import torch

from zerokit import flat
from zerokit.flat import FlatBucket, align_numel, aligned, make_buckets, padded_numel, shard_range

pytestmark = pytest.mark.timeout(60)

SIZE_SETS = [
    [(5,), (2,), (4,)],  # the module docstring's example: 11 elements
    [(3, 7), (7,), (1,), (2, 5, 3)],  # 59
    [(1,)],
    [(13, 19), (19,), (19, 13), (13,), (11,)],  # 526
    [(4, 4)],  # 16: divisible by 1, 2 and 4, not by 3 or 5
]
WORLD_SIZES = [1, 2, 3, 4, 5]
ALIGNMENTS = [1, 16, 128]  # bytes; 1: no alignment


def elements(align_bytes):
    """align_bytes in elements of a 16-bit dtype (bf16, fp16): the narrowest a flat buffer holds."""
    return max(1, align_bytes // 2)


def expected_layout(numels, n, align_bytes):
    """(offsets, numel, shard size) by the rule: each offset the first multiple of the alignment at or
    after the previous parameter's end; S = ceil(numel / n) rounded up to the alignment."""
    a = elements(align_bytes)
    offsets, end = [], 0
    for k in numels:
        start = math.ceil(end / a) * a
        offsets.append(start)
        end = start + k
    return offsets, end, math.ceil(math.ceil(end / n) / a) * a


def tensors_of(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in shapes]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_padded_numel(n):
    for numel in range(0, 60):
        padded = padded_numel(numel, n)
        assert padded == math.ceil(numel / n) * n
        assert padded % n == 0 and numel <= padded < numel + n


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_shard_range_tiles_the_padded_buffer(n):
    for numel in (1, 7, 10, 11, 59, 526):
        size = math.ceil(numel / n)
        ranges = [shard_range(numel, n, r) for r in range(n)]
        assert ranges == [(r * size, (r + 1) * size) for r in range(n)]
        assert ranges[-1][1] == padded_numel(numel, n) >= numel  # nothing dropped: not numel // n


@pytest.mark.parametrize("align", ALIGNMENTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("shapes", SIZE_SETS, ids=lambda s: str(sum(math.prod(x) for x in s)))
def test_segments_cover_every_element_exactly_once(shapes, n, align):
    params = tensors_of(shapes)
    numels = [t.numel() for t in params]
    offsets, total, size = expected_layout(numels, n, align)
    covered = [torch.zeros(k, dtype=torch.int64) for k in numels]
    shard_hits = torch.zeros(size * n, dtype=torch.int64)
    for r in range(n):
        b = FlatBucket(params, n, r, align_bytes=align)
        assert b.offsets == offsets and b.numel == total
        assert b.shard_numel == size and b.padded_numel == size * n
        assert (b.shard_start, b.shard_end) == (r * size, (r + 1) * size)
        if align == 1:  # lesson 03's shard maths, exactly
            assert b.numel == sum(numels) and b.padded_numel == padded_numel(total, n)
            assert (b.shard_start, b.shard_end) == shard_range(total, n, r)
        # every parameter, every shard and so every segment starts on the alignment, in 16 bits
        assert all(2 * o % align == 0 for o in b.offsets) and 2 * b.shard_numel % align == 0
        for s in b.segments:
            assert 0 <= s.shard_lo < s.shard_hi <= b.shard_numel
            assert 0 <= s.param_lo < s.param_hi <= numels[s.index]
            assert s.shard_hi - s.shard_lo == s.param_hi - s.param_lo
            # the segment sits where the parameter sits in the flat layout
            assert b.shard_start + s.shard_lo == offsets[s.index] + s.param_lo
            assert 2 * s.shard_lo % align == 0  # a segment the optimizer steps starts aligned
            covered[s.index][s.param_lo:s.param_hi] += 1
            shard_hits[b.shard_start + s.shard_lo:b.shard_start + s.shard_hi] += 1
    for c in covered:
        assert torch.equal(c, torch.ones_like(c)), "some element is owned by no rank or by two"
    # only the padding (the gaps before aligned parameters, the end of the last shards) is owned by none
    owned = torch.zeros(size * n, dtype=torch.int64)
    for o, k in zip(offsets, numels):
        owned[o:o + k] = 1
    assert torch.equal(shard_hits, owned)
    # the padding stays below one alignment per parameter and per shard (the bound the census tests allow)
    assert size * n - sum(numels) < elements(align) * (len(numels) + n)


def laid_out(params, offsets, size):
    """The padded buffer by the rule: each tensor at its offset, zeros everywhere else."""
    out = torch.zeros(size, dtype=params[0].dtype)
    for t, o in zip(params, offsets):
        out[o:o + t.numel()] = t.reshape(-1)
    return out


@pytest.mark.parametrize("align", ALIGNMENTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("shapes", SIZE_SETS, ids=lambda s: str(sum(math.prod(x) for x in s)))
def test_flatten_views_and_shards(shapes, n, align, monkeypatch):
    params = tensors_of(shapes, seed=n)
    offsets, _, size = expected_layout([t.numel() for t in params], n, align)
    # torch.empty's memory is whatever was there: make it NaN, so that padding left unwritten shows
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    for r in range(n):
        b = FlatBucket(params, n, r, align_bytes=align)
        flat = b.flatten(params)
        assert flat.shape == (b.padded_numel,) and flat.dtype == params[0].dtype
        assert torch.equal(flat, laid_out(params, offsets, size * n))  # the padding, gaps and end, is zeros
        if align == 1:
            assert torch.equal(flat[:b.numel], torch.cat([t.reshape(-1) for t in params]))  # end to end

        views = b.views(flat)
        for v, t in zip(views, params):
            assert v.shape == t.shape and torch.equal(v, t)
            assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        # writing through the buffer writes the views, and the other way round
        flat.mul_(2)
        for v, t in zip(views, params):
            assert torch.equal(v, 2 * t)
        views[-1].fill_(7.0)
        assert flat[b.numel - params[-1].numel():b.numel].eq(7.0).all()

        # the shard is a view too, at the right offset
        shard = b.shard(flat)
        assert shard.shape == (b.shard_numel,)
        assert shard.data_ptr() == flat.data_ptr() + b.shard_start * flat.element_size()
        shard.fill_(-1.0)
        assert flat[b.shard_start:b.shard_end].eq(-1.0).all()

        # shard_of builds the same shard without the full buffer
        fresh = b.flatten(params)
        assert torch.equal(b.shard_of(params), b.shard(fresh))
        assert b.shard_of(params).shape == (b.shard_numel,)
        # scratch: every element the caller does not write (the padding) is zero
        scratch = b.scratch()
        for v in b.views(scratch):
            v.fill_(1.0)
        assert torch.equal(scratch, laid_out([torch.ones(k) for k in b.numels], offsets, size * n))


@pytest.mark.parametrize("align", ALIGNMENTS)
def test_none_means_zeros(align):
    params = tensors_of([(3,), (4,), (2,)])
    for r in range(3):
        b = FlatBucket(params, 3, r, align_bytes=align)
        flat = b.flatten([params[0], None, params[2]])
        offsets, _, size = expected_layout([3, 4, 2], 3, align)
        assert torch.equal(flat, laid_out([params[0], torch.zeros(4), params[2]], offsets, 3 * size))
        assert torch.equal(b.shard_of([params[0], None, params[2]]), b.shard(flat))


def test_dtype_and_shape_kept():
    params = [torch.ones(2, 3, dtype=torch.float64), torch.ones(5, dtype=torch.float64)]
    b = FlatBucket(params, 4, 3, align_bytes=1)
    assert b.empty().dtype == torch.float64 and b.empty().shape == (12,)  # 11 elements, padded for 4 ranks
    assert b.flatten(params, dtype=torch.float32).dtype == torch.float32
    assert b.shapes == [torch.Size([2, 3]), torch.Size([5])]
    b = FlatBucket(params, 4, 3, align_bytes=16)  # 8 elements: 6 at 0, 5 at 8, numel 13; S = 8
    assert b.offsets == [0, 8] and b.empty().shape == (32,)


def test_alignment_is_read_when_a_bucket_is_built():
    params = tensors_of([(5,), (3,)])
    assert FlatBucket(params, 2, 0).offsets == [0, 5]  # a FlatBucket's default: lesson 03's layout
    assert flat.ALIGN_BYTES == 16 and align_numel() == 8  # zerokit's: 16 bytes, 8 elements of 16 bits
    assert FlatBucket(params, 2, 0, align_bytes=None).offsets == [0, 8]
    with aligned(128):
        assert align_numel() == 64
        wide = FlatBucket(params, 2, 0, align_bytes=None)
        assert FlatBucket(params, 2, 0).offsets == [0, 5]
    with aligned(1):
        plain = FlatBucket(params, 2, 0, align_bytes=None)
    assert flat.ALIGN_BYTES == 16  # restored
    assert wide.offsets == [0, 64] and wide.shard_numel == 64
    assert plain.offsets == [0, 5] and plain.shard_numel == 4
    for bad in (0, 3, 24, -16, 16.0):
        with pytest.raises(ValueError):
            align_numel(bad)
        with pytest.raises(ValueError):
            FlatBucket(params, 2, 0, align_bytes=bad)


@pytest.mark.parametrize("align", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_views_and_shards_are_aligned_in_memory(dtype, align):
    """The pointers themselves: every view, shard and segment of a buffer in each dtype starts a
    multiple of align bytes after the buffer's start, and so on an aligned address as far as the
    allocator aligns the buffer itself (PyTorch's CPU allocator: 64 bytes; CUDA's: 512)."""
    params = tensors_of([(211, 96), (381,), (96, 381), (7,), (1,), (13, 3)])
    for n in (2, 3):
        for r in range(n):
            b = FlatBucket(params, n, r, align_bytes=align)
            buf = b.flatten(params, dtype=dtype)
            assert buf.data_ptr() % 64 == 0
            shard = b.shard(buf)
            pointers = [v.data_ptr() for v in b.views(buf)] + [shard.data_ptr()]
            pointers += [shard[s.shard_lo:s.shard_hi].data_ptr() for s in b.segments]
            assert [(ptr - buf.data_ptr()) % align for ptr in pointers] == [0] * len(pointers), (n, r)
            assert [ptr % min(align, 64) for ptr in pointers] == [0] * len(pointers), (n, r)


def test_empty_bucket_rejected():
    with pytest.raises(ValueError):
        FlatBucket([], 2, 0)


def _flat_order(buckets):
    return [p for b in buckets for p in b.params]


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("cap", [1, 10, 25, 26, 40, 100, 1000])
def test_make_buckets_cap_and_reverse_order(cap, align):
    numels = [10, 3, 17, 1, 8, 30, 2, 9]
    params = [torch.zeros(k) for k in numels]
    buckets = make_buckets(params, 3, 1, bucket_numel=cap, align_bytes=align)
    # every parameter exactly once, in reverse order (backward produces the last layer first)
    order = _flat_order(buckets)
    assert len(order) == len(params)
    assert [id(p) for p in order] == [id(p) for p in reversed(params)]
    for b in buckets:
        assert b.align == elements(align)
        # the cap counts the parameters' elements (the alignment's padding comes on top)
        assert b.param_numel == sum(b.numels) and (b.param_numel <= cap or len(b.params) == 1), (cap, b.numels)
        assert b.world_size == 3 and b.rank == 1
    # greedy: a bucket is closed only when the next parameter would not fit
    for b, nxt in zip(buckets, buckets[1:]):
        assert b.param_numel + nxt.numels[0] > cap
    if cap >= sum(numels):
        assert len(buckets) == 1
    # which parameters share a bucket does not depend on the alignment
    assert [b.numels for b in buckets] == [b.numels for b in make_buckets(params, 3, 1, bucket_numel=cap)]


def test_parameter_larger_than_cap_gets_its_own_bucket():
    params = [torch.zeros(3), torch.zeros(50), torch.zeros(4), torch.zeros(5)]
    buckets = make_buckets(params, 2, 0, bucket_numel=10)
    assert [b.numels for b in buckets] == [[5, 4], [50], [3]]
    big = [b for b in buckets if 50 in b.numels][0]
    assert len(big.params) == 1 and big.params[0] is params[1]
    aligned_buckets = make_buckets(params, 2, 0, bucket_numel=10, align_bytes=16)  # the same buckets, padded
    assert [b.numels for b in aligned_buckets] == [[5, 4], [50], [3]] and aligned_buckets[0].offsets == [0, 8]


def test_make_buckets_default_one_bucket_in_order():
    params = [torch.zeros(k) for k in (4, 5, 6)]
    buckets = make_buckets(params, 4, 2)
    assert len(buckets) == 1 and [id(p) for p in buckets[0].params] == [id(p) for p in params]
    assert make_buckets([], 4, 2, bucket_numel=10) == []
