"""A training step of the lesson classes and the wrappers reads nothing back from a tensor.

On a GPU the Python that queues the work runs ahead of it, until it reads a value back: then it
waits for everything queued. `.item()`, `.tolist()`, `bool(t)` (an `if` on a tensor), `float(t)`,
`int(t)`, `.cpu()`, `.numpy()` are such reads; so is `torch.tensor(python_data, device=cuda)`,
a copy from ordinary host memory, which CUDA makes synchronously. On the CPU nothing waits, so
this test counts the calls instead (zerokit.bench.opcount.host_reads): in the ranks, those Tensor
methods and torch.tensor are replaced by counting ones for one whole step (forward, backward with
its hooks, step, zero_grad) after two warm-up steps. What each class may read, and why:

| class | reads a step | why |
|---|---|---|
| DistributedAdam, ZeRO1Adam, ZeRO2Adam, DataParallel, ZeRO1/ZeRO2 | 0 | every parameter has a gradient here |
| the same with a parameter no rank uses (EdgeCaseNet) | 1 per flat buffer with it | which parameters got a gradient on no rank: only the counts say |
| ZeRO1Adam(bucket_mb=...) | 1 | whether some rank's gradient changed after its bucket left (accumulation): only that rank knows |

torch's own optimizers inside the wrappers read their step counts (`step.item()`), tensors that
torch keeps in host memory on purpose; those are not counted.

Before (the same step, every parameter with a gradient): DistributedAdam, ZeRO1Adam (with and without
bucket_mb), ZeRO1(SGD) and ZeRO1(AdamW) read 1 and uploaded 1 (the presence counts, or flags),
DataParallel + SGD 1 and 1 per bucket (4 and 4 here).
"""

import contextlib

import pytest
import torch

import zerokit
from conftest import batch, new_model, run_ranks
from zerokit.bench.opcount import host_reads, host_side
from zerokit.models import loss_for

BATCH = 6


def _systems():
    """name -> a function of the model that returns (the model to call, the optimizer)."""
    def plain(make):
        return lambda model: (model, make(model))

    def data_parallel(model):
        model = zerokit.DataParallel(model, bucket_mb=0.002)  # a few buckets on the small models
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    return {
        "DistributedAdam": plain(lambda m: zerokit.DistributedAdam(m.parameters(), lr=1e-2)),
        "DistributedAdam foreach": plain(lambda m: zerokit.DistributedAdam(m.parameters(), lr=1e-2, foreach=True)),
        "ZeRO1Adam": plain(lambda m: zerokit.ZeRO1Adam(m.parameters(), lr=1e-2)),
        "ZeRO1Adam foreach": plain(lambda m: zerokit.ZeRO1Adam(m.parameters(), lr=1e-2, foreach=True)),
        "ZeRO1Adam bucket_mb": plain(lambda m: zerokit.ZeRO1Adam(m.parameters(), lr=1e-2, bucket_mb=0.002)),
        "ZeRO2Adam foreach": plain(lambda m: zerokit.ZeRO2Adam(m.parameters(), lr=1e-2, bucket_mb=0.002,
                                                               foreach=True)),
        "DataParallel + SGD": data_parallel,
        "ZeRO1(SGD)": plain(lambda m: zerokit.ZeRO1(m.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)),
        "ZeRO1(AdamW)": plain(lambda m: zerokit.ZeRO1(m.parameters(), torch.optim.AdamW, lr=1e-2)),
        "ZeRO2(AdamW) foreach": plain(lambda m: zerokit.ZeRO2(m.parameters(), torch.optim.AdamW, lr=1e-2,
                                                              bucket_mb=0.002, foreach=True)),
    }


def count_reads(rank, world_size, kinds):
    out = {}
    for kind in kinds:
        for name, build in _systems().items():
            model, opt = build(new_model(kind))
            for step in range(3):
                x, y = batch(kind, step, BATCH)
                x, y = x[rank::world_size], y[rank::world_size]
                with host_reads() if step == 2 else contextlib.nullcontext() as seen:
                    loss_for(kind, model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
            skip = host_side(opt)
            out[(kind, name)] = [(what, file.rpartition("/zerokit/")[2] or file) for what, t, file in seen
                                 if t is None or id(t) not in skip]
    return out


@pytest.mark.distributed
def test_a_step_reads_nothing_back_unless_a_parameter_has_no_gradient():
    got = run_ranks(count_reads, 2, ("mlp", "edge"))
    assert got[0].keys() == got[1].keys()
    for (kind, name), reads in got[0].items():
        if kind == "mlp":  # every parameter has a gradient on every rank
            expected = 1 if name == "ZeRO1Adam bucket_mb" else 0
        elif name.startswith("DataParallel"):
            # EdgeCaseNet's unused parameter sits in one bucket: that bucket's counts are read
            expected = 1
        else:  # one flat buffer (or one flag all-reduce) holds the unused parameter's presence
            expected = 1
        assert len(reads) == expected, f"{name} on {kind}: {len(reads)} host reads, expected {expected}: {reads}"
        assert all(what != "torch.tensor" for what, _ in reads), (name, kind, reads)
