"""Checks for lesson 00 (collectives): all-reduce built from reduce-scatter + all-gather.

    check_numerics(my_all_reduce)   every rank gets the elementwise sum over ranks, the shape
                                    kept (no padding left in), from a reduce-scatter and an
                                    all-gather (no dist.all_reduce)
    check_traffic(my_all_reduce)    the elements it moves equal dist.all_reduce's 2 x size
"""

import torch
import torch.distributed as dist

from ..comm import CommCounter
from ..launcher import rank_device
from .compare import assert_close
from .harness import CheckFailed, passed, run_on_ranks
from .kit import alias

__all__ = ["check_numerics", "check_traffic"]

_TENSORS = "n/a: my_all_reduce reduces tensors; no model, optimizer or unit is involved"
# which of kit.SITUATIONS the hidden tests meet (tests/test_situations.py holds this to them)
SITUATIONS = {
    "n3": "check_numerics: world_size=3",  # 3 ranks on sizes 1, 5 and 100: chunks of unequal length
    **{s: _TENSORS for s in ("zero-grad-shard", "frozen", "tied", "unused", "tuple-output", "root-params",
                             "eval-no-grad", "sits-out", "zero3", "out-of-order")},
    "subgroup": "n/a: the exercise's signature takes no group; lesson 00 teaches the collective itself",
    "fp16-scale": "n/a: no loss, so no loss scale; the checks reduce float32 tensors",
    "peak-memory": "n/a: lesson 00 states a traffic rule (2(N-1)/N of the data per rank), checked as such, "
                   "and no memory rule",
}


def _inputs(rank, n, dtype=torch.float32):
    """This rank's input, on the rank's device (the CPU under gloo; a GPU under NCCL, or under
    gloo with ZEROKIT_DEVICE=cuda, as `make gpu-check` runs this check)."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g).to(dtype).to(rank_device())


def _call(fn, x):
    out = fn(x)
    if out is None:
        raise AssertionError("my_all_reduce returned None: return the summed tensor")
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"my_all_reduce returned a {type(out).__name__}, not a tensor")
    if out.device != x.device:
        raise AssertionError(f"my_all_reduce returned a tensor on {out.device} for an input on {x.device}: "
                             "create every buffer on the input's device (device=tensor.device)")
    return out


def _close(a, b):
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-5))


def _why_wrong(out, expected, mine, world_size):
    """Which classic mistake turns the inputs into this wrong result, in a sentence; '' if none."""
    out, expected, mine = out.detach().cpu(), expected.cpu(), mine.cpu()
    if _close(out * world_size, expected):
        return (f". It is the sum divided by N = {world_size}, the mean: an all-reduce sums (ReduceOp.SUM), "
                "so do not divide")
    if _close(out, mine):
        return (". It is still this rank's own tensor: the sum never reached what you return (the collectives "
                "write into their output tensors, in place)")
    if _close(out.sort().values, expected.sort().values):
        return (". The right values in the wrong places: element i of the result must be the sum of element i "
                "over the ranks, so each chunk of the sum goes back where it came from (chunk r at elements "
                "r*k to (r+1)*k - 1)")
    return ""


def _all_reduce_case(rank, world_size, fn, sizes):
    volumes = {}
    for n in sizes:
        x = _inputs(rank, n)
        expected = x.clone()
        dist.all_reduce(expected)
        with CommCounter() as comm:
            out = _call(fn, x.clone())
        if tuple(out.shape) != tuple(x.shape):
            why = ("did the padding stay in? Return only the first numel elements" if out.numel() > n else
                   "only this rank's chunk? The all-gather brings every rank's chunk back" if out.numel() < n else
                   "return it in the input's shape")
            raise AssertionError(f"for a tensor of {n} elements the result has shape {tuple(out.shape)}, "
                                 f"expected {tuple(x.shape)} ({why})")
        try:
            assert_close(out, expected, f"the sum of a {n}-element tensor over {world_size} ranks")
        except AssertionError as exc:
            raise AssertionError(f"{exc}{_why_wrong(out, expected, x, world_size)}") from None
        ops = comm.table()
        if "all_reduce" in ops:
            raise AssertionError("your function called dist.all_reduce: build it from a reduce-scatter and an all-gather")
        for op in ("reduce_scatter", "all_gather"):
            if op not in ops:
                called = ", ".join(o.replace("_", "-") for o in sorted(ops)) or "no collective"
                raise AssertionError(f"your function made no {op.replace('_', '-')}: the exercise is to build "
                                     f"all-reduce from a reduce-scatter and an all-gather (it called: {called})")
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
    calls = {op: (row["calls"], row["volume"]) for op, row in theirs.table().items()}
    return theirs.volume(), torchs.volume(), calls


def _said(calls):
    """'reduce-scatter x1 (1002 elements) + all-gather x1 (1002 elements)': what was counted."""
    return " + ".join(f"{op.replace('_', '-')} x{k} ({v} elements)" for op, (k, v) in calls.items()) or "no collective"


def check_traffic(my_all_reduce, world_size=2, size=1001):
    """The elements my_all_reduce moves equal dist.all_reduce's 2*size (up to padding)."""
    __tracebackhide__ = True
    results = run_on_ranks(_volume_case, world_size, args=(my_all_reduce, size), what="my_all_reduce")
    theirs, reference, calls = results[0]
    padded = -(-size // world_size) * world_size
    if not reference <= theirs <= 2 * padded:
        why = ""
        gathered = calls.get("all_gather", (0, 0))[1]
        if gathered > padded and "reduce_scatter" not in calls:
            why = (f": it made no reduce-scatter, so its all-gather of {gathered} elements moves every rank's whole "
                   f"tensor ({world_size} x {size}); reduce-scatter first, and each rank gathers only its chunk of "
                   "the sum")
        elif gathered > padded:
            why = (f": its all-gather of {gathered} elements moves more than the {padded}-element (padded) sum; "
                   "gather only the reduce-scatter's chunk")
        raise CheckFailed(
            f"my_all_reduce moved {theirs} elements for a {size}-element tensor on {world_size} ranks "
            f"({_said(calls)}); dist.all_reduce moves {reference} (2 x {size}), padding allows up to "
            f"{2 * padded}{why}")
    passed(f"my_all_reduce moves {theirs} elements on {world_size} ranks ({_said(calls)}), dist.all_reduce "
           f"{reference}: the same volume, up to the padding")


check_all_reduce = alias(check_numerics, "check_all_reduce")
check_same_volume = alias(check_traffic, "check_same_volume")
