r"""Train a small GPT with the course's pieces, as a plain torchrun job (the capstone's script).

    torchrun --nproc_per_node=4 -m zerokit.train --stage 3 --steps 200
    python -m zerokit.train --nproc 2 --stage 2            # zerokit.launch starts the ranks
    # two machines, two processes each (tests/test_train.py runs two agents on one machine); the
    # c10d rendezvous numbers the nodes itself (torchrun ignores --node-rank under it):
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
             --rdzv-id=JOB -m zerokit.train --stage 3           # the same command on both machines

The model is zerokit.models.TinyTransformer, a GPT (pre-norm blocks, causal attention through
F.scaled_dot_product_attention) on bytes: its vocabulary is the 256 byte values, so there is no
tokenizer to fetch. The text is the Python standard library's own source (the `.py` files at the
top of `sysconfig`'s stdlib path, in sorted order, up to `--data-mb`): on every machine with
Python, without a download, and real prose and code rather than a synthetic stream. Two
machines with different Python versions have different text; one machine always has the same.
--preset gpt2-small gives the model GPT-2 small's blocks (85 M parameters of 86 M: the byte
vocabulary keeps the embedding small; options.py says what that changes).

Where it runs (device.py): one GPU per local rank with NCCL when there are enough, gloo with the
ranks sharing the GPUs when there are fewer, gloo on the CPU without a GPU; --device overrides,
and the job's first line says which and why. Everything runs there: the model, the batches
(drawn on the CPU, the same on every device), the loss, autocast, samples, evaluation, the
memory census, checkpoints.

The stages are the course's, in PyTorch's shapes, with torch.optim.AdamW:
    0  zerokit.DataParallel(model)                  (DDP)
    1  zerokit.ZeRO1(params, AdamW)                 (ZeroRedundancyOptimizer)
    2  zerokit.ZeRO2(params, AdamW)                 (FSDP2, no reshard after forward)
    3  zerokit.FullyShard(model, units=blocks)      (FSDP2 fully_shard)
--optimizer muon puts the blocks' matrices under Muon (lesson 09: torch.optim.Muon at stage 0,
zerokit.ZeRO1Muon at stage 1, each matrix owned whole by one rank) and the rest under AdamW;
ZeRO-2 cuts the gradients into flat shards and stage 3 into row shards (a rank holds some rows of
each matrix, never a whole one), so both refuse it. --recompute keeps only each
block's input and recomputes the rest in backward (zerokit.checkpoint_modules, lesson 08).
--precision bf16 computes in bfloat16: autocast for stage 0, zerokit.MixedPrecision (16-bit
weights, fp32 masters, gradients reduced in fp32) for 1 and 2, FullyShard's compute_dtype for 3.
--offload disk|cpu keeps AdamW's state off the device (lesson 08) through the lessons' own classes,
ZeRO1Adam/ZeRO2Adam/ZeRO3Adam (AdamW bit for bit), at stages 1-3 (cpu: pinned host memory, for a
job on GPUs). --precision fp16 the same in float16, with lesson 06's dynamic loss scale: inside
ZeRO1/ZeRO2 (MixedPrecision("fp16")) at stages 1 and 2, around the plain AdamW at 0 and 3
(LossScaling); either way an inf or nan on any rank makes every rank skip the step.
--compile compiles each block's forward (build.py says why the blocks and not the model).

The batch of step s is a function of (seed, s) alone: --batch sequences drawn from the text,
split evenly over the ranks (and over --accum micro-batches on each). So a run on any
number of ranks sees the same data and, in fp32, the same loss curve up to rounding, and a
checkpoint needs to record only the step to resume the data exactly where it stopped, on
any world size. Checkpoints (--checkpoint-every) go through zerokit.checkpoint (checkpointing.py).

Kill and restart: --resume means "go on from the last complete checkpoint if there is one,
else start at step 0" (the run says which), so the same command line serves a first launch
and torchrun's relaunch after a rank dies:

    torchrun --nproc_per_node=2 --max-restarts=1 -m zerokit.train --checkpoint-every 20 --resume

A checkpoint records the data position (the step), what it depends on (--batch, --seq-len,
--seed, --data-mb and a checksum of the text) and the losses so far; a resume that cannot mean
the same samples is an error, never a silent restart of the epoch, and so is a launch without
--resume over a folder of checkpoints (--overwrite deletes them first). --keep N keeps the last
N. The environment variable ZEROKIT_TRAIN_KILL_AT=STEP:RANK makes that rank SIGKILL itself
right after STEP, on a job's first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset): the
fault the tests inject.

What it prints (rank 0): where it runs; then, all of it off with --quiet, a progress bar with the
loss, tokens/s and MFU (speed.py); after the first step, each rank's model-state bytes by
category (zerokit.memory.census) beside zerokit.memory.theory_bytes; a sample of generated text
before and after training. --out RUN.json also draws RUN.png, the loss against tokens seen
from step 1, a resumed job's earlier attempts included; `python -m zerokit.train --plot A.json
B.json --to loss.png` overlays saved runs.

--impl torch runs the stage's PyTorch peer instead, on the same model, data and AdamW
(peers.py: DDP; DDP + ZeroRedundancyOptimizer; FSDP2's fully_shard without and with resharding
after forward), so both print tokens/s on the same job; `python -m zerokit.bench.train_peers`
measures the table in the README.

The parts, each a module of this package: options (the command line), data (the text and its
batches), device (where a rank runs), build (model, wrapper, optimizer), peers (PyTorch's
peers, and what any system holds), step (one optimizer step), checkpointing, speed (FLOPs and
MFU), show (memory table, samples, loss curves), job (a rank's run, and main).
"""

from .build import Optimizers, build, build_muon, gpt, parts, shape
from .checkpointing import KILL_ENV, checkpoints, kill_point, last_checkpoint, resume, save_checkpoint, scan
from .data import checksum, corpus, global_batch, texts
from .device import Placement, placement
from .job import evaluate, init_under_torchrun, main, train
from .options import DATA_KEYS, HALF, PRESETS, STAGES, THEORY_STAGE, parse_args
from .peers import holdings
from .show import PROMPT, generate, label, load_run, model_state_bytes, plot_losses, readable, report_memory, \
    show_sample
from .speed import flops_per_token, peak_tflops
from .step import (LossScaling, autocast_for, clip_, gradient_sync, loss_scaling, skipped_steps, train_step,
                   uses_autocast)

__all__ = [
    "DATA_KEYS", "HALF", "KILL_ENV", "PRESETS", "PROMPT", "STAGES", "THEORY_STAGE", "LossScaling", "Optimizers",
    "Placement", "autocast_for", "build", "build_muon", "checkpoints", "checksum", "clip_", "corpus",
    "evaluate", "flops_per_token", "generate", "global_batch", "gpt", "gradient_sync", "holdings",
    "init_under_torchrun", "kill_point", "label", "last_checkpoint", "load_run", "loss_scaling", "main",
    "model_state_bytes", "parse_args", "parts", "peak_tflops", "placement", "plot_losses", "readable",
    "report_memory", "resume", "save_checkpoint", "scan", "shape", "show_sample", "skipped_steps", "texts",
    "train", "train_step", "uses_autocast",
]
