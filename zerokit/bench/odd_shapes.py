"""Odd shapes, bit for bit: zerokit's optimizers against torch.optim's, built the same way (gpu-check).

Issue 39 measured on an H200: ZeRO1(params, AdamW) ended 3.5e-5 away from AdamW(foreach=False) after
20 steps on a model of odd sizes, SGD with Nesterov 2.4e-7, Adagrad 5.8e-6, under deterministic
algorithms, where the CPU is bitwise. Two causes, each a different kernel for the same formula:

- foreach. On CUDA torch.optim defaults to its multi-tensor implementations, and the wrappers' local
  optimizer did the same, while the reference was built with foreach=False. AdamW's two differ in one
  operation (`tensor / number` multiplies by the reciprocal, `_foreach_div_` divides: zerokit.multi_tensor).
  Adagrad's single-tensor update is `addcdiv_(g, std, value=-clr)`, its multi-tensor one `g * -clr` then
  `addcdiv_(that, std)` (torch/optim/adagrad.py): CUDA's addcdiv computes p + value * (g / std), so the
  two round apart; the CPU's computes p + value * g / std, the same product either way, so there they
  agree. SGD's two are the same arithmetic. So each row here builds both sides the same way: both with
  torch's default, and both with foreach=False.
- alignment. The LayerNorm after the hidden size of 381 starts 93,885 elements into an unpadded flat
  buffer, not a multiple of 4: its weight's address is not 16-byte aligned, and CUDA's LayerNorm then
  takes its two-pass kernel instead of the vectorised one (layer_norm_kernel.cu, `can_vec_gamma`),
  which rounds the mean and variance differently. Every optimizer then sees other gradients: SGD's
  2.4e-7 is that alone. zerokit.flat aligns every parameter (issue 39, 3), so the row's figure says
  whether the LayerNorm weight was aligned. (The other rows' models never show it: their widths,
  22 to 1022, are not multiples of 4, and LayerNorm takes the two-pass kernel for them anyway.)

Each row: one rank on the check's device, `torch.use_deterministic_algorithms(True)`, 20 steps of the
same batches from the same initial weights; the figure is the largest |difference| of any weight,
expected 0, and the first step where one appeared.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

import zerokit

STEPS, BATCH, SEQ = 20, 8, 24
LR, WD = 1e-2, 0.1


class OddShapes(nn.Module):
    """An embedding of 211 x 96, a hidden size of 381, LayerNorm, a frozen layer (issue 39's model)."""

    def __init__(self, vocab=211, dim=96, hidden=381):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.frozen = nn.Linear(dim, dim).requires_grad_(False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        h = self.norm(h + self.fc2(F.gelu(self.fc1(h))))
        return self.head(h + self.frozen(h))


def _adamw(params, **kw):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, **kw)


def _sgd(params, **kw):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=WD, **kw)


def _adagrad(params, **kw):
    return torch.optim.Adagrad(params, lr=LR, weight_decay=WD, **kw)


# name -> (zerokit's optimizer, torch's), each a function of (model, the foreach keyword or none)
OPTIMIZERS = {
    "ZeRO1(AdamW)": (lambda m, kw: zerokit.ZeRO1(m.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, **kw),
                     lambda m, kw: _adamw(m.parameters(), **kw)),
    "ZeRO2(AdamW)": (lambda m, kw: zerokit.ZeRO2(m.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD, **kw),
                     lambda m, kw: _adamw(m.parameters(), **kw)),
    "ZeRO1Adam": (lambda m, kw: zerokit.ZeRO1Adam(m.parameters(), lr=LR, weight_decay=WD, **kw),
                  lambda m, kw: _adamw(m.parameters(), **kw)),
    "DistributedAdam": (lambda m, kw: zerokit.DistributedAdam(m.parameters(), lr=LR, weight_decay=WD, **kw),
                        lambda m, kw: _adamw(m.parameters(), **kw)),
    "ZeRO1(SGD nesterov)": (lambda m, kw: zerokit.ZeRO1(m.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9,
                                                        nesterov=True, weight_decay=WD, **kw),
                            lambda m, kw: _sgd(m.parameters(), **kw)),
    "ZeRO1(Adagrad)": (lambda m, kw: zerokit.ZeRO1(m.parameters(), torch.optim.Adagrad, lr=LR, weight_decay=WD, **kw),
                       lambda m, kw: _adagrad(m.parameters(), **kw)),
}
MODES = {"default": {}, "foreach=False": {"foreach": False}}  # both sides built the same way


def _batch(step, device):
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 211, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def _train(make, kw, device):
    """20 steps; the weights after each (on the CPU), and whether the LayerNorm weight was 16-byte aligned."""
    torch.manual_seed(0)
    model = OddShapes().to(device)
    opt = make(model, kw)
    snaps = []
    for step in range(STEPS):
        x, y = _batch(step, device)
        F.cross_entropy(model(x).reshape(-1, 211), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        snaps.append({n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()})
    return snaps, model.norm.weight.data_ptr() % 16 == 0


def compare(rank, world_size):
    """Inside one rank: every (optimizer, mode) pair; (name, mode, max |d|, first step with a difference,
    LayerNorm weight aligned in zerokit's run), or (name, mode, None, the error)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic workspace sizes
    torch.use_deterministic_algorithms(True)
    device = zerokit.rank_device()
    out = []
    for name, (mine, theirs) in OPTIMIZERS.items():
        for mode, kw in MODES.items():
            try:
                want, _ = _train(theirs, kw, device)
                got, aligned = _train(mine, kw, device)
            except Exception as exc:  # one pair's failure is its own row
                out.append((name, mode, None, f"{type(exc).__name__}: {exc}".splitlines()[0][:160], None))
                continue
            diffs = [max((a[k] - b[k]).abs().max().item() for k in b) for a, b in zip(got, want)]
            first = next((i + 1 for i, d in enumerate(diffs) if d > 0), None)
            out.append((name, mode, diffs[-1], first, aligned))
    return {"device": str(device), "runs": out}
