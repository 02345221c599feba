"""zerokit: the reference package of "ZeRO from Scratch".

The course, one module per idea, in lesson order (each a small step from the last):

    adam             01  Adam/AdamW by hand, a torch.optim.Optimizer
    multi_tensor     01+ the same update on many tensors at once (torch's _foreach_ operations): a GPU's default
    ddp              02  DistributedAdam: all-reduce the mean gradient
    flat, zero1      03  flat padded buffers cut into N shards; ZeRO-1 shards Adam's state
    elementwise      03+ ZeRO1/ZeRO2 (ZeRO2 on lesson 04's stage) with any elementwise torch optimizer
    zero2            04  ZeRO-2: gradients reduce-scattered in buckets during backward
    zero3            05  ZeRO3Adam: the shards gathered and freed (exercise 1), the hooks that say when (2)
    fully_shard      12  FSDP2's design: fully_shard, FSDPModule (every control) and FullyShard (the calls
                         in one), each parameter a dim-0 DTensor shard
    mixed_precision  06  16-bit compute, fp32 masters, the loss scaler, for every stage
    checkpoint       07  sharded checkpoints: save, load on any N and stage, consolidate
    activations      08  what autograd saves, counted and in closed form; recomputation
    offload          08  the optimizer state in memory-mapped files or pinned host memory
    muon             09  ZeRO1Muon: each matrix owned whole by one rank
    zeropp           11  ZeRO++ (hpZ: reshard_after_forward=k; qwZ: int8 blocks on the wire) and hybrid sharding
    alphabeta        11  the α-β time model: collectives on NVLink and NICs (rails or not), the schemes in seconds

The instruments every lesson measures with: comm (collectives counted, theoretical
volumes), memory (theory and census of model-state bytes), models (the model zoo),
reference (one process running torch.optim.AdamW: the yardstick), figures; and
collectives, the reduce-scatter and all-gather the stages call (direct on gloo); hooks,
the weak hook and in_backward the stages' autograd hooks share.

The machinery, in wings the course modules never import: launcher/ (`zerokit.launch`:
a callable on N ranks), grading/ (the checks the notebooks' test cells call, and the
nbgrader flow), bench/ (`make bench`, `make demo`), and stages.py, the four stages as records
(what each shards, its classes, who clips and who scales a loss), which train/, bench/ and
checkpoint/ ask instead of testing a stage's number.
"""

from .adam import Adam, adamw_update_
from .comm import CommCounter, theory_volume
from .ddp import DistributedAdam
from .data_parallel import DataParallel
from .launcher import LaunchError, LaunchTimeout, launch, rank_device
from .activations import SavedActivations, checkpoint_modules
from .memory import MemoryProbe, census, theory_bytes
from .mixed_precision import MixedPrecision
from .offload import Offload
from .zero1 import ZeRO1Adam
from .zero2 import ZeRO2Adam
from .zero3 import ZeRO3Adam
from .elementwise import ZeRO1, ZeRO2
from .fully_shard import FSDPModule, FullyShard, fully_shard, register_fsdp_forward_method
from .muon import ZeRO1Muon
from . import checkpoint  # lesson 07: zerokit.checkpoint.save / load / consolidate
from . import zeropp  # lesson 11: zerokit.zeropp.ZeROppAdam, HybridShardAdam

__version__ = "0.1.0"

__all__ = [
    "Adam", "adamw_update_", "DistributedAdam", "ZeRO1Adam", "ZeRO2Adam", "ZeRO3Adam",
    "DataParallel", "FullyShard", "fully_shard", "FSDPModule", "register_fsdp_forward_method",
    "launch", "rank_device", "LaunchError", "LaunchTimeout",
    "CommCounter", "theory_volume", "MemoryProbe", "census", "theory_bytes", "MixedPrecision",
    "SavedActivations", "checkpoint_modules", "Offload", "ZeRO1", "ZeRO2", "ZeRO1Muon",
]
