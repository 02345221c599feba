"""The stages' PyTorch peers (--impl torch), and what any system holds, by category.

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

STAGE_PEERS = {
    0: "DDP + AdamW",
    1: "DDP + ZeroRedundancyOptimizer",
    2: "fully_shard, no reshard",
    3: "fully_shard",
}
DDP_OPTIONS = {"gradient_as_bucket_view": True}
ZERO_REDUNDANCY_OPTIONS = {"parameters_as_bucket_view": True}
MODEL_STATE = ("parameters", "gradients", "optimizer_states")


def build_peer(stage, model, *, bf16=False, device=None, reshard_after_forward=None, **hyper):
    """(model, optimizer): PyTorch's own implementation of `stage` on `model` (already on `device`),
    with torch.optim.AdamW(**hyper).

    bf16: autocast for the DDP-based peers (their weights stay fp32; the caller enters
    torch.autocast), FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for the
    others, as zerokit.train does for its own stages. reshard_after_forward: stage 3's blocks' setting
    (None: FSDP2's default), as --reshard-after-forward gives it to FullyShard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device(device or "cpu")
    if stage in (0, 1):
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **DDP_OPTIONS)
        if stage == 0:
            return model, torch.optim.AdamW(model.parameters(), **hyper)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                              **ZERO_REDUNDANCY_OPTIONS, **hyper)
    if stage in (2, 3):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        # the job's device, named: fully_shard's default mesh takes the machine's accelerator, which is
        # the wrong one for a job kept on the CPU where there is a GPU (--device cpu)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # stage 2: nothing resharded after forward (one all-gather per step, as ZeRO-2's all-gather
        # of the updated weights); stage 3: FSDP2's default, the blocks reshard after forward and
        # are gathered again for backward, the root stays gathered
        reshard = False if stage == 2 else None
        blocks = reshard if reshard_after_forward is None else reshard_after_forward
        for block in model.blocks:  # FullyShard's units: one per block, the root keeps the rest
            fully_shard(block, mesh=mesh, reshard_after_forward=blocks, mp_policy=policy)
        # the root: FSDP2 keeps it gathered by default (None), as FullyShard's root unit; an explicit
        # setting is the root's too, as FullyShard's reshard_after_forward covers every unit
        root = reshard if reshard_after_forward is None else reshard_after_forward
        fully_shard(model, mesh=mesh, reshard_after_forward=root, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), **hyper)
    raise ValueError(f"stage must be 0, 1, 2 or 3, not {stage!r}")


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
