r"""Offload: the optimizer state off the accelerator, to CPU memory or to disk (lesson 08).

ZeRO-3 leaves $K\Psi/N$ bytes of optimizer state per rank (fp32 master, m, v: $K = 12$ in
mixed precision, $K = 8$ in fp32, where the weights are their own master). Adam reads and
writes each element of it once per step, in an elementwise update: it needs no
accelerator, and it can be streamed. Two places to put it, one option on every ZeRO
optimizer:

    zerokit.ZeRO2Adam(model.parameters(), lr=1e-3, offload="disk")   # or "cpu", or Offload(...)

- **"cpu"** (ZeRO-Offload; a GPU run): m, v and an fp32 master of the shard in pinned
  host memory, and the Adam step on the CPU. The gradient shard is copied to the host
  chunk by chunk on a side stream while the CPU updates the chunks already there, and each
  updated chunk of weights is copied back as soon as it is done, so the copies overlap the
  CPU's arithmetic. The GPU keeps weights and gradients only: $(P + G)\Psi$ or less.
- **"disk"** (ZeRO-Infinity's NVMe idea, on any machine): m, v (and a separate master)
  in memory-mapped files in a private temporary folder, removed with the optimizer. A
  step maps one chunk of each file at a time: the pages of a chunk come into memory when
  Adam touches them and leave it (`madvise(MADV_DONTNEED)`; the kernel writes the changed
  ones back to the file) before the next chunk, so the process's resident memory holds a
  chunk, not the state: it drops by about $K\Psi/N$.

Numerics: the same `adamw_update_`, on the same elements in the same order (it is
elementwise: a chunk's result does not depend on the other chunks), so an offloaded
optimizer is bit-identical to the in-memory one.

A `Place` is what a ShardedAdamState asks where its tensors live and what to do around each
chunk of its update (zerokit.zero1): InMemory (no offload: plain tensors beside the
parameters, and nothing to do; zerokit.zero1's own), DiskPlace, PinnedPlace. This module knows
nothing of the stages but where to hand its `offload_place` (zerokit.zero1.register_offload):
lesson 03's module takes offload= without importing this later lesson's.
"""

import mmap
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass

import torch

from .memory import theory_bytes
from .zero1 import InMemory, register_offload

__all__ = ["Offload", "offload_place", "DiskTensor", "DiskPlace", "PinnedPlace", "offload_theory_bytes"]

PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Offload:
    """Where a ZeRO optimizer keeps its optimizer state; pass it (or just "cpu"/"disk") as offload=.

    device: "disk" (memory-mapped files) or "cpu" (pinned host memory; the parameters must
        be on a GPU).
    directory: "disk" only: where to create the private temporary folder (None: the
        system's temporary directory, $TMPDIR).
    chunk_mb: MiB of each state tensor streamed through Adam at a time.
    """

    device: str = "disk"
    directory: str | None = None
    chunk_mb: float = 1.0

    def __post_init__(self):
        if self.device not in ("disk", "cpu"):
            raise ValueError(f"offload device must be 'disk' or 'cpu', not {self.device!r}")
        if not self.chunk_mb > 0:
            raise ValueError(f"chunk_mb must be positive, not {self.chunk_mb}")

    @property
    def chunk_numel(self):
        """Elements per chunk (fp32), a whole number of pages: chunks never share a page."""
        per_page = PAGE // 4
        return max(per_page, int(self.chunk_mb * 2**20) // 4 // per_page * per_page)


def offload_place(offload, param_device):
    """The Place for an optimizer's offload= argument (None: InMemory, no offload)."""
    if offload is None:
        return InMemory(param_device)
    config = Offload(offload) if isinstance(offload, str) else offload
    if not isinstance(config, Offload):
        raise TypeError(f"offload= takes 'cpu', 'disk' or a zerokit.offload.Offload, not {type(offload).__name__}")
    if config.device == "cpu":
        if torch.device(param_device).type != "cuda":
            raise ValueError("offload='cpu' moves the optimizer state from the GPU to host memory, but the parameters "
                             "are on the CPU already; use offload='disk' to move it out of memory")
        return PinnedPlace(config)
    return DiskPlace(config)


register_offload(offload_place)  # ZeRO1Adam's offload= (and so every stage's) is answered here


# ---------------------------------------------------------------------------------------
# disk


class DiskTensor:
    """A 1-D tensor in a memory-mapped file: only the pages in use are in memory.

    t[a:b] is a torch view of elements [a, b) of the mapping: reading or writing it brings
    those pages into this process's memory. release(a, b) takes them out again.
    """

    def __init__(self, path, numel, dtype=torch.float32, init=None):
        self.path, self.numel, self.dtype = str(path), int(numel), dtype
        self.element_size = torch.empty(0, dtype=dtype).element_size()
        size = max(PAGE, -(-self.numel * self.element_size // PAGE) * PAGE)  # whole pages
        with open(self.path, "w+b") as f:
            f.truncate(size)  # a sparse file of zeros: nothing written yet
            self._map = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if init is not None:
            self.copy_from(init)

    def __getitem__(self, index):
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a DiskTensor is read in contiguous chunks: t[a:b]")
        lo, hi, _ = index.indices(self.numel)
        hi = max(lo, hi)
        return torch.frombuffer(self._map, dtype=self.dtype, count=hi - lo, offset=lo * self.element_size)

    def __len__(self):
        return self.numel

    def release(self, lo, hi):
        """Elements [lo, hi) leave this process's resident memory (every page they touch).

        MADV_DONTNEED on a shared file mapping only unmaps the pages: what was written is in
        the kernel's page cache, which writes it back to the file, and the next read maps it
        again. A page shared with a neighbouring chunk is released too, which is harmless.
        """
        start = lo * self.element_size // PAGE * PAGE
        end = -(-hi * self.element_size // PAGE) * PAGE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, min(end, len(self._map)) - start)

    def copy_from(self, tensor, chunk_numel=1 << 18):
        """Write a tensor's values into the file, a chunk at a time."""
        flat = tensor.detach().reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"{flat.numel()} elements into a DiskTensor of {self.numel}")
        for a in range(0, self.numel, chunk_numel):
            b = min(a + chunk_numel, self.numel)
            self[a:b].copy_(flat[a:b])
            self.release(a, b)

    def copy_to(self, tensor, chunk_numel=1 << 18):
        """Write the file's values into a tensor (any dtype, any device), a chunk at a time."""
        flat = tensor.view(-1)
        for a in range(0, self.numel, chunk_numel):
            b = min(a + chunk_numel, self.numel)
            flat[a:b].copy_(self[a:b])
            self.release(a, b)

    def read(self):
        """A copy of the whole tensor, in memory (to compare or save; it is resident while it lives)."""
        out = torch.empty(self.numel, dtype=self.dtype)
        self.copy_to(out)
        return out

    def close(self):
        try:
            self._map.close()
        except BufferError:  # a view someone still holds keeps the mapping; the file goes anyway
            pass


def _remove_folder(path, tensors):
    for t in tensors:
        t.close()
    shutil.rmtree(path, ignore_errors=True)


class DiskPlace:
    """One optimizer's state on disk: a private temporary folder of DiskTensors, removed
    when the optimizer is garbage-collected, at exit, or by close()."""

    offloaded = True
    needs_master = False  # Adam updates the weights where they are; only a separate master moves

    def __init__(self, config):
        self.config, self.chunk_numel = config, config.chunk_numel
        self.folder = tempfile.mkdtemp(prefix="zerokit-offload-", dir=config.directory)
        self._tensors = []
        self._cleanup = weakref.finalize(self, _remove_folder, self.folder, self._tensors)

    def new_tensor(self, name, numel, init=None):
        t = DiskTensor(os.path.join(self.folder, f"{len(self._tensors)}-{name}.f32"), numel, init=init)
        self._tensors.append(t)
        return t

    def hold(self, name, tensor):
        return self.new_tensor(name, tensor.numel(), init=tensor.detach().float())

    def begin(self, state, param_shard, grad_shard):
        return param_shard, grad_shard  # Adam runs where the gradient is: nothing to move

    def before_chunk(self, a, b):
        pass

    def after_chunk(self, state, param_shard, a, b):
        for t in (param_shard, state.master, state.exp_avg, state.exp_avg_sq):
            if isinstance(t, DiskTensor):
                t.release(a, b)

    def end(self):
        pass

    def copy_master(self, master, shard):
        master.copy_to(shard, self.chunk_numel)

    def close(self):
        self._cleanup()


# ---------------------------------------------------------------------------------------
# pinned host memory (GPU runs only: written to be read, not tested on a machine without one)


class PinnedPlace:
    """One optimizer's state in pinned host memory, the Adam step on the CPU (ZeRO-Offload).

    The CPU updates an fp32 master of the shard (a copy, in fp32 runs too) beside m and v.
    begin() starts copying the gradient shard to the host on a side stream, chunk by chunk,
    each chunk with an event; the CPU waits for a chunk's event only when Adam reaches it
    (before_chunk), so the copy of the later chunks overlaps the arithmetic on the earlier
    ones. The stage then copies the updated master into its shard of the weights on the GPU
    (copy_master), before it all-gathers or stores it.
    """

    offloaded = True
    needs_master = True

    def __init__(self, config):
        self.config, self.chunk_numel = config, config.chunk_numel
        self._down = torch.cuda.Stream()
        self._events = []

    def new_tensor(self, name, numel, init=None):
        t = torch.zeros(numel, dtype=torch.float32, pin_memory=True)
        if init is not None:
            t.copy_(init.reshape(-1))
        return t

    def hold(self, name, tensor):
        return self.new_tensor(name, tensor.numel(), init=tensor.detach().float())

    def begin(self, state, param_shard, grad_shard):
        if param_shard is not state.master:
            raise RuntimeError("offload='cpu': Adam must update the host master (the stage's _param_shard)")
        host_grad = torch.empty(grad_shard.numel(), dtype=grad_shard.dtype, pin_memory=True)
        self._down.wait_stream(torch.cuda.current_stream())  # the gradient is ready on the main stream
        self._events = []
        with torch.cuda.stream(self._down):
            for a in range(0, grad_shard.numel(), self.chunk_numel):
                b = min(a + self.chunk_numel, grad_shard.numel())
                host_grad[a:b].copy_(grad_shard[a:b], non_blocking=True)
                self._events.append(torch.cuda.Event())
                self._events[-1].record()
        grad_shard.record_stream(self._down)  # not reused by the allocator before the copies are done
        return param_shard, host_grad

    def before_chunk(self, a, b):
        for j in range(a // self.chunk_numel, (b - 1) // self.chunk_numel + 1):
            self._events[j].synchronize()  # this chunk of the gradient has reached the host

    def after_chunk(self, state, param_shard, a, b):
        pass

    def end(self):
        self._events = []

    def copy_master(self, master, shard):
        shard.copy_(master)  # host to GPU (and to 16 bits): the weights the next forward reads


# ---------------------------------------------------------------------------------------
# the theory (the measurement, resident memory, is in zerokit.memory)


def offload_theory_bytes(psi, stage, world_size, precision="fp32"):
    """Model-state bytes per rank with the optimizer state offloaded: {"device": what stays
    (parameters and gradients, zerokit.memory.theory_bytes), "offloaded": the K Psi part}."""
    t = theory_bytes(psi, stage, world_size, precision)
    return {"device": t["parameters"] + t["gradients"], "offloaded": t["optimizer_states"]}
