r"""FSDP2's design in the course's own code: per-parameter DTensor shards (lesson 12's reference).

    from torch.distributed.fsdp import MixedPrecisionPolicy
    for block in model.blocks:
        zerokit.fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    zerokit.fully_shard(model)                                  # bottom-up, the root last
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)        # DTensor parameters: any optimizer
    loss_fn(model(x_local), y_local).backward(); opt.step(); opt.zero_grad()

`zerokit.fully_shard` has torch's signature and calling pattern and takes torch's own policy
objects; beside torch's `fully_shard` with the same calls it gives the same losses and weights
bit for bit (the same collectives, in the same order, on the same bytes). What FSDP2 is made
of, one idea per file, composed as FSDP2 composes them:

| file | FSDP2's | what it holds |
|---|---|---|
| `param.py` | FSDPParam | one parameter: its dim-0 shard (`dim0_chunk`), storage, DTensor, unsharded view |
| `collectives.py` | _fsdp_collectives | the all-gather's copy-in and copy-out, the reduce-scatter's chunk-cat |
| `group.py` | FSDPParamGroup | one call's parameters: the sharded state (a named enum), gather, reshard, reduce |
| `state.py` | FSDPState | one call's hooks, the root's lazy initialisation, prefetch, inputs and outputs as trees |
| `api.py` | fully_shard, FSDPModule | the calls and the per-module controls |
| `wrapper.py` | | `FullyShard(model, units=...)`: the calls in one, with the course's names |

Why per parameter and not lesson 05's flat buffer (lesson 12): a flat buffer cut anywhere gives
a rank pieces of parameters, or none of some, so frozen and trainable parameters, or two dtypes,
cannot share a unit, a state dict needs the flat layout to be read, and an optimizer that needs
whole rows (or whole matrices) cannot have them. A dim-0 shard is a slice of a tensor of the
full shape that DTensor describes, so `clip_grad_norm_`, `state_dict()`, DCP and tensor
parallelism read it as they read any DTensor. The price: each parameter padded to a multiple
of N rows, and the copies around every collective (`collectives.py`).

Lesson 05's ZeRO3Adam with `reshard_after_forward` (True, False, k = hpZ) on its flat buckets
is lesson 11's `zerokit.zeropp.ZeROppAdam`. After `import zerokit`, the name `zerokit.fully_shard` is the function, as in torch: import the package's
parts by their full names, `from zerokit.fully_shard.param import dim0_chunk`.
"""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .wrapper import FullyShard

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "FullyShard"]
