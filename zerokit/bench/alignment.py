"""16 bytes or 128: the alignment of zerokit's flat buffers, timed on the device (gpu-check).

zerokit.flat starts every parameter and every shard of zerokit's own buffers on ALIGN_BYTES = 16
bytes, as FSDP1 and DeepSpeed pad theirs; Megatron aligns to 128 ("helps cuBLAS pick more efficient
algorithms"). On a CPU both are the same code; on a GPU a kernel may take another path on another
alignment (a vectorised load needs 16 bytes; a matmul's algorithm may want more), so which one pays
is measured here, where it can be: on the GPU, by `make gpu-check`.

One rank, a model of odd sizes (bench.odd_shapes' model, its widths scaled up on a GPU so that the
kernels and not their launches take the time), and the three classes whose kernels read the flat
buffers: ZeRO1Adam (Adam on the shard's segments, the parameters views of the flat buffer),
ZeRO1(AdamW) (torch's AdamW on the segment views), DataParallel (the gradients through the buckets'
views). Each is built three times, its buffers aligned to 1 byte (lesson 03's plain layout), 16 and
128, from the same initial weights; the nine step in turns on the same batches, so a busy machine
slows them alike; the figure is each class's median step time at 16 and 128 against 1. At 16 and 128
every pointer is at least 16-byte aligned, so the kernels are the same and so must the weights be,
bit for bit: the row checks that too.
"""

import statistics
import time

import torch
import torch.nn.functional as F

import zerokit
from zerokit import flat
from zerokit.bench.odd_shapes import OddShapes

ALIGNMENTS = (1, 16, 128)
SIZES = {True: dict(vocab=2111, dim=960, hidden=3811), False: dict(vocab=211, dim=96, hidden=381)}
BATCH = {True: (16, 256), False: (4, 16)}  # sequences, tokens each
LR, WD = 1e-3, 0.1

CLASSES = {
    "ZeRO1Adam": lambda m: (m, zerokit.ZeRO1Adam(m.parameters(), lr=LR, weight_decay=WD)),
    "ZeRO1(AdamW)": lambda m: (m, zerokit.ZeRO1(m.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD)),
    "DataParallel": lambda m: (lambda dp: (dp, torch.optim.AdamW(dp.parameters(), lr=LR, weight_decay=WD)))(
        zerokit.DataParallel(m)),
}


def _batch(step, vocab, shape, device):
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, vocab, (shape[0], shape[1] + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare(rank, world_size, gpu, steps):
    """Inside one rank: {class: {alignment: median ms per step}}, and each class's largest |difference|
    between its 16- and 128-byte runs' weights after the steps (expected 0)."""
    device = zerokit.rank_device()
    sizes, shape = SIZES[gpu], BATCH[gpu]
    runs = {}
    for name, make in CLASSES.items():
        for align in ALIGNMENTS:
            torch.manual_seed(0)
            model = OddShapes(**sizes).to(device)
            with flat.aligned(align):  # the buckets are built now, at this alignment
                runs[name, align] = make(model)
    times = {key: [] for key in runs}
    for step in range(steps):
        x, y = _batch(step, sizes["vocab"], shape, device)
        for key, (model, opt) in runs.items():  # in turns: the same moment of the machine for all nine
            _sync(device)
            t = time.perf_counter()
            F.cross_entropy(model(x).reshape(-1, sizes["vocab"]), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            _sync(device)
            times[key].append(time.perf_counter() - t)
    out = {}
    for name in CLASSES:
        weights = [dict(runs[name, a][0].named_parameters()) for a in (16, 128)]
        diff = max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0])
        median = {a: statistics.median(times[name, a][1:]) * 1e3 for a in ALIGNMENTS}  # the first allocates
        out[name] = {"ms": median, "diff_16_128": diff}
    return {"device": str(device), "psi": sum(p.numel() for p in OddShapes(**sizes).parameters()), "classes": out}
