"""Example students for lesson 10 (the capstone): train_loop.

Points: test_capstone_losses 4, test_capstone_data 2, test_capstone_resume 4, test_questions 2.
Each defect is one a real training loop has had, and costs only the check meant to catch it: the
losses check runs without checkpoints, the resume check compares the loop with itself, and the
data check looks at the sequences, which the losses cannot see.
"""

from . import SOLUTION, Student, correct, full_marks, solution_with, untouched

LESSON = "10_capstone"
KEEP = ("import zerokit",)  # the imports cell (it also defines the lesson's config and picks the forkserver launcher)

FULL = full_marks(LESSON)
SOLVED = {"answers": SOLUTION}  # the check-your-understanding answers, right

# The micro-batches' gradients add up: without the division the gradient is accum x the mean. AdamW
# forgives it (m / sqrt(v)), SGD does not.
NO_ACCUM_DIVISION = solution_with("(loss / cfg.accum).backward()", "loss.backward()  # BUG: not divided by cfg.accum")

# zero_grad before every micro-batch: only the last micro-batch's gradient reaches the optimizer.
ZERO_GRAD_PER_MICRO = solution_with(
    "            xs, ys = x[k::cfg.accum], y[k::cfg.accum]\n",
    "            xs, ys = x[k::cfg.accum], y[k::cfg.accum]\n"
    "            opt.zero_grad()  # BUG: clears the micro-batches before this one\n")

# Every rank runs the whole global batch: the same mean gradient, N times the work.
WHOLE_BATCH = solution_with("        x, y = x[rows], y[rows]\n", "        # BUG: every rank keeps the whole batch\n")

# Resumes one step too late: the checkpoint's step is already the index of the next step to train.
RESUME_PLUS_ONE = solution_with('start = json.loads((found / "train.json").read_text())["step"]',
                                'start = json.loads((found / "train.json").read_text())["step"] + 1  # BUG')

# Loads the weights and optimizer state, then starts the data again at step 0: the data position lost.
RESUME_AT_ZERO = solution_with('start = json.loads((found / "train.json").read_text())["step"]  # the data position',
                               "pass  # BUG: the weights are loaded, the data position is not")

# The checkpoint is taken before the optimizer step, and labelled with the steps done after it.
SAVES_BEFORE_STEP = solution_with(
    "        if cfg.clip is not None:\n"
    "            clip_(cfg, model, opt)\n"
    "        opt.step()\n"
    "        opt.zero_grad()\n"
    "        dist.all_reduce(total)\n"
    "        losses[step + 1] = float(total) / world_size\n"
    "        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:\n"
    "            path = Path(cfg.checkpoint_dir) / f\"step{step + 1}\"\n"
    "            zerokit.checkpoint.save(path, model, opt)  # after the update: the state of step + 1 steps done\n"
    "            if rank == 0:\n"
    "                (path / \"train.json\").write_text(json.dumps({\"step\": step + 1}))\n"
    "            dist.barrier()\n",
    "        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:  # BUG: before the update\n"
    "            path = Path(cfg.checkpoint_dir) / f\"step{step + 1}\"\n"
    "            zerokit.checkpoint.save(path, model, opt)\n"
    "            if rank == 0:\n"
    "                (path / \"train.json\").write_text(json.dumps({\"step\": step + 1}))\n"
    "            dist.barrier()\n"
    "        if cfg.clip is not None:\n"
    "            clip_(cfg, model, opt)\n"
    "        opt.step()\n"
    "        opt.zero_grad()\n"
    "        dist.all_reduce(total)\n"
    "        losses[step + 1] = float(total) / world_size\n")

# No barrier after the save: a rank goes on to the next step (or returns) while rank 0 is still writing
# train.json; the check holds rank 0 in its save, as a busy disk does, and sees the rank go on.
NO_BARRIER = solution_with("            dist.barrier()\n", "            # BUG: no barrier: the others go on before train.json exists\n")

# torch's clipping on what this rank holds: at stage 1 its own gradient, not yet averaged over the ranks,
# clipped by its own norm (at stage 2 nothing, the gradient already reduce-scattered; at stage 3 it is right:
# FullyShard's .grad are DTensors, whose norm torch takes over every rank's rows).
TORCH_CLIP = solution_with("            clip_(cfg, model, opt)\n",
                           "            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)  # BUG: this rank's\n")

STUDENTS = [
    correct(LESSON, "train_loop", "answers"),
    # the stub's reason and the questions' both ask whether the cell is still the stub
    untouched(LESSON, "still the stub"),
    Student("no_accum_division", "each micro-batch's loss not divided by cfg.accum (AdamW hides it, SGD does not)",
            {**FULL, "test_capstone_losses": 0}, reason="too large", cells={"train_loop": NO_ACCUM_DIVISION, **SOLVED}),
    Student("zero_grad_per_micro", "zero_grad before every micro-batch: only the last one's gradient is used",
            {**FULL, "test_capstone_losses": 0}, reason="only the last micro-batch",
            cells={"train_loop": ZERO_GRAD_PER_MICRO, **SOLVED}),
    Student("whole_batch", "every rank runs the whole global batch instead of its slice",
            {**FULL, "test_capstone_data": 0}, reason="whole global batch",
            cells={"train_loop": WHOLE_BATCH, **SOLVED}),
    Student("resume_plus_one", "resumes at the checkpoint's step + 1: a step of data skipped",
            {**FULL, "test_capstone_resume": 0}, reason="after the checkpoint",
            cells={"train_loop": RESUME_PLUS_ONE, **SOLVED}),
    Student("resume_at_zero", "loads the checkpoint but starts the data again at step 0",
            {**FULL, "test_capstone_resume": 0}, reason="started again at step 0",
            cells={"train_loop": RESUME_AT_ZERO, **SOLVED}),
    Student("saves_before_step", "saves the checkpoint before the optimizer step, labelled as after it",
            {**FULL, "test_capstone_resume": 0}, reason="was saved when your loop had made 2 optimizer steps",
            cells={"train_loop": SAVES_BEFORE_STEP, **SOLVED}),
    Student("no_barrier", "no barrier after the save: the other ranks go on before rank 0 has written train.json",
            {**FULL, "test_capstone_resume": 0}, reason="had no train.json yet",
            cells={"train_loop": NO_BARRIER, **SOLVED}),
    Student("torch_clip", "clips with torch.nn.utils.clip_grad_norm_ on the model's parameters: each rank's own "
            "norm", {**FULL, "test_capstone_losses": 0}, reason="clipped by its own norm",
            cells={"train_loop": TORCH_CLIP, **SOLVED}),
]
