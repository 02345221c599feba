"""Lesson 10's checks, validated on the solution and on deliberately broken training loops.

The solution is the code in solutions/10_capstone (the notebook's solution cell, executed here),
so what is validated is what students are graded against. Each broken loop is one bug training
loops have had; each must fail the checks listed beside it, with a message that names the
problem, and pass the others.

| defect | fails | message |
|---|---|---|
| each micro-batch's loss not divided by cfg.accum (example) | losses (SGD; AdamW hides it) | "too large" |
| zero_grad before every micro-batch (example) | losses | "only the last micro-batch" |
| every rank runs the whole batch (example) | data | "whole global batch" |
| resumes at the checkpoint's step + 1 (example) | resume | "after the checkpoint" |
| loads the checkpoint, starts the data at 0 (example) | resume | "started again at step 0" |
| saves before the optimizer step (example) | resume | "was saved when your loop had made 2 optimizer steps" |
| no barrier after the save (example) | resume (rank 0 held in its save) | "had no train.json yet" |
| clips with torch's clip_grad_norm_ on this rank's gradient (example) | losses (stage 1, clip) | "clipped by its own norm" |
| clips with torch's clip_grad_norm_ at stage 2 (nothing to clip) | losses (stage 2, clip) | "finds nothing to clip" |
| clips with torch's clip_grad_norm_ at stage 3: right (DTensor gradients) | passes losses (stage 3, clip) | |
| never loads the checkpoint it found | resume | "never called zerokit.checkpoint.load" |
| overlapping slices, or a loss not all-reduced | resume (besides losses, data) | "depend on the number of ranks" |
| reports this rank's loss, not the global batch's | losses | "share of the batch" |
| never clips | losses (with clip) | "unclipped" |
| checkpoints without their data position (train.json) | resume | "no data position" |
| a checkpoint only when the run finishes (the killed job has none) | resume | "no checkpoint" |
| calls zerokit.train's own train | every check | "zerokit.train's own train" |
| the untouched student notebook | every check | "NotImplementedError" |
"""

import sys

import cloudpickle
import pytest

from conftest import UNFINISHED, exercise_module, fails, fails_every_check, fails_exactly, source_module
from tests.submissions import _solution_sources
from tests.submissions import lesson10 as examples
from zerokit.grading import lesson10

pytestmark = pytest.mark.distributed

PRELUDE = """
import json
from pathlib import Path
import torch
import torch.distributed as dist
import torch.nn.functional as F
import zerokit
import zerokit.checkpoint
from zerokit.train import clip_, global_batch, gradient_sync, last_checkpoint
"""

# the broken loops below are sent to the ranks by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SOLUTION = exercise_module("10_capstone", "solutions", ["train_loop"], PRELUDE)
STUDENT = exercise_module("10_capstone", "lessons", ["train_loop"], PRELUDE)
SOLUTION_SOURCE = _solution_sources("10_capstone")["train_loop"]  # the solution cell, markers removed

def _visible_losses(loop):
    lesson10.check_losses(loop, stage=1, world_size=2, optimizer="sgd")
    lesson10.check_losses(loop, stage=1, world_size=2, optimizer="sgd", clip=0.5)


CHECKS = {  # the visible tests
    "losses": _visible_losses,
    "data": lambda loop: lesson10.check_data(loop, stage=1, world_size=2),
    "resume": lambda loop: lesson10.check_resume(loop, stage=3, world_size=2, resume_world_size=1),
}


def _loop(name, edit):
    """A train_loop with `edit` applied to the solution, as the notebook would define it."""
    source = edit if isinstance(edit, str) else edit(SOLUTION_SOURCE)
    return source_module(f"lesson10_{name}", source, PRELUDE).train_loop


@pytest.mark.timeout(120)
def test_the_solution_passes_every_check_and_the_hidden_settings(capsys):
    for check in CHECKS.values():
        check(SOLUTION.train_loop)
    lesson10.check_losses(SOLUTION.train_loop, stage=3, world_size=2, optimizer="sgd", clip=0.5)
    lesson10.check_losses(SOLUTION.train_loop, stage=0, world_size=3, optimizer="sgd")
    lesson10.check_losses(SOLUTION.train_loop, stage=2, world_size=2, optimizer="adamw")
    assert capsys.readouterr().out.count("✓") == 7


@pytest.mark.timeout(120)
def test_untouched_student_notebook_fails_every_check():
    fails_every_check(CHECKS, STUDENT.train_loop, match=UNFINISHED)


# ---------------------------------------------------------------------------------------
# the example students: each fails its check and passes the others


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name, edit, expected", [
    ("no_accum_division", examples.NO_ACCUM_DIVISION, {"losses": "too large"}),
    ("zero_grad_per_micro", examples.ZERO_GRAD_PER_MICRO, {"losses": "only the last micro-batch"}),
    ("whole_batch", examples.WHOLE_BATCH, {"data": "whole global batch"}),
    ("resume_plus_one", examples.RESUME_PLUS_ONE, {"resume": "after the checkpoint"}),
    ("resume_at_zero", examples.RESUME_AT_ZERO, {"resume": "started again at step 0"}),
    ("saves_before_step", examples.SAVES_BEFORE_STEP, {"resume": "was saved when your loop had made 2 optimizer"}),
    ("no_barrier", examples.NO_BARRIER, {"resume": "had no train.json yet"}),
    ("torch_clip", examples.TORCH_CLIP, {"losses": "clipped by its own norm"}),
])
def test_example_defects_fail_exactly_their_checks(name, edit, expected, capsys):
    fails_exactly(CHECKS, _loop(name, edit), expected, capsys)


def test_adamw_hides_the_missing_division_and_sgd_does_not(capsys):
    """Why the losses check uses SGD: with AdamW the loop that forgets 1/accum passes."""
    lesson10.check_losses(_loop("adamw_blind", examples.NO_ACCUM_DIVISION), stage=1, world_size=2,
                          optimizer="adamw")
    assert capsys.readouterr().out.startswith("✓")


# ---------------------------------------------------------------------------------------
# more bugs, each against the check meant to catch it

LOCAL_LOSS = "        dist.all_reduce(total)\n", "        # BUG: this rank's loss only\n        total *= world_size\n"
NO_CLIP = "            clip_(cfg, model, opt)\n", "            pass  # BUG: never clips\n"
TORCH_CLIP = ("            clip_(cfg, model, opt)\n",
              "            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)  # BUG: what this rank holds\n")
NO_LOAD = "            zerokit.checkpoint.load(found, model, opt)\n", "            pass  # BUG: the checkpoint is found, not loaded\n"
OVERLAP = ("    rows = slice(rank * per_rank, (rank + 1) * per_rank)\n",
           "    rows = slice(0, per_rank)  # BUG: every rank the first slice\n")
NO_POSITION = ('                (path / "train.json").write_text(json.dumps({"step": step + 1}))\n',
               "                pass  # BUG: no data position\n")
AT_THE_END = ("        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:\n",
              "        if cfg.checkpoint_every and step + 1 == cfg.steps:  # BUG: only a job that finishes saves\n")
ZEROKIT_TRAIN = '''
def train_loop(rank, world_size, cfg, model, opt, text):
    import zerokit.train
    return zerokit.train.train(rank, world_size, cfg)["losses"]
'''


def _edited(old, new):
    def edit(source):
        assert old in source, old
        return source.replace(old, new)
    return edit


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, edit, check, kw, match", [
    ("local_loss", _edited(*LOCAL_LOSS), lesson10.check_losses, dict(stage=1, world_size=2), "share of the batch"),
    ("no_clip", _edited(*NO_CLIP), lesson10.check_losses, dict(stage=3, world_size=2, clip=0.5), "unclipped"),
    ("torch_clip_zero2", _edited(*TORCH_CLIP), lesson10.check_losses, dict(stage=2, world_size=2, clip=0.5),
     "finds nothing to clip"),
    ("no_load", _edited(*NO_LOAD), lesson10.check_resume, dict(stage=3, world_size=2),
     "never called zerokit.checkpoint.load"),
    ("local_loss_resume", _edited(*LOCAL_LOSS), lesson10.check_resume, dict(stage=3, world_size=2),
     "depend on the number of ranks"),
    ("overlap_resume", _edited(*OVERLAP), lesson10.check_resume, dict(stage=3, world_size=2),
     "depend on the number of ranks"),
    ("no_position", _edited(*NO_POSITION), lesson10.check_resume, dict(stage=3, world_size=2), "no data position"),
    ("at_the_end", _edited(*AT_THE_END), lesson10.check_resume, dict(stage=2, world_size=2), "no checkpoint"),
    ("zerokit_train", ZEROKIT_TRAIN, lesson10.check_losses, dict(stage=1, world_size=2), "zerokit.train's own train"),
])
def test_each_bug_fails_its_check_with_a_reason_that_names_it(name, edit, check, kw, match):
    fails(check, _loop(name, edit), match=match, **kw)


@pytest.mark.timeout(120)
def test_the_hidden_situations_catch_them_too():
    """N = 3 at stage 0 and ZeRO-3: the missing division, the whole batch, the skipped step."""
    fails(lesson10.check_losses, _loop("sum3", examples.NO_ACCUM_DIVISION), stage=0, world_size=3,
          match="too large")
    fails(lesson10.check_data, _loop("whole3", examples.WHOLE_BATCH), stage=3, world_size=3,
          match="whole global batch")
    fails(lesson10.check_resume, _loop("plus3", examples.RESUME_PLUS_ONE), stage=1, world_size=3,
          resume_world_size=2, match="after the checkpoint")
    fails(lesson10.check_resume, _loop("nobarrier3", examples.NO_BARRIER), stage=1, world_size=3,
          resume_world_size=2, match="had no train.json yet")


@pytest.mark.timeout(60)
def test_torch_clip_is_the_global_norm_at_stage_3(capsys):
    """What the lesson teaches of torch.nn.utils.clip_grad_norm_(model.parameters()): wrong at stage 1 (this
    rank's unreduced gradient: test_example_defects) and stage 2 (no .grad: test_each_bug), right at stage 3,
    where FullyShard's gradients are DTensors of each rank's rows and torch's clip takes their norm over every
    rank. The loop that clips with it passes the clipped losses check (clip 0.5, which every step hits)."""
    lesson10.check_losses(_loop("torchclip3", examples.TORCH_CLIP), stage=3, world_size=2, optimizer="sgd",
                          clip=0.5)
    assert capsys.readouterr().out.startswith("✓")
