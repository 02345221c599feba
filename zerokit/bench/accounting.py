"""What one instrumented step records, per rank: collectives, and memory by category.

- **communication**: the step runs under `zerokit.CommCounter`, which sees every c10d and
  functional collective (DDP's reducer, ZeroRedundancyOptimizer's broadcasts and FSDP2's
  all-gathers and reduce-scatters included). Volume in the ZeRO paper's convention
  (all-reduce of Psi = 2 Psi; reduce-scatter, all-gather, broadcast of Psi = Psi); a ring
  puts (N-1)/N of it on the wire per rank. Theory: 2 Psi (ddp, zero1, zero2), 3 Psi (zero3).
- **memory**, sampled after every tensor operation, through the same dispatch mode:
  *total* = bytes the process has allocated (glibc `mallinfo2` in-use + mmapped on CPU,
  `torch.cuda.memory_allocated` / `max_memory_allocated` on GPU) above what it had before
  the configuration was built: everything, C++-held buffers (DDP buckets, gloo, autograd's
  saved activations) included. *parameters*, *gradients*, *optimizer_states*: bytes of the
  distinct storages each system holds in that role, classified with `zerokit.memory.census`'s
  rules (first claim wins: parameters, then gradients, then optimizer state); DTensors
  (FSDP2) count their local shard, and FSDP2's unsharded parameters and all-gather buffers
  count as parameters while they hold memory, torch's and zerokit's alike (`Held`). *other* =
  total - the three (activations, communication buffers, temporaries). Each column is its own
  peak over the step.
"""

import ctypes

import torch

from zerokit.comm import CommCounter
from zerokit.fully_shard.wrapper import FullyShard
from zerokit.fully_shard.wrapper import memory_categories as fully_shard_memory
from zerokit.memory import census
# what a system holds by category (zerokit.train.peers.holdings): the capstone's memory table counts the same
from zerokit.train.peers import MODEL_STATE, holdings


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


def _libc_mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _libc_mallinfo2()


def allocated_bytes(device) -> int:
    """Bytes this process has allocated right now on `device` (CPU: the whole C heap)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if _MALLINFO2 is None:
        return 0
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd  # in use in the arenas + large blocks (mmapped)


class Held:
    """What a system holds, for census: zerokit.train.peers.holdings (DDP's parameters, FSDP2's DTensor
    shards and buffers, the optimizers' state), and what zerokit.fully_shard's calls hold, read off their
    records (zerokit.fully_shard.wrapper.memory_categories: padded shards, gathered buffers, hpZ pieces,
    full local gradients, reductions in flight), which the module does not show while a call is gathered.
    A FullyShard is counted by the model inside it."""

    def __init__(self, model, optimizer):
        self.model = model.module if isinstance(model, FullyShard) else model
        self.optimizer = optimizer

    def memory_categories(self):
        cats = holdings(self.model, self.optimizer)
        for category, tensors in fully_shard_memory(self.model).items():
            cats[category] += tensors
        return cats


class Instrument(CommCounter):
    """Counts collectives (CommCounter) and samples memory after every tensor operation:
    the process's allocated bytes, and census(scan=False) of what the system holds."""

    def __init__(self, model, optimizer, device, baseline):
        super().__init__()
        self.model, self.optimizer, self.device, self.baseline = model, optimizer, device, baseline
        self.peak = dict.fromkeys(MODEL_STATE + ("other", "total"), 0)
        self.at_peak = {}  # the sample where the total was highest, and the operation before it
        self.samples = 0
        self._last_total = None

    def sample(self, op=None):
        total = allocated_bytes(self.device) - self.baseline
        if total == self._last_total and op is not None:
            return  # nothing allocated or freed by this operation (a view, a hook, ...)
        self._last_total = total
        held = census(None, Held(self.model, self.optimizer), self.device.type, scan=False)
        cats = {k: held[k] for k in MODEL_STATE}
        cats["other"] = max(total - sum(cats.values()), 0)
        cats["total"] = total
        for k, v in cats.items():
            self.peak[k] = max(self.peak[k], v)
        if total >= self.at_peak.get("total", -1):
            self.at_peak = {**cats, "after_op": op}
        self.samples += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.sample(str(func))
        return out

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.sample()
        if self.device.type == "cuda":  # includes temporaries inside a single operation
            self.peak["total"] = max(self.peak["total"], torch.cuda.max_memory_allocated(self.device) - self.baseline)
        return out
