"""Flat buffers and shards (zerokit.flat): padding, ranges, segments, views, buckets.

Sizes are chosen so that neither the parameters nor their total divide evenly by N.
"""

import math

import pytest
import torch

from zerokit.flat import FlatBucket, make_buckets, padded_numel, shard_range

pytestmark = pytest.mark.timeout(60)

SIZE_SETS = [
    [(5,), (2,), (4,)],  # the module docstring's example: 11 elements
    [(3, 7), (7,), (1,), (2, 5, 3)],  # 59
    [(1,)],
    [(13, 19), (19,), (19, 13), (13,), (11,)],  # 526
    [(4, 4)],  # 16: divisible by 1, 2 and 4, not by 3 or 5
]
WORLD_SIZES = [1, 2, 3, 4, 5]


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


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("shapes", SIZE_SETS, ids=lambda s: str(sum(math.prod(x) for x in s)))
def test_segments_cover_every_element_exactly_once(shapes, n):
    params = tensors_of(shapes)
    numels = [t.numel() for t in params]
    total = sum(numels)
    covered = [torch.zeros(k, dtype=torch.int64) for k in numels]
    shard_hits = torch.zeros(padded_numel(total, n), dtype=torch.int64)
    for r in range(n):
        b = FlatBucket(params, n, r)
        assert b.numel == total and b.padded_numel == padded_numel(total, n)
        assert b.shard_numel * n == b.padded_numel and b.shard_numel == math.ceil(total / n)
        assert (b.shard_start, b.shard_end) == shard_range(total, n, r)
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        for s in b.segments:
            assert 0 <= s.shard_lo < s.shard_hi <= b.shard_numel
            assert 0 <= s.param_lo < s.param_hi <= numels[s.index]
            assert s.shard_hi - s.shard_lo == s.param_hi - s.param_lo
            # the segment sits where the parameter sits in the flat layout
            assert b.shard_start + s.shard_lo == offsets[s.index] + s.param_lo
            covered[s.index][s.param_lo:s.param_hi] += 1
            shard_hits[b.shard_start + s.shard_lo:b.shard_start + s.shard_hi] += 1
    for c in covered:
        assert torch.equal(c, torch.ones_like(c)), "some element is owned by no rank or by two"
    # only the padding at the end of the last shard(s) is owned by no parameter
    assert shard_hits[:total].eq(1).all() and shard_hits[total:].eq(0).all()


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("shapes", SIZE_SETS, ids=lambda s: str(sum(math.prod(x) for x in s)))
def test_flatten_views_and_shards(shapes, n):
    params = tensors_of(shapes, seed=n)
    for r in range(n):
        b = FlatBucket(params, n, r)
        flat = b.flatten(params)
        assert flat.shape == (b.padded_numel,) and flat.dtype == params[0].dtype
        expected = torch.cat([t.reshape(-1) for t in params])
        assert torch.equal(flat[:b.numel], expected)
        assert flat[b.numel:].eq(0).all()  # padding is zeros

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


def test_none_means_zeros():
    params = tensors_of([(3,), (4,), (2,)])
    for r in range(3):
        b = FlatBucket(params, 3, r)
        flat = b.flatten([params[0], None, params[2]])
        assert torch.equal(flat, torch.cat([params[0], torch.zeros(4), params[2], torch.zeros(0)]))
        assert torch.equal(b.shard_of([params[0], None, params[2]]), b.shard(flat))


def test_dtype_and_shape_kept():
    params = [torch.ones(2, 3, dtype=torch.float64), torch.ones(5, dtype=torch.float64)]
    b = FlatBucket(params, 4, 3)
    assert b.empty().dtype == torch.float64 and b.empty().shape == (12,)  # 11 elements, padded for 4 ranks
    assert b.flatten(params, dtype=torch.float32).dtype == torch.float32
    assert b.shapes == [torch.Size([2, 3]), torch.Size([5])]


def test_empty_bucket_rejected():
    with pytest.raises(ValueError):
        FlatBucket([], 2, 0)


def _flat_order(buckets):
    return [p for b in buckets for p in b.params]


@pytest.mark.parametrize("cap", [1, 10, 25, 26, 40, 100, 1000])
def test_make_buckets_cap_and_reverse_order(cap):
    numels = [10, 3, 17, 1, 8, 30, 2, 9]
    params = [torch.zeros(k) for k in numels]
    buckets = make_buckets(params, 3, 1, bucket_numel=cap)
    # every parameter exactly once, in reverse order (backward produces the last layer first)
    order = _flat_order(buckets)
    assert len(order) == len(params)
    assert [id(p) for p in order] == [id(p) for p in reversed(params)]
    for b in buckets:
        assert b.numel <= cap or len(b.params) == 1, (cap, b.numels)
        assert b.world_size == 3 and b.rank == 1
    # greedy: a bucket is closed only when the next parameter would not fit
    for b, nxt in zip(buckets, buckets[1:]):
        assert b.numel + nxt.numels[0] > cap
    if cap >= sum(numels):
        assert len(buckets) == 1


def test_parameter_larger_than_cap_gets_its_own_bucket():
    params = [torch.zeros(3), torch.zeros(50), torch.zeros(4), torch.zeros(5)]
    buckets = make_buckets(params, 2, 0, bucket_numel=10)
    assert [b.numels for b in buckets] == [[5, 4], [50], [3]]
    big = [b for b in buckets if 50 in b.numels][0]
    assert len(big.params) == 1 and big.params[0] is params[1]


def test_make_buckets_default_one_bucket_in_order():
    params = [torch.zeros(k) for k in (4, 5, 6)]
    buckets = make_buckets(params, 4, 2)
    assert len(buckets) == 1 and [id(p) for p in buckets[0].params] == [id(p) for p in params]
    assert make_buckets([], 4, 2, bucket_numel=10) == []
