"""Checks for lesson 00 (collectives): all-reduce built from reduce-scatter + all-gather.

    check_numerics(my_all_reduce)   every rank gets the elementwise sum over ranks, the shape
                                    kept (no padding left in), from a reduce-scatter and an
                                    all-gather (no dist.all_reduce)
    check_traffic(my_all_reduce)    the elements it moves equal dist.all_reduce's 2 x size
"""

import torch
import torch.distributed as dist

from ..comm import CommCounter
from .compare import assert_close
from .harness import passed, run_on_ranks
from .kit import alias

__all__ = ["check_numerics", "check_traffic"]


def _inputs(rank, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g).to(dtype)


def _call(fn, x):
    out = fn(x)
    if out is None:
        raise AssertionError("my_all_reduce returned None: return the summed tensor")
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"my_all_reduce returned a {type(out).__name__}, not a tensor")
    return out


def _all_reduce_case(rank, world_size, fn, sizes):
    volumes = {}
    for n in sizes:
        x = _inputs(rank, n)
        expected = x.clone()
        dist.all_reduce(expected)
        with CommCounter() as comm:
            out = _call(fn, x.clone())
        if tuple(out.shape) != tuple(x.shape):
            raise AssertionError(f"for a tensor of {n} elements the result has shape {tuple(out.shape)}, "
                                 f"expected {tuple(x.shape)} (did the padding stay in?)")
        assert_close(out, expected, f"the sum of a {n}-element tensor over {world_size} ranks")
        ops = comm.table()
        if "all_reduce" in ops:
            raise AssertionError("your function called dist.all_reduce: build it from a reduce-scatter and an all-gather")
        for op in ("reduce_scatter", "all_gather"):
            if op not in ops:
                raise AssertionError(f"your function made no {op.replace('_', '-')}: the exercise is to build "
                                     f"all-reduce from a reduce-scatter and an all-gather (it called: {sorted(ops) or 'nothing'})")
        volumes[n] = comm.volume()
    return volumes


def check_numerics(my_all_reduce, world_size=2, sizes=(8, 7)):
    """my_all_reduce(t) on every rank returns the elementwise sum of t over ranks."""
    __tracebackhide__ = True
    run_on_ranks(_all_reduce_case, world_size, args=(my_all_reduce, list(sizes)), what="my_all_reduce")
    passed(f"my_all_reduce sums correctly on {world_size} ranks for sizes {list(sizes)}, "
           "using a reduce-scatter and an all-gather")


def _volume_case(rank, world_size, fn, n):
    x = _inputs(rank, n)
    with CommCounter() as theirs:
        _call(fn, x.clone())
    with CommCounter() as torchs:
        dist.all_reduce(x.clone())
    return theirs.volume(), torchs.volume()


def check_traffic(my_all_reduce, world_size=2, size=1001):
    """The elements my_all_reduce moves equal dist.all_reduce's 2*size (up to padding)."""
    __tracebackhide__ = True
    results = run_on_ranks(_volume_case, world_size, args=(my_all_reduce, size), what="my_all_reduce")
    theirs, reference = results[0]
    padded = -(-size // world_size) * world_size
    if not reference <= theirs <= 2 * padded:
        raise AssertionError(
            f"my_all_reduce moved {theirs} elements for a {size}-element tensor on {world_size} ranks; "
            f"dist.all_reduce moves {reference} (2 x {size}), padding allows up to {2 * padded}")
    passed(f"my_all_reduce moves {theirs} elements, dist.all_reduce {reference}: the same volume "
           f"(reduce-scatter {padded} + all-gather {padded})")


check_all_reduce = alias(check_numerics, "check_all_reduce")
check_same_volume = alias(check_traffic, "check_same_volume")
