"""What a training step asks of a GPU, counted on the CPU: operations (kernel launches) and host reads.

    python -m zerokit.bench.opcount [--model small]

On a GPU a step's time is its kernels', unless the host cannot queue them fast enough: small kernels
cost their launch, and a read of a tensor's value into Python (`.item()`, `.tolist()`, `if tensor:`,
or `torch.tensor(data, device=cuda)`, a synchronous copy) stops the host until everything queued
has run. Both can be counted without a GPU, and unlike wall time on a shared CPU the counts are not
noise. At world size 1 (gloo), one step (forward, backward, step, zero_grad) after two warm-up steps:
- ops: top-level aten operations in torch.profiler's trace (an operation called by another, such as
  the per-tensor work of a `_foreach_` operation on the CPU, is not counted again), less those that
  launch nothing (views, allocations, reads of host-side numbers: NO_KERNEL): about one kernel
  launch each on a GPU, a `_foreach_` operation one per few dozen tensors;
- reads: what `host_reads()` records, less the step counts torch.optim keeps in host memory.

The optimizers are built as on a GPU: every one with foreach=True, which torch.optim's default
(foreach=None) chooses there and zerokit's classes follow, and ZeRO-1's update takes the whole
shard per call as it does on a GPU (no CPU cache chunks).
"""

import argparse
import contextlib
import inspect
import sys

import torch

__all__ = ["host_reads", "count_step", "main"]

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def host_reads():
    """Inside, every read of a tensor's value into Python, and every torch.tensor(...) that zerokit's own code
    makes from Python data, is recorded as (what, the tensor or None, the caller's file). torch's own code
    makes host-side tensors with torch.tensor (its optimizers' step counts): those are not uploads."""
    seen = []
    own = {name: name in vars(torch.Tensor) for name in READS}
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    make = torch.tensor

    def counted(name, method):
        def read(self, *args, **kwargs):
            seen.append((name, self, inspect.currentframe().f_back.f_code.co_filename))
            return method(self, *args, **kwargs)
        return read

    def upload(*args, **kwargs):
        caller = inspect.currentframe().f_back.f_code.co_filename
        if "/zerokit/" in caller:
            seen.append(("torch.tensor", None, caller))
        return make(*args, **kwargs)

    try:
        for name in READS:
            setattr(torch.Tensor, name, counted(name, saved[name]))
        torch.tensor = upload
        yield seen
    finally:
        torch.tensor = make
        for name in READS:
            if own[name]:
                setattr(torch.Tensor, name, saved[name])
            else:
                delattr(torch.Tensor, name)


def host_side(opt):
    """The ids of the step-count tensors torch's optimizers keep in host memory on purpose (reading them
    waits for nothing): in `opt`, the wrappers' local optimizers, ZeroRedundancyOptimizer's."""
    inner = getattr(opt, "local_optimizers", lambda: [])() + [getattr(opt, "optim", None), opt]
    return {id(s["step"]) for o in inner if isinstance(o, torch.optim.Optimizer)
            for s in o.state.values() if torch.is_tensor(s.get("step"))}


# operations that only make a new view of memory, allocate it, or read a host-side value: no kernel
NO_KERNEL = {f"aten::{name}" for name in (
    "view", "_unsafe_view", "view_as", "slice", "select", "as_strided", "transpose", "t", "permute", "expand",
    "expand_as", "unsqueeze", "squeeze", "reshape", "_reshape_alias", "flatten", "unflatten", "chunk", "split",
    "split_with_sizes", "unbind", "narrow", "detach", "detach_", "alias", "lift_fresh", "contiguous", "empty",
    "empty_like", "empty_strided", "resize_", "set_", "item", "_local_scalar_dense", "is_nonzero", "result_type")}


def _launches(event):
    """Whether this operation, or one it calls, does more than NO_KERNEL's (a reshape that copies does)."""
    return event.name not in NO_KERNEL or any(_launches(c) for c in event.cpu_children if c.name.startswith("aten::"))


def _top_level_ops(prof):
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += parent is None and _launches(event)
    return count


def count_step(model, opt, batches, model_cfg):
    """(top-level aten ops, host reads) of the last of `batches`' steps, the others warming up."""
    from torch.profiler import ProfilerActivity, profile

    from .workload import train_step

    for x, y in batches[:-1]:
        train_step(model, opt, x, y, model_cfg)
    x, y = batches[-1]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, opt, x, y, model_cfg)
    with host_reads() as seen:
        train_step(model, opt, x, y, model_cfg)
    skip = host_side(opt)
    return _top_level_ops(prof), sum(1 for _, t, _ in seen if t is None or id(t) not in skip)


CONFIGS = ("torch-ddp", "zerokit-ddp", "wrapper-ddp", "torch-zero1", "zerokit-zero1", "wrapper-zero1")


def _worker(rank, world_size, preset):
    import zerokit.zero1

    from .systems import CONFIGS as ALL, build
    from .workload import MODELS, rank_batch

    zerokit.zero1.ShardedAdamState.CPU_CHUNK = 1 << 62  # a GPU's update: the whole shard at once
    cfg = MODELS[preset]
    device = torch.device("cpu")
    out = {}
    for config in (c for c in ALL if c.name in CONFIGS):
        model, opt = build(config, cfg, device, seed=0, foreach=True)  # torch.optim's default on a GPU
        batches = [rank_batch(cfg, step, rank, world_size, device) for step in range(3)]
        out[config.name] = (config.label, *count_step(model, opt, batches, cfg))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m zerokit.bench.opcount", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a bench preset (zerokit.bench.workload.MODELS)")
    args = parser.parse_args(argv)
    import zerokit

    got = zerokit.launch(_worker, 1, args=(args.model,), backend="gloo", echo=False, timeout=600)[0]
    print(f"one step of the bench's '{args.model}' model at world size 1, optimizers as on a GPU (foreach)")
    print(f"{'configuration':<36} {'ops':>6} {'reads':>6}")
    for name in CONFIGS:
        label, ops, reads = got[name]
        print(f"{label:<36} {ops:>6} {reads:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
