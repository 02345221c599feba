"""Smoke test of every collective the course uses, on the pinned torch with gloo.

gloo's coverage changed across torch versions (reduce-scatter in particular), so each
collective, op and dtype the lessons rely on is exercised here on real ranks, and every
result is compared with a value computed by hand in this file (small integers, exact in
bf16 and fp16 too). One launch per world size runs all of them; ranks return what they got.
"""

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from zerokit.comm import all_gather, reduce_scatter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
K = 3  # elements per rank in the reduce-scatter / all-gather checks


def base(dtype):
    return torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype)


def max_input(rank, dtype):
    # a different rank holds the maximum of each element
    return torch.tensor([(rank * 5 + 1) % 7, (rank * 3 + 2) % 7, -rank, 10 - rank], dtype=dtype)


def collectives_worker(rank, world_size):
    out = {}
    for dtype in DTYPES:
        d = {}
        b = torch.full((4,), float(rank), dtype=dtype)
        dist.broadcast(b, src=world_size - 1)
        d["broadcast"] = b

        x = base(dtype) * (rank + 1)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        d["sum"] = x

        x = base(dtype) * (rank + 1) * 2  # mean is (N+1) * base: exact for N = 2, 3, 4
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        d["avg"] = x

        x = max_input(rank, dtype)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        d["max"] = x

        inp = torch.arange(world_size * K, dtype=dtype) + 10 * rank
        o = torch.full((K,), -99.0, dtype=dtype)
        reduce_scatter(o, inp, op=dist.ReduceOp.SUM)
        d["rs_sum"] = o

        inp = (torch.arange(world_size * K, dtype=dtype) + 2 * rank) * 2
        o = torch.empty(K, dtype=dtype)
        reduce_scatter(o, inp, op=dist.ReduceOp.AVG)
        d["rs_avg"] = o

        full = torch.full((world_size * K,), -99.0, dtype=dtype)
        all_gather(full, torch.arange(K, dtype=dtype) + 100 * rank)
        d["ag"] = full

        # in place: the input is this rank's slice (a view) of the output buffer
        full = torch.zeros(world_size * K, dtype=dtype)
        mine = full[rank * K:(rank + 1) * K]
        mine.copy_(torch.arange(K, dtype=dtype) + 100 * rank)
        all_gather(full, mine)
        d["ag_inplace"] = full
        d["ag_inplace_is_view"] = mine.data_ptr() == full.data_ptr() + rank * K * full.element_size()

        # async handles: start all three, then wait
        a = base(dtype) * (rank + 1)
        w1 = dist.all_reduce(a, op=dist.ReduceOp.SUM, async_op=True)
        ro = torch.empty(K, dtype=dtype)
        w2 = reduce_scatter(ro, torch.arange(world_size * K, dtype=dtype) + 10 * rank,
                            op=dist.ReduceOp.SUM, async_op=True)
        go = torch.empty(world_size * K, dtype=dtype)
        w3 = all_gather(go, torch.arange(K, dtype=dtype) + 100 * rank, async_op=True)
        handles = (w1, w2, w3)
        for w in handles:
            w.wait()
        # Only the values are checked after wait(): on torch 2.13 + gloo the reduce-scatter
        # handle still reports is_completed() == False after a successful wait(), so code
        # that polls is_completed() instead of calling wait() would spin forever.
        d["async_completed"] = [bool(w.is_completed()) for w in (w1, w3)]
        d["async_sum"], d["async_rs"], d["async_ag"] = a, ro, go
        out[str(dtype)] = d
    dist.barrier()
    return out


def expected(rank, n, dtype):
    """What each collective must return on `rank` of n, computed by hand."""
    t = lambda xs: torch.tensor(xs, dtype=dtype)  # noqa: E731
    tri = n * (n + 1) // 2
    rs_sum = [n * (rank * K + i) + 10 * (n * (n - 1) // 2) for i in range(K)]
    # mean over j of 2 * (rank*K + i + 2j) = 2 * (rank*K + i) + 2 * (n - 1)
    rs_avg = [2 * (rank * K + i) + 2 * (n - 1) for i in range(K)]
    ag = [100 * j + i for j in range(n) for i in range(K)]
    maxes = [max(float(max_input(j, torch.float32)[i]) for j in range(n)) for i in range(4)]
    return {
        "broadcast": t([n - 1] * 4),
        "sum": t([tri * v for v in (1, 2, 3, 4)]),
        "avg": t([(n + 1) * v for v in (1, 2, 3, 4)]),
        "max": t(maxes),
        "rs_sum": t(rs_sum),
        "rs_avg": t(rs_avg),
        "ag": t(ag),
        "ag_inplace": t(ag),
        "async_sum": t([tri * v for v in (1, 2, 3, 4)]),
        "async_rs": t(rs_sum),
        "async_ag": t(ag),
    }


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_collective_on_gloo(world_size):
    results = run_ranks(collectives_worker, world_size)
    assert len(results) == world_size
    for rank, got in enumerate(results):
        for dtype in DTYPES:
            d = got[str(dtype)]
            assert d["ag_inplace_is_view"]
            assert d["async_completed"] == [True, True]  # all-reduce, all-gather
            for name, want in expected(rank, world_size, dtype).items():
                have = d[name]
                assert have.dtype == dtype, (rank, dtype, name, have.dtype)
                assert torch.equal(have, want), f"rank {rank} {dtype} {name}: {have.tolist()} != {want.tolist()}"


def test_course_uses_the_single_tensor_spellings():
    """zerokit.comm exposes the torch 2.13 names (the *_tensor ones warn, see pyproject)."""
    assert reduce_scatter is dist.reduce_scatter_single
    assert all_gather is dist.all_gather_single
