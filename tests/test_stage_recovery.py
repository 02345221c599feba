"""Notebook habits that must not derail a stage: an extra forward, a backward that raised.

Both happen in every student's notebook: a forward to look at the loss with grad still
enabled (no backward follows), and a backward interrupted by an error in some cell. After
either, training must go on exactly as one process with torch.optim.AdamW on the whole
batch (the extra forward changes nothing; the failed backward is discarded by zero_grad).
"""

import pytest
import torch

import zerokit
from zerokit.models import loss_for
from zerokit.reference import global_batch, max_abs_diff, rank_trajectory, reference_trajectory

pytestmark = pytest.mark.distributed

STEPS, LR, TOL = 4, 1e-2, 1e-5


def _make(stage):
    def make(model):
        if stage == "zero3":
            return zerokit.ZeRO3Adam(model, lr=LR)
        return zerokit.ZeRO2Adam(model.parameters(), lr=LR, bucket_mb=1e-4)  # several buckets

    return make


def _snapshot(stage):
    def snap(model, opt):
        if stage != "zero3":
            return {n: p.detach().clone() for n, p in model.named_parameters()}
        with opt.gathered():
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    return snap


def _extra_forward(step, model, opt):
    """From now on, before each step(), look at a loss with grad enabled and no backward."""
    if step != 0:
        return
    real_step = opt.step

    def step_after_a_look(*args, **kwargs):
        x, y = global_batch("edge", 1000, 12)
        loss_for("edge", model(x), y)
        return real_step(*args, **kwargs)

    opt.step = step_after_a_look


def _failed_backward(step, model, opt):
    """A backward that raises half-way (after the head's gradients, before the block's)."""
    if step != 0:
        return

    def boom(grad):
        raise RuntimeError("a cell failed in backward")

    def arm(module, args, out):
        out.register_hook(boom)  # returns None: the output stays as it is

    handle = model.block.register_forward_hook(arm)
    x, y = global_batch("edge", 1000, 12)
    loss = loss_for("edge", model(x), y)
    handle.remove()
    with pytest.raises(RuntimeError, match="a cell failed"):
        loss.backward()
    opt.zero_grad()


def _run(rank, world_size, stage, habit):
    return rank_trajectory(rank, world_size, _make(stage), kind="edge", steps=STEPS,
                           snapshot=_snapshot(stage), after_step=habit)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage, habit", [("zero3", _extra_forward), ("zero2", _failed_backward),
                                          ("zero3", _failed_backward)])
def test_training_goes_on_as_adamw(stage, habit):
    ref = reference_trajectory("edge", steps=STEPS, lr=LR)
    results = zerokit.launch(_run, world_size=2, args=(stage, habit), launcher="forkserver", timeout=90)
    for rank, snaps in enumerate(results):
        for step, (got, want) in enumerate(zip(snaps, ref)):
            d = max_abs_diff(got, want)
            assert d <= TOL, f"{stage} {habit.__name__}: rank {rank} step {step + 1}: max abs diff {d:.2e}"


def test_edge_case_net_total_needs_padding_for_2_3_and_4_ranks():
    psi = zerokit.models.num_parameters(zerokit.models.EdgeCaseNet())
    assert all(psi % n for n in (2, 3, 4)), psi
    assert torch.is_tensor(zerokit.models.EdgeCaseNet().scale)  # the buffer is still there


def _hook_calls(rank, world_size):
    zerokit.Adam([torch.nn.Parameter(torch.ones(1))])  # once any Adam exists, torch wraps Adam.step
    model = zerokit.models.OddMLP()
    opt = zerokit.DistributedAdam(model.parameters(), lr=LR)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    x, y = global_batch("mlp", 0, 12)
    loss_for("mlp", model(x), y).backward()
    opt.step()
    return len(calls)


@pytest.mark.timeout(60)
def test_distributed_adam_fires_step_hooks_once_per_step():
    """MemoryProbe samples in step hooks: a second call would sample a half-finished step."""
    assert zerokit.launch(_hook_calls, world_size=2, launcher="forkserver", timeout=45) == [1, 1]
