"""The floor: what a stage's step would cost with perfect software.

The same forward/backward on a plain, unwrapped model with no communication, plus the
fastest local AdamW update (fused `torch.optim.AdamW`, on one flat tensor) of the elements
this rank updates (Psi for ddp, Psi/N for ZeRO), plus the raw collectives for the
theoretical volume on one flat fp32 buffer (all-reduce Psi; reduce-scatter Psi + all-gather
Psi; ZeRO-3 a second all-gather). Timed per stage, interleaved with the stage's two
systems. Overlapping communication with compute can in principle go below it. The
collectives are zerokit's (zerokit.collectives): on gloo a direct exchange for the
reduce-scatter and an in-place exchange for the all-gather, about twice as fast as gloo's own.
"""

import torch
import torch.distributed as dist

import zerokit
from zerokit.collectives import all_gather, reduce_scatter
from zerokit.stages import get_stage

from .timing import time_together
from .workload import HYPER, loss_of, make_model, rank_batch


class Floor:
    """A stage's floor, timed in the same rotation as the stage's configurations.

    Each repetition times, each behind a barrier: forward + backward of a plain model (no
    wrapper, no hooks, no communication); the fastest local update this PyTorch has (fused
    AdamW; zerokit's adamw_update_ where there is no fused kernel) of the elements one rank
    updates, as one flat tensor; the raw collectives of the stage's theoretical volume on
    one flat fp32 buffer.
    """

    def __init__(self, stage, rank, world_size, opts, device, psi):
        self.device = device
        self.model_cfg = opts["model"]
        self.model = make_model(opts["model"], device, opts["seed"])
        self.x, self.y = rank_batch(opts["model"], 0, rank, world_size, device)
        shard = -(-psi // world_size)  # the collectives' buffers: a rank's 1/N and the whole
        n = get_stage(stage).updated_numel(psi, world_size)  # the elements this rank updates
        self.flat = torch.zeros(n, device=device, requires_grad=True)
        self.flat.grad = torch.randn(n, device=device)
        try:
            self.opt = torch.optim.AdamW([self.flat], fused=True, **HYPER)
            self.opt.step()
            self.update, self.update_impl = self.opt.step, "torch.optim.AdamW(fused=True)"
        except (RuntimeError, TypeError):  # no fused kernel for this device
            m, v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
            hp = dict(lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1], eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"])
            self.update = lambda: zerokit.adamw_update_(self.flat.data, self.flat.grad, m, v, 1, **hp)
            self.update_impl = "zerokit.adamw_update_"
        self.full = torch.randn(shard * world_size, device=device)
        self.part = torch.empty(shard, device=device)
        self.collectives = get_stage(stage).collectives
        self.times = {"forward_backward": [], "update": [], "comm": []}
        self.train(timed=False)

    def fwd_bwd(self):
        loss_of(self.model_cfg, self.model(self.x), self.y).backward()
        self.model.zero_grad(set_to_none=True)

    def comm(self):
        for op in self.collectives:
            if op == "all_reduce":
                dist.all_reduce(self.full)
            elif op == "reduce_scatter":
                reduce_scatter(self.part, self.full)
            else:
                all_gather(self.full, self.part)

    def train(self, timed=True):
        times = {"forward_backward": time_together(self.fwd_bwd, self.device),
                 "update": time_together(self.update, self.device), "comm": time_together(self.comm, self.device)}
        if timed:
            for k, v in times.items():
                self.times[k].append(v)
