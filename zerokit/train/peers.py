"""The stages' PyTorch peers (--impl torch, built by zerokit.stages.torch_peer), and what any system
holds, by category.

| stage | zerokit (python -m zerokit.train)         | PyTorch peer (--impl torch) |
|-------|-------------------------------------------|-----------------------------|
| 0     | `zerokit.DataParallel` + AdamW            | `DistributedDataParallel(gradient_as_bucket_view=True)` + AdamW |
| 1     | `zerokit.ZeRO1(params, AdamW)`            | DDP + `ZeroRedundancyOptimizer(AdamW, parameters_as_bucket_view=True)` |
| 2     | `zerokit.ZeRO2(params, AdamW)`            | FSDP2 `fully_shard` on each block, then the root, `reshard_after_forward=False` + AdamW |
| 3     | `zerokit.FullyShard(model, units=blocks)` | FSDP2 `fully_shard` on each block, then the root (blocks reshard after forward) + AdamW |

Both sides keep their defaults otherwise (zerokit's bucket sizes, DDP's 25 MiB buckets), with the
documented memory options above, which zerokit.bench uses for its peers too.

`holdings` lists the tensors a system holds as parameters, gradients and optimizer state, for
zerokit.memory.census: zerokit's flat buffers and shards (their memory_categories), DDP's
parameters, FSDP2's and FullyShard's DTensor shards (by their local tensors) and all-gather buffers,
ZeroRedundancyOptimizer's state. The
script's memory table and the bench's per-step accounting both count with it.
"""

import torch
from torch.distributed.tensor import DTensor

MODEL_STATE = ("parameters", "gradients", "optimizer_states")


def _local(t):
    """A DTensor's local shard (FSDP2's, and zerokit.FullyShard's); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def holdings(model, optimizer) -> dict:
    """{category: [tensors]} that a system holds as parameters, gradients, optimizer state."""
    params, grads, states = [], [], []
    for p in model.parameters():
        params.append(_local(p))
        if p.grad is not None:
            grads.append(_local(p.grad))
    for m in model.modules():  # FSDP2's own buffers (private API: best effort)
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in getattr(get_state(), "_fsdp_param_groups", []):
            for fp in group.fsdp_params:
                params.append(fp._sharded_param_data)
                params.extend(getattr(fp, "all_gather_outputs", []))
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    params.append(_local(unsharded))
                    if unsharded.grad is not None:
                        grads.append(_local(unsharded.grad))
    for owner in (optimizer, model):  # zerokit's optimizers list their flat buffers, FullyShard its gathered ones
        declared = getattr(owner, "memory_categories", None)
        if declared is not None:
            cats = declared()
            params += cats.get("parameters", [])
            grads += cats.get("gradients", [])
            states += cats.get("optimizer_states", [])
    for opt in (optimizer, getattr(optimizer, "optim", None)):  # ZeroRedundancyOptimizer.optim
        for state in getattr(opt, "state", {}).values():
            if isinstance(state, dict):
                states += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return {"parameters": params, "gradients": grads, "optimizer_states": states}


class Held:
    """Hands `holdings` to zerokit.memory.census as an optimizer's declared categories."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def memory_categories(self):
        return holdings(self.model, self.optimizer)
