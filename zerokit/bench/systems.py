"""What is compared: four stages, each run by its PyTorch peer, by zerokit's lesson class, and by
zerokit in PyTorch's shape (a module wrapper or the optimizer a user brings, with torch's AdamW).

| stage | PyTorch peer | zerokit |
|---|---|---|
| ddp   | `DistributedDataParallel` + `torch.optim.AdamW`           | `DistributedAdam` |
| zero1 | DDP + `torch.distributed.optim.ZeroRedundancyOptimizer`   | `ZeRO1Adam(bucket_mb=half the model)` |
| zero2 | FSDP2 `fully_shard(reshard_after_forward=False)` + AdamW  | `ZeRO2Adam(bucket_mb=two blocks)` |
| zero3 | FSDP2 `fully_shard` (blocks reshard after forward) + AdamW | `ZeRO3Adam(units=blocks)` |

| stage | zerokit in PyTorch's shape |
|---|---|
| ddp   | `zerokit.DataParallel(model, bucket_mb=half the model)` + `torch.optim.AdamW` |
| zero1 | `zerokit.ZeRO1(params, torch.optim.AdamW, bucket_mb=half the model)` |
| zero2 | `zerokit.ZeRO2(params, torch.optim.AdamW, bucket_mb=two blocks)` |
| zero3 | `zerokit.FullyShard(model, units=blocks)` + `torch.optim.AdamW` |

`zerokit.FullyShard` is the course's shell over `zerokit.fully_shard`, FSDP2's per-parameter design
(each parameter a DTensor of this rank's dim-0 rows): it calls fully_shard on each unit, then on the
model, and starts each unit's all-gather from the one before (forward prefetch). Its row is therefore
torch's fully_shard beside zerokit's in the course's shape; `python -m zerokit.bench --fsdp2`
(fsdp2.py) holds the two to the very same calls.

Beyond the default rows, FSDP2's controls (issue 41), each run by FSDP2 and by zerokit.FullyShard
with the same setting, one fully_shard per block and the root (`--fsdp-controls`, or by name):

| setting | both systems |
|---|---|
| `raf-true` | `reshard_after_forward=True` on every unit, the root too |
| `raf-false` | `reshard_after_forward=False`: no all-gather in backward |
| `hpz2` | `reshard_after_forward=2`: after forward, a secondary shard over 2 ranks (hpZ) |
| `nosync` | the default policy, and each step two half-batches, the first with gradient sync off |

(The default rows, `torch-zero3` and `wrapper-zero3`, are `reshard_after_forward=None`: True for
the blocks, False for the root.)

FSDP2 wraps each transformer block, then the root (embeddings, final norm, head); zerokit
gets the same granularity for ZeRO-3: its units are the blocks (the root unit keeps the rest).
ZeRO-2's gradient buckets are two blocks, each reduce-scattered as soon as backward completes
it and its full gradients freed: against one block, 5 to 10% less time for two blocks' more
gradients in flight, below the activations' peak at N = 2 (README). ZeRO2Adam's 25 MiB
default would make one bucket of the whole small model, sent only after backward.

ZeRO-1's buckets, and DataParallel's, are half the model (two, or three where a block does not
fit in what is left), as their peer's are few and large (DDP: 25 MiB, the first 1 MiB). Each
ZeRO-1 bucket costs a reduce-scatter during backward and an all-gather in step() (N
broadcasts at N = 2); the all-gathers gain nothing from finer buckets, since step() waits for
them, while two buckets already let the first half's reduce-scatter overlap backward of the
second. With the all-gather one exchange at N = 4 (zerokit.collectives), in turns: half the
model 0.99, 0.99 and 0.99 of the peer's time, a third 1.05, 1.04 and 0.99, one block 1.12,
1.13 and 1.08. Before that, with N broadcasts and one block per bucket (6 on the small
transformer, 5 on the MLP), ZeRO-1 issued 6 + 6N collectives a step where the peer issues
2 + N (README: the times). ZeRO1Adam's own default, one bucket reduced
in step(), sends nothing during backward. DataParallel with one-block buckets took 1.06-1.13
of DDP's time (1.21-1.31 of the floor), with half-model buckets 1.03-1.09 (1.12-1.21), N = 2
in turns, at a peak of 0.92-0.94 of DDP's instead of 0.83 (its copies of the two buckets in
flight are larger).
"""

from dataclasses import dataclass

from zerokit.stages import get_stage, lessons_optimizer, torch_peer, wrapper

from .workload import HYPER, make_model


@dataclass(frozen=True)
class Config:
    name: str
    stage: str  # ddp, zero1, zero2, zero3
    system: str  # "torch", "zerokit" (the lesson's class) or "wrapper" (zerokit in PyTorch's shape)
    label: str
    setting: str = ""  # one of FULLY_SHARD_SETTINGS (zero3 only), run by both systems of its row


# FSDP2's controls: reshard_after_forward for both systems, or (micro) half-batches under no-sync
FULLY_SHARD_SETTINGS = {
    "raf-true": {"reshard_after_forward": True},
    "raf-false": {"reshard_after_forward": False},
    "hpz2": {"reshard_after_forward": 2},
    "nosync": {"micro_batches": 2},
}


CONFIGS = [
    Config("torch-ddp", "ddp", "torch", "DDP + torch AdamW"),
    Config("zerokit-ddp", "ddp", "zerokit", "zerokit DistributedAdam"),
    Config("torch-zero1", "zero1", "torch", "DDP + ZeroRedundancyOptimizer"),
    Config("zerokit-zero1", "zero1", "zerokit", "zerokit ZeRO1Adam"),
    Config("torch-zero2", "zero2", "torch", "FSDP2 no reshard + AdamW"),
    Config("zerokit-zero2", "zero2", "zerokit", "zerokit ZeRO2Adam"),
    Config("torch-zero3", "zero3", "torch", "FSDP2 reshard + AdamW"),
    Config("zerokit-zero3", "zero3", "zerokit", "zerokit ZeRO3Adam"),
    Config("wrapper-ddp", "ddp", "wrapper", "zerokit DataParallel + AdamW"),
    Config("wrapper-zero1", "zero1", "wrapper", "zerokit ZeRO1(AdamW)"),
    Config("wrapper-zero2", "zero2", "wrapper", "zerokit ZeRO2(AdamW)"),
    Config("wrapper-zero3", "zero3", "wrapper", "zerokit FullyShard + AdamW"),
] + [Config(f"{system}-zero3-{setting}", "zero3", system, f"{who} {setting} + AdamW", setting)
     for setting in FULLY_SHARD_SETTINGS for system, who in (("torch", "FSDP2"), ("wrapper", "FullyShard"))]
DEFAULT_CONFIGS = [c.name for c in CONFIGS if not c.setting]  # what a plain `make bench` runs
CONTROL_CONFIGS = ["torch-zero3", "wrapper-zero3"] + [c.name for c in CONFIGS if c.setting]  # --fsdp-controls
SYSTEMS = ("zerokit", "wrapper")  # each compared with the "torch" configuration of its stage
BASELINE = "torch-ddp"  # the loss every other configuration is compared with

# The PyTorch peers use their documented memory/speed options: gradients that live in
# DDP's communication buckets instead of beside them, and ZeroRedundancyOptimizer's
# parameters packed into one buffer per rank (one broadcast per rank, not one per tensor).
# torch.optim.AdamW keeps its defaults (its CPU default is the per-tensor loop).
# zerokit.stages.torch_peer builds them, for zerokit.train's --impl torch too.


def build(config, model_cfg, device, seed, **options):
    """A fresh (model, optimizer) for `config`; every rank starts from the same weights.
    options: AdamW's options beyond the bench's HYPER (opcount's foreach=True), given to every system."""
    hyper = {**HYPER, **options}
    model = make_model(model_cfg, device, seed)
    bucket_mib = bucket_size(config.stage, model)
    if config.system == "zerokit":
        return model, lessons_optimizer(config.stage, model, bucket_mb=bucket_mib, units=list(model.blocks), **hyper)
    reshard = FULLY_SHARD_SETTINGS.get(config.setting, {}).get("reshard_after_forward")
    if config.system == "torch":
        return torch_peer(config.stage, model, device=device, reshard_after_forward=reshard, **hyper)
    if config.system == "wrapper":  # zerokit in PyTorch's shape, with torch's own AdamW, at the same granularity
        return wrapper(config.stage, model, bucket_mb=bucket_mib, units=list(model.blocks),
                       reshard_after_forward=reshard, **hyper)
    raise ValueError(f"unknown system {config.system!r} in configuration {config.name!r}")


# Each stage's gradient bucket, as (a fraction of the model, or a number of blocks), chosen by
# measurement (the module's docstring): ddp and zero1 half the model (two buckets, or three where a
# block does not fit), zero2 two blocks, zero3 one (its unit: a block)
BUCKETS = {"ddp": ("model", 1 / 2), "zero1": ("model", 1 / 2), "zero2": ("blocks", 2), "zero3": ("blocks", 1)}


def bucket_size(stage, model):
    """The gradient bucket size (MiB) of DataParallel, ZeRO-1 and ZeRO-2 (see the module's docstring)."""
    def mib(params):
        return sum(p.numel() * p.element_size() for p in params) / 2**20

    whole, times = BUCKETS[get_stage(stage).name]
    return times * mib(model.parameters() if whole == "model" else model.blocks[0].parameters())


def micro_batches(config):
    """Backward passes per step: 2 half-batches for the no-sync rows, else 1."""
    return FULLY_SHARD_SETTINGS.get(config.setting, {}).get("micro_batches", 1)
