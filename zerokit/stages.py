r"""The four stages as records: what each shards, and how to build it three ways.

| # | name  | shards (the paper)                    | the lessons' class | PyTorch's shape (capstone) | PyTorch's peer |
|---|-------|---------------------------------------|--------------------|----------------------------|----------------|
| 0 | ddp   | nothing                               | DistributedAdam    | DataParallel + AdamW       | DDP + AdamW |
| 1 | zero1 | optimizer state ($P_{os}$)            | ZeRO1Adam          | ZeRO1(params, AdamW)       | DDP + ZeroRedundancyOptimizer |
| 2 | zero2 | + gradients ($P_{os+g}$)              | ZeRO2Adam          | ZeRO2(params, AdamW)       | fully_shard, no reshard after forward |
| 3 | zero3 | + parameters ($P_{os+g+p}$)           | ZeRO3Adam          | FullyShard(model) + AdamW  | fully_shard |

zerokit.train, zerokit.bench and zerokit.checkpoint ask a stage's record what to do (which
class, who clips, who scales an fp16 loss, which collectives a step runs) rather than test
its number, so a stage is described here once.
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch

__all__ = ["Stage", "STAGES", "STAGE_NAMES", "get_stage", "stage_of", "by_stage", "lessons_optimizer", "wrapper",
           "torch_peer"]


@dataclass(frozen=True)
class Stage:
    number: int  # stage k cuts the first k of (optimizer state, gradients, parameters) into 1/N
    name: str  # zerokit.memory.theory_bytes's name, the bench's and a checkpoint's
    peer: str  # PyTorch's own implementation, as the tables name it
    optimizer_inside: bool  # PyTorch's shape: the stage wraps the optimizer (ZeRO1/ZeRO2), not the model
    peer_autocast: bool  # the peer keeps fp32 weights (DDP): 16 bits come from torch.autocast
    collectives: tuple  # a step's collectives, in the order a step runs them

    @property
    def shards_optimizer_state(self):
        return self.number >= 1

    @property
    def shards_gradients(self):
        return self.number >= 2

    @property
    def shards_parameters(self):
        return self.number >= 3

    @property
    def autocast(self):
        """zerokit in PyTorch's shape keeps fp32 weights only without a sharded state to hold the
        16-bit copy (DataParallel): 16 bits come from torch.autocast there."""
        return not self.shards_optimizer_state

    @property
    def clip(self):
        """Who clips the gradient in PyTorch's shape: "optimizer" (ZeRO1/ZeRO2: its reduced flat
        shards), "torch" (torch's clip_grad_norm_ on FullyShard's DTensor shards), "replicated"
        (DataParallel's replicated mean, every rank the whole norm)."""
        if self.optimizer_inside:
            return "optimizer"
        return "torch" if self.shards_parameters else "replicated"

    @property
    def shards(self):
        """The categories of model state it cuts into 1/N, as zerokit.memory.theory_bytes names them."""
        return ("optimizer_states", "gradients", "parameters")[:self.number]

    def updated_numel(self, psi, world_size):
        """How many of the Ψ elements one rank's optimizer updates: its shard, or all of them."""
        return -(-psi // world_size) if self.shards_optimizer_state else psi  # the shard rounds up

    @property
    def loss_scaling(self):
        """Who scales an fp16 loss in PyTorch's shape: "optimizer" (ZeRO1/ZeRO2's MixedPrecision)
        or "job" (a plain torch optimizer beside DataParallel or FullyShard: the job's own scaler)."""
        return "optimizer" if self.optimizer_inside else "job"

    @property
    def offloads(self):
        """Its lessons' class can stream its own AdamW state to the CPU (lesson 08): a sharded one."""
        return self.shards_optimizer_state

    @property
    def muon(self):
        """The Muon it runs (lesson 09): "torch" (torch.optim.Muon on every rank, beside
        DataParallel), "ZeRO1Muon" (whole matrices, each on one rank), or None where its gradient
        shards cut a matrix, which Muon must see whole."""
        return (None if self.shards_gradients else "ZeRO1Muon") if self.shards_optimizer_state else "torch"

    @property
    def fsdp_controls(self):
        """Its wrapper (FullyShard) and its peer (fully_shard) take FSDP2's controls
        (reshard_after_forward and the rest), which change where its all-gathers run."""
        return self.shards_parameters

    def gathered(self, opt):
        """The context in which the lessons' optimizer shows the full parameters (ZeRO-3's
        `gathered()`); nothing to do where the parameters are whole."""
        return opt.gathered() if self.shards_parameters else nullcontext()


STAGES = (
    Stage(0, "ddp", "DDP + AdamW", optimizer_inside=False, peer_autocast=True,
          collectives=("all_reduce",)),
    Stage(1, "zero1", "DDP + ZeroRedundancyOptimizer", optimizer_inside=True, peer_autocast=True,
          collectives=("reduce_scatter", "all_gather")),
    Stage(2, "zero2", "fully_shard, no reshard", optimizer_inside=True, peer_autocast=False,
          collectives=("reduce_scatter", "all_gather")),
    Stage(3, "zero3", "fully_shard", optimizer_inside=False, peer_autocast=False,
          collectives=("reduce_scatter", "all_gather", "all_gather")),
)
STAGE_NAMES = tuple(s.name for s in STAGES)  # "ddp", "zero1", "zero2", "zero3"
_BY_KEY = {**{s.number: s for s in STAGES}, **{s.name: s for s in STAGES}}


def get_stage(key):
    """The record of a stage by number (0-3) or name ("ddp", "zero1", "zero2", "zero3")."""
    if isinstance(key, Stage):
        return key
    try:
        return _BY_KEY[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown stage {key!r}; choose from {[s.number for s in STAGES]} or "
                         f"{[s.name for s in STAGES]}") from None


def by_stage(items, stage=lambda item: item["stage"]):
    """{stage name: its items, in their order}, the stages in the table's order, none empty: a bench's
    rows (or configurations) grouped in this one place, where each stage's are wanted."""
    return {name: group for name in STAGE_NAMES if (group := [item for item in items if stage(item) == name])}


def _lesson_classes():
    """{the lessons' class: its stage}: the class a stage's lesson builds (a lesson's subclass of
    one, lesson 11's ZeRO3Adam with hpZ, has its stage)."""
    from .ddp import DistributedAdam
    from .zero1 import ZeRO1Adam
    from .zero2 import ZeRO2Adam
    from .zero3 import ZeRO3Adam

    return {DistributedAdam: STAGES[0], ZeRO1Adam: STAGES[1], ZeRO2Adam: STAGES[2], ZeRO3Adam: STAGES[3]}


def stage_of(opt):
    """The record of the stage the lessons' optimizer `opt` runs (its nearest class in the
    table above, as Python resolves a method); a TypeError for any other optimizer."""
    classes = _lesson_classes()
    for cls in type(opt).__mro__:
        if cls in classes:
            return classes[cls]
    raise TypeError(f"zerokit.checkpoint saves zerokit's DistributedAdam and ZeRO1/2/3Adam, not {type(opt).__name__}")


def _given(**options):
    """The options a caller gave: a class's own default stays the one place that sets the rest."""
    return {k: v for k, v in options.items() if v is not None}


def lessons_optimizer(key, model, *, bucket_mb=None, units=None, precision=None, offload=None, **hyper):
    """The lessons' class that runs stage `key` on `model`, Adam written by hand inside.

    hyper: AdamW's hyperparameters, which every stage takes. bucket_mb: ZeRO-1's and ZeRO-2's
    gradient bucket size in MiB (None: the class's default); units: the modules ZeRO-3 gathers
    one at a time (None: ZeRO3Adam's default). A stage without buckets or units ignores them, so a
    caller can describe its granularity once for every stage."""
    from .ddp import DistributedAdam
    from .zero1 import ZeRO1Adam
    from .zero2 import ZeRO2Adam
    from .zero3 import ZeRO3Adam

    s = get_stage(key)
    extras = _given(precision=precision, offload=offload)
    if s.shards_parameters:  # the module, not its parameters: it hooks each unit's forward
        return ZeRO3Adam(model, units=units, **extras, **hyper)
    if not s.shards_optimizer_state:
        return DistributedAdam(model.parameters(), **extras, **hyper)
    cls = ZeRO2Adam if s.shards_gradients else ZeRO1Adam
    return cls(model.parameters(), **_given(bucket_mb=bucket_mb), **extras, **hyper)


def wrapper(key, model, *, half=None, bucket_mb=None, units=None, reshard_after_forward=None, **hyper):
    """(model, optimizer): zerokit in PyTorch's shape at stage `key`, around torch.optim.AdamW(**hyper).

    half: the 16-bit compute dtype or None (fp32): ZeRO1/ZeRO2 keep 16-bit weights with fp32
    masters and an fp32 reduction (MixedPrecision; fp16 scales its loss itself), FullyShard
    computes in it; DataParallel leaves 16 bits to the caller's torch.autocast (Stage.autocast)."""
    from .data_parallel import DataParallel
    from .elementwise import ZeRO1, ZeRO2
    from .fully_shard import FullyShard
    from .mixed_precision import MixedPrecision

    s = get_stage(key)
    if s.shards_parameters:
        model = FullyShard(model, units=units, compute_dtype=half, reshard_after_forward=reshard_after_forward)
        return model, torch.optim.AdamW(model.parameters(), **hyper)
    if not s.optimizer_inside:
        model = DataParallel(model, **_given(bucket_mb=bucket_mb))
        return model, torch.optim.AdamW(model.parameters(), **hyper)
    precision = MixedPrecision(half, reduce_dtype=torch.float32) if half else None
    cls = ZeRO2 if s.shards_gradients else ZeRO1
    return model, cls(model.parameters(), torch.optim.AdamW, precision=precision, **_given(bucket_mb=bucket_mb),
                      **hyper)


DDP_OPTIONS = {"gradient_as_bucket_view": True}
ZERO_REDUNDANCY_OPTIONS = {"parameters_as_bucket_view": True}


def torch_peer(key, model, *, bf16=False, device=None, reshard_after_forward=None, **hyper):
    """(model, optimizer): PyTorch's own implementation of stage `key` on `model` (already on
    `device`), with torch.optim.AdamW(**hyper) and the documented memory options above.

    bf16: autocast for the DDP-based peers (their weights stay fp32; the caller enters
    torch.autocast), FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for the
    others, as zerokit.train does for its own stages. reshard_after_forward: stage 3's blocks' setting
    (None: FSDP2's default), as --reshard-after-forward gives it to FullyShard."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    s = get_stage(key)
    device = torch.device(device or "cpu")
    if s.peer_autocast:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **DDP_OPTIONS)
        if not s.shards_optimizer_state:
            return model, torch.optim.AdamW(model.parameters(), **hyper)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                              **ZERO_REDUNDANCY_OPTIONS, **hyper)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    # the job's device, named: fully_shard's default mesh takes the machine's accelerator, which is
    # the wrong one for a job kept on the CPU where there is a GPU (--device cpu)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # stage 2: nothing resharded after forward (one all-gather per step, as ZeRO-2's all-gather
    # of the updated weights); stage 3: FSDP2's default, the blocks reshard after forward and
    # are gathered again for backward, the root stays gathered
    default = None if s.shards_parameters else False
    setting = default if reshard_after_forward is None else reshard_after_forward
    for block in model.blocks:  # FullyShard's units: one per block, the root keeps the rest
        fully_shard(block, mesh=mesh, reshard_after_forward=setting, mp_policy=policy)
    # the root: FSDP2 keeps it gathered by default (None), as FullyShard's root unit; an explicit
    # setting is the root's too, as FullyShard's reshard_after_forward covers every unit
    fully_shard(model, mesh=mesh, reshard_after_forward=setting, mp_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), **hyper)
