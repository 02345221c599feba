"""Smoke test of every collective the course uses, on the pinned torch with gloo.

gloo's coverage changed across torch versions (reduce-scatter in particular), so each
collective, op and dtype the lessons rely on is exercised here on real ranks, and every
result is compared with a value computed by hand in this file (small integers, exact in
bf16 and fp16 too). One launch per world size runs all of them; ranks return what they got.
"""

import sys
import weakref

import pytest
import torch
import torch.distributed as dist

import zerokit
from conftest import run_ranks
from zerokit import collectives, comm
from zerokit.comm import WireCounter

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
K = 3  # elements per rank in the reduce-scatter / all-gather checks


def base(dtype):
    return torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype)


def max_input(rank, dtype):
    # a different rank holds the maximum of each element
    return torch.tensor([(rank * 5 + 1) % 7, (rank * 3 + 2) % 7, -rank, 10 - rank], dtype=dtype)


IMPLEMENTATIONS = {"torch": comm, "zerokit": collectives}  # what the lessons call; what zerokit's stages call


def collectives_worker(rank, world_size, impl):
    reduce_scatter, all_gather = IMPLEMENTATIONS[impl].reduce_scatter, IMPLEMENTATIONS[impl].all_gather
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
        # (torch's own reduce-scatter handle on gloo reports is_completed() == False after a
        # successful wait(): code that polls instead of waiting would spin forever there.)
        d["async_completed"] = [bool(w.is_completed()) for w in (w1, w2, w3)]
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
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_collective_on_gloo(world_size, impl):
    results = run_ranks(collectives_worker, world_size, impl)
    assert len(results) == world_size
    for rank, got in enumerate(results):
        for dtype in DTYPES:
            d = got[str(dtype)]
            assert d["ag_inplace_is_view"]
            # all-reduce, reduce-scatter, all-gather: torch's reduce-scatter alone says no after its wait()
            assert d["async_completed"] == [True, impl == "zerokit", True]
            for name, want in expected(rank, world_size, dtype).items():
                have = d[name]
                assert have.dtype == dtype, (rank, dtype, name, have.dtype)
                assert torch.equal(have, want), f"rank {rank} {dtype} {name}: {have.tolist()} != {want.tolist()}"


def test_course_uses_the_single_tensor_spellings():
    """zerokit.comm's collectives, and zerokit.collectives' where they are torch's, are the torch
    2.13 names (the *_tensor ones warn, see pyproject)."""
    assert comm.reduce_scatter is collectives._torch_reduce_scatter is dist.reduce_scatter_single
    assert comm.all_gather is collectives._torch_all_gather is dist.all_gather_single


S = 60_000  # elements per rank: large enough that gloo's few header bytes are well under 1%


def wire_worker(rank, world_size):
    """Bytes this rank writes for one reduce-scatter and one all-gather, zerokit's and torch's,
    and what CommCounter calls each; zerokit's results must equal torch's."""
    torch.manual_seed(rank)
    inp = torch.randint(-50, 50, (world_size * S,)).float()  # small integers: exact in any sum order
    out = {}
    for name, impl in IMPLEMENTATIONS.items():
        rs, ag = impl.reduce_scatter, impl.all_gather
        shard, full = torch.empty(S), torch.empty(world_size * S)
        dist.barrier()
        with WireCounter() as rs_wire, zerokit.CommCounter() as rs_count:
            rs(shard, inp, op=dist.ReduceOp.AVG)
        dist.barrier()
        with WireCounter() as ag_wire, zerokit.CommCounter() as ag_count:
            ag(full, shard)
        dist.barrier()
        out[name] = {"rs": rs_wire.sent_bytes, "ag": ag_wire.sent_bytes, "full": full,
                     "counted": [(c.op, c.numel) for c in rs_count.calls + ag_count.calls]}
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_zerokit_collectives_send_the_rings_bytes_on_gloo(world_size):
    """gloo's own reduce-scatter writes as many bytes as its all-reduce, 2 S (N-1) elements per
    rank (lesson 00); zerokit's writes the ring's S (N-1), as both all-gathers do. The counter
    sees one reduce-scatter and one all-gather either way, and the numbers are torch's."""
    ring = 4 * S * (world_size - 1)  # fp32 bytes a rank sends in a ring, either collective
    for got in run_ranks(wire_worker, world_size):
        mine, theirs = got["zerokit"], got["torch"]
        assert mine["counted"] == theirs["counted"] == [("reduce_scatter", world_size * S),
                                                         ("all_gather", world_size * S)]
        assert torch.equal(mine["full"], theirs["full"])
        assert ring <= mine["rs"] < 1.01 * ring and ring <= mine["ag"] < 1.01 * ring, mine
        assert theirs["rs"] > 1.9 * ring, theirs  # why zerokit has its own on gloo


def release_worker(rank, world_size, rounds):
    """Async reduce-scatters whose input only the transfer holds: once wait() returns, nothing of
    it may be alive (a caller measuring memory right after must not see it). The switch interval
    is cut so that the waiting thread gets the interpreter as early as it ever can."""
    interval, alive, out = sys.getswitchinterval(), 0, torch.empty(S)
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(rounds):
            inp = torch.full((world_size * S,), float(rank))
            held = weakref.ref(inp)
            work = collectives.reduce_scatter(out, inp, async_op=True)
            del inp
            work.wait()
            alive += held() is not None
    finally:
        sys.setswitchinterval(interval)  # the process may serve other tests
    return alive, float(out[0])


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_async_reduce_scatter_holds_nothing_once_waited_for():
    for alive, first in run_ranks(release_worker, 2, 300):
        assert first == 1.0  # 0 + 1, the sum of the ranks
        assert alive == 0, f"the input was still alive after wait() in {alive} of 300 rounds"
