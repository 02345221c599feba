r"""Model-state memory: the ZeRO paper's theory, and a measurement per rank by category.

Theory. With $\Psi$ parameters, mixed-precision Adam holds $2\Psi$ bytes of fp16/bf16
weights, $2\Psi$ of fp16/bf16 gradients and $K\Psi$ of optimizer state with $K = 12$
(fp32 master weights, m and v): $16\Psi$ in all. Plain fp32 training holds $4\Psi + 4\Psi$
and $K = 8$ (m and v; the fp32 weights are their own master copy). On N ranks:

| stage | parameters | gradients | optimizer state |
|---|---|---|---|
| data parallel | $P\Psi$ | $G\Psi$ | $K\Psi$ |
| ZeRO-1 ($P_{os}$) | $P\Psi$ | $G\Psi$ | $K\Psi/N$ |
| ZeRO-2 ($P_{os+g}$) | $P\Psi$ | $G\Psi/N$ | $K\Psi/N$ |
| ZeRO-3 ($P_{os+g+p}$) | $P\Psi/N$ | $G\Psi/N$ | $K\Psi/N$ |

Measurement. `census()` finds every live tensor of the process through Python's garbage
collector (plus each parameter's .grad), counts each underlying storage once, and files it
under the first category that claims it (a DTensor, as zerokit.fully_shard's and FSDP2's
parameters, gradients and optimizer state are, has no storage of its own: it is counted by
its local tensor, this rank's rows): a model parameter's storage is "parameters", a
.grad's is "gradients", what the optimizer holds is "optimizer_states" (its `state`, or
what a zerokit optimizer lists in `memory_categories()`), and everything else live is
"other" (data, activations kept by Python, buffers). `memory_categories()` is the one way
an optimizer tells what it holds, model state in transit included: a ZeRO-3 all-gather in
flight (a prefetched unit) is parameters, a ZeRO-1/2/3 reduce-scatter's flat input and output
shard are gradients; census reads no optimizer's private fields. Tensors that only C++ holds (the
activations autograd saved for backward) are invisible to it; on a GPU,
`torch.cuda.max_memory_allocated` gives the true peak including them.
`MemoryProbe` takes a census at many points of a training step (after each module's
forward, as gradients arrive, around the optimizer step) and keeps the peak per category,
where it was seen, and the census right after the step (model state at rest).
`PeakRSS` measures what no census sees: the highest resident memory of the whole process
inside a block (tensors, numpy arrays, Python bytes, file buffers alike), from the kernel's
own high-water mark (lesson 07: the peak while saving and loading a checkpoint). Lesson 08
compares the resident memory of two runs at rest, `settled_resident_bytes()`: offloading the
optimizer state to disk changes pages, not tensors the census could count.
"""

import gc
from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

__all__ = ["CATEGORIES", "theory_bytes", "census", "MemoryProbe", "PeakRSS", "resident_bytes",
           "settled_resident_bytes", "format_bytes"]

CATEGORIES = ("parameters", "gradients", "optimizer_states", "other")
STAGES = ("ddp", "zero1", "zero2", "zero3")
# bytes per parameter: (weights, gradients, optimizer state K)
PRECISION = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


def theory_bytes(psi: int, stage: str, world_size: int, precision: str = "fp32") -> dict:
    """Model-state bytes per rank for `stage` on `world_size` ranks (see the table above)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
    if precision not in PRECISION:
        raise ValueError(f"precision must be one of {tuple(PRECISION)}, not {precision!r}")
    p, g, k = PRECISION[precision]
    n = world_size
    level = STAGES.index(stage)  # 0 = nothing sharded ... 3 = everything sharded
    out = {
        "parameters": p * psi / (n if level >= 3 else 1),
        "gradients": g * psi / (n if level >= 2 else 1),
        "optimizer_states": k * psi / (n if level >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


@torch.no_grad()  # to_local() of a parameter would otherwise record an autograd node per call
def _local(t):
    """The tensor that holds t's bytes: a DTensor's local tensor (a wrapper has no storage), else t."""
    while isinstance(t, DTensor):
        t = t.to_local()
    return t


def _storage_key(t):
    s = _local(t).untyped_storage()
    return (s.device.type, s.data_ptr()), s.nbytes()


def _optimizer_tensors(optimizer):
    """{category: [tensors]} the optimizer holds."""
    out = defaultdict(list)
    if optimizer is None:
        return out
    declared = getattr(optimizer, "memory_categories", None)
    if declared is not None:
        for cat, tensors in declared().items():
            out[cat].extend(tensors)
    for state in getattr(optimizer, "state", {}).values():
        for v in state.values() if isinstance(state, dict) else ():
            if isinstance(v, torch.Tensor):
                out["optimizer_states"].append(v)
    return out


def census(model=None, optimizer=None, device=None, scan=True) -> dict:
    """Bytes of live tensor storage in this process by category (see module docstring).

    device: only count storages on this device type ("cpu", "cuda"); default: the device
    of the model's first parameter, else cpu.
    scan: look at every live tensor through the garbage collector (~0.1 s in a process
    with torch loaded). scan=False counts only what the model and optimizer hold (fast;
    "other" is then 0): enough to follow the model-state categories through a step.
    """
    if device is None:
        first = next(iter(model.parameters()), None) if model is not None else None
        device = first.device.type if first is not None else "cpu"
    device = torch.device(device).type
    claimed = {}  # storage key -> category, first claim wins

    def claim(tensors, category):
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == device:
                key, _ = _storage_key(t)
                if key[1] != 0:
                    claimed.setdefault(key, category)

    declared = _optimizer_tensors(optimizer)
    if model is not None:
        claim(model.parameters(), "parameters")
    claim(declared.get("parameters", []), "parameters")
    if model is not None:
        claim([p.grad for p in model.parameters() if p.grad is not None], "gradients")
    claim(declared.get("gradients", []), "gradients")
    claim(declared.get("optimizer_states", []), "optimizer_states")

    sizes = {}
    extra = []
    if model is not None:
        extra = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    for cat in ("parameters", "gradients", "optimizer_states"):
        extra += declared.get(cat, [])
    tensor = torch.Tensor
    for obj in (gc.get_objects() if scan else []) + extra:
        # type(), not isinstance(): the latter reads obj.__class__, which some objects
        # (torch.distributed.reduce_op) answer with a deprecation warning
        if issubclass(type(obj), tensor) and not obj.is_meta and obj.device.type == device:
            try:
                key, nbytes = _storage_key(obj)
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                continue
            if key[1] != 0:
                sizes[key] = max(sizes.get(key, 0), nbytes)
    out = dict.fromkeys(CATEGORIES, 0)
    for key, nbytes in sizes.items():
        out[claimed.get(key, "other")] += nbytes
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


class MemoryProbe:
    """Peak live bytes per category over a training step, sampled at many points.

        probe = MemoryProbe(model, opt)
        with probe:
            loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
        probe.peak        # {category: bytes} (each category's own peak)
        probe.peak_where  # {category: where that peak was seen}, e.g. "forward Block", "grad blocks.0.fc.weight"
        probe.at_peak     # the census at the moment the total was highest
        probe.after_step  # the census right after opt.step(): model state at rest (see below)
        probe.trace       # with trace=True: [(where, census), ...], every sample in order

    Where it samples: before and after every module's forward (after the optimizer's own
    hooks on that module, registered first), after each parameter's gradient is
    accumulated (likewise after the optimizer's hook, so a bucket that just filled is
    already on its way), and before and after the optimizer step (with a full scan).

    At rest: after step() and before zero_grad() every category holds its steady-state
    storage and nothing is in transit (the gradients of DP and ZeRO-1 are still the full
    ones, ZeRO-2/3 hold only their reduced shards, ZeRO-3 no gathered unit): the moment
    the ZeRO paper's per-stage figures describe. (After zero_grad() the gradients are
    freed in every stage.)
    """

    def __init__(self, model, optimizer=None, device=None, trace=False):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.peak = dict.fromkeys(CATEGORIES + ("total",), 0)
        self.peak_where = dict.fromkeys(CATEGORIES + ("total",), None)
        self.at_peak = dict(self.peak)
        self.after_step = None
        self.samples = 0
        self.trace = [] if trace else None
        self.cuda_peak = None
        self._handles = []

    def sample(self, *_args, scan=False, where="", **_kwargs):
        c = census(self.model, self.optimizer, self.device, scan=scan)
        self.samples += 1
        if self.trace is not None:
            self.trace.append((where, c))
        for k, v in c.items():
            if v > self.peak[k] or self.peak_where[k] is None:
                self.peak[k], self.peak_where[k] = v, where
        if c["total"] >= self.at_peak["total"]:
            self.at_peak = c
        if where == "after step":
            self.after_step = c
        # returns None: a hook that returns something replaces the module's input or output

    def full_sample(self, *_args, where="", **_kwargs):
        self.sample(scan=True, where=where)

    def __enter__(self):
        gc.collect()
        self.full_sample(where="start")
        names = {p: n for n, p in self.model.named_parameters()}

        def on_module(when, module):
            return lambda *_: self.sample(where=f"{when} {type(module).__name__}")

        for m in self.model.modules():
            self._handles.append(m.register_forward_hook(on_module("forward", m)))
            self._handles.append(m.register_forward_pre_hook(on_module("before forward", m)))
        for p in self.model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda _p, name=names[p]: self.sample(where=f"grad {name}")))
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            self._handles.append(self.optimizer.register_step_pre_hook(
                lambda *_: self.full_sample(where="before step")))
            self._handles.append(self.optimizer.register_step_post_hook(
                lambda *_: self.full_sample(where="after step")))
        if torch.cuda.is_available() and (self.device or "").startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.full_sample(where="end")
        if torch.cuda.is_available() and (self.device or "").startswith("cuda"):
            self.cuda_peak = torch.cuda.max_memory_allocated()
        return False


# ---------------------------------------------------------------------------------------
# lesson 07: the peak of the whole process, from the kernel


class PeakRSS:
    """The peak resident memory of this process inside the block, above what it held on entry.

        with PeakRSS() as peak:
            zerokit.checkpoint.save(path, model, opt)
        peak.bytes        # the highest RSS inside the block minus the RSS at its start

    Linux keeps a high-water mark of every process's resident memory (VmHWM in
    /proc/self/status) and resets it to the current RSS when "5" is written to
    /proc/self/clear_refs: so this sees every allocation, however short-lived (a tensor, a
    numpy array, a bytes object, a file's buffer), with no sampling. It counts a page once it
    is touched, which is what memory costs.

    One caveat makes it exact: C's malloc keeps freed memory for reuse, so an allocation inside
    the block could reuse pages freed before it and never show. On entry, large blocks are
    made to come from (and go back to) the kernel directly (mallopt: every allocation over
    64 KiB is its own mapping, returned when freed), and what malloc holds unused is
    trimmed. This setting stays for the rest of the process: use it in a measuring process
    (a rank of zerokit.launch), not where speed matters. `bytes` is None where the kernel
    offers no such counter (not Linux).
    """

    _configured = False

    def __enter__(self):
        self.bytes = None
        gc.collect()
        self._start = _prepare_peak() if self._configure() else None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            peak = _status_kib("VmHWM")
            self.bytes = max(0, peak - self._start) * 1024
        return False

    @classmethod
    def _configure(cls):
        if cls._configured:
            return True
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: allocations above 64 KiB are mappings of their own
            libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD: give freed memory back to the kernel
            cls._libc = libc
            cls._configured = _status_kib("VmHWM") is not None
        except (OSError, AttributeError):
            cls._configured = False
        return cls._configured


def _status_kib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _prepare_peak():
    """Trim what malloc holds, reset the kernel's high-water mark; the RSS now (KiB), or None."""
    PeakRSS._libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    return _status_kib("VmRSS")


def resident_bytes():
    """This process's resident memory now (RSS): its pages in RAM, mapped file pages included."""
    kib = _status_kib("VmRSS")
    if kib is None:
        raise RuntimeError("resident_bytes needs Linux (/proc/self/status)")
    return kib * 1024


def settled_resident_bytes():
    """resident_bytes() with nothing pending: Python's garbage collected and what malloc keeps
    unused handed back to the kernel (lesson 08).

    It also makes large blocks mappings of their own from its first call on (PeakRSS's
    setting), for the rest of the process: by default glibc raises that threshold after each
    large free, later blocks come from heaps it keeps, and one program's RSS differs by
    megabytes from run to run. Call it once before building what you measure.
    """
    gc.collect()
    if not PeakRSS._configure():
        raise RuntimeError("settled_resident_bytes needs Linux with glibc (mallopt, /proc/self/status)")
    PeakRSS._libc.malloc_trim(0)
    return resident_bytes()
