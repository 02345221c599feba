"""zerokit: the reference package of "ZeRO from Scratch".

One module per idea, in lesson order: adam (01), ddp (02), flat + zero1 (03), zero2 (04),
zero3 (05), mixed_precision (06), checkpoint (07: zerokit.checkpoint.save / load / consolidate,
on the checkpoint_* modules beside it); launch, comm and memory are the tools every lesson uses.
"""

from .adam import Adam, adamw_update_
from .comm import CommCounter, theory_volume
from .ddp import DistributedAdam
from .launcher import LaunchError, LaunchTimeout, launch, rank_device
from .memory import MemoryProbe, census, theory_bytes
from .mixed_precision import MixedPrecision
from .zero1 import ZeRO1Adam
from .zero2 import ZeRO2Adam
from .zero3 import ZeRO3Adam
from . import checkpoint  # lesson 07: zerokit.checkpoint.save / load / consolidate

__version__ = "0.1.0"

__all__ = [
    "Adam", "adamw_update_", "DistributedAdam", "ZeRO1Adam", "ZeRO2Adam", "ZeRO3Adam",
    "launch", "rank_device", "LaunchError", "LaunchTimeout",
    "CommCounter", "theory_volume", "MemoryProbe", "census", "theory_bytes", "MixedPrecision",
]
