"""One name per ZeRO stage, and the zerokit optimizer that implements it.

The bench and the demo both build their zerokit optimizers here, so that "zero2" means the
same class with the same options in both. Each caller says how finely to cut the model
(`bucket_mb` for ZeRO-1's and ZeRO-2's gradient buckets, `units` for ZeRO-3's gather units); a stage
without such a thing ignores the option, so a caller can describe its granularity once and
pass it to every stage.
"""

import zerokit

STAGES = ("ddp", "zero1", "zero2", "zero3")


def make_optimizer(stage, model, *, bucket_mb=None, units=None, **hyper):
    """The zerokit optimizer that runs `stage` on `model`.

    hyper: AdamW's hyperparameters (lr, betas, eps, weight_decay), which every stage takes.
    bucket_mb: ZeRO-1's and ZeRO-2's gradient bucket size in MiB; None keeps the class's default
    (ZeRO1Adam: one bucket, reduced in step(); ZeRO2Adam: 25 MiB).
    units: the modules ZeRO-3 gathers one at a time (the root unit keeps the rest); None
    keeps ZeRO3Adam's default.
    """
    if stage == "ddp":
        return zerokit.DistributedAdam(model.parameters(), **hyper)
    # only when given: the class's own default stays the one place that sets it
    size = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    if stage == "zero1":
        return zerokit.ZeRO1Adam(model.parameters(), **size, **hyper)
    if stage == "zero2":
        return zerokit.ZeRO2Adam(model.parameters(), **size, **hyper)
    if stage == "zero3":  # the module, not its parameters: it hooks each unit's forward
        return zerokit.ZeRO3Adam(model, units=units, **hyper)
    raise ValueError(f"unknown stage {stage!r}; choose from {STAGES}")
