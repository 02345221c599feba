"""python -m zerokit.train's command line: the options, what they mean, and which combinations it refuses."""

import argparse
from pathlib import Path

import torch

from zerokit.stages import STAGE_NAMES, STAGES as STAGE_RECORDS, get_stage

STAGES = tuple(s.number for s in STAGE_RECORDS)
THEORY_STAGE = STAGE_NAMES  # zerokit.memory.theory_bytes's names for 0-3
# what a data position means: a checkpoint saved with other values of these would resume other samples
DATA_KEYS = ("batch", "seq_len", "seed", "data_mb")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
DESCRIPTION = "Train a small GPT with the course's pieces, as a plain torchrun job (the capstone's script)."

# --preset: model shapes a user compares against published runs. Each sets these options' defaults;
# an option given on the command line wins.
PRESETS = {
    # GPT-2 small's body: width 768, 12 blocks of 12 heads, a context of 1024, and GPT-2's learning rate.
    # The vocabulary stays the 256 byte values, so the model has 86.2 M parameters, not GPT-2's 124 M:
    # GPT-2's 50,257-token embedding (38.6 M) and its tied head are what is missing. The blocks (85.0 M)
    # are GPT-2 small's; a token costs 6 x 85.2 M + attention FLOPs here against 6 x 123.7 M + attention
    # in GPT-2 small, whose head is a 768 x 50,257 matmul. MFU divides by each model's own count.
    "gpt2-small": {"dim": 768, "layers": 12, "heads": 12, "seq_len": 1024, "lr": 6e-4},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerokit.train", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, choices=STAGES, default=3)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run included)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks together")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step on each rank")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a published model's shape as the defaults of --dim, --layers, --heads, --seq-len and --lr "
                        "(options given win). gpt2-small: width 768, 12 layers, 12 heads, context 1024, lr 6e-4; with "
                        "the 256-byte vocabulary that is 86.2 M parameters, not GPT-2's 124 M (its 50,257-token "
                        "embedding is 38.6 M of them): GPT-2 small's blocks, not its vocabulary")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--sync-each-micro-batch", action="store_true",
                   help="reduce every micro-batch's gradient (k reductions a step). Default: the micro-batches but "
                        "the last accumulate without communication (DataParallel's and ZeRO-2's no_sync, "
                        "FullyShard's set_requires_gradient_sync(False); ZeRO-1 reduces once in step() anyway), "
                        "one reduction a step; at stages 2 and 3 that holds the unsharded gradient (4 Psi) "
                        "between micro-batches instead of 4 Psi / N")
    p.add_argument("--reshard-after-forward", type=_reshard, default=None, metavar="true|false|K",
                   help="stage 3 (FullyShard, and FSDP2 under --impl torch): after a block's forward, free its "
                        "weights (true: gathered again for backward), keep them (false: no second all-gather, "
                        "ZeRO-2's memory for the parameters), or keep a shard of them over K ranks (hpZ: "
                        "backward's all-gather stays within K ranks, one node); default: true for the blocks, "
                        "false for the root, as FSDP2's default")
    p.add_argument("--clip", type=float, default=None, help="clip the gradient's global norm to this")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: Muon on the blocks' matrices (lesson 09; at stage 1 zerokit.ZeRO1Muon, each matrix "
                        "owned whole by one rank), AdamW on the rest; stages 0 and 1 only")
    p.add_argument("--offload", choices=("disk", "cpu"), default=None,
                   help="keep AdamW's state off the device (lesson 08: zerokit.offload, the lessons' ZeRO1Adam/"
                        "ZeRO2Adam/ZeRO3Adam, which are AdamW bit for bit); stages 1-3; cpu needs CUDA parameters")
    p.add_argument("--recompute", action="store_true",
                   help="recompute each block's activations in backward (zerokit.checkpoint_modules, lesson 08)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: one GPU per local rank with NCCL when there are enough, gloo with the ranks sharing "
                        "the GPUs when there are fewer, the CPU (gloo) without one; cuda: the same, an error "
                        "without a GPU; cpu: gloo on the CPU even where there are GPUs")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile each block's forward with this backend (default inductor; aot_eager traces "
                        "without generating code): the stages' hooks stay outside the compiled code. The first "
                        "steps compile: leave them out of tokens/s with --warmup")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense 16-bit peak for MFU, in TFLOPS per device (default: the known GPUs' "
                        "table in zerokit/train/speed.py; on the CPU MFU is n/a without it)")
    p.add_argument("--data-mb", type=float, default=2.0, help="MiB of standard-library source to train on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every this many steps (0: never)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--resume", action="store_true",
                   help="continue from the last complete checkpoint in --checkpoint-dir if there is one, else "
                        "start at step 0 (so a torchrun restart picks up where the job died)")
    p.add_argument("--overwrite", action="store_true",
                   help="start at step 0 over existing checkpoints: first delete every step<k> folder in "
                        "--checkpoint-dir (step<k>.partial, .old and .deleting too; nothing else there). Without it "
                        "a launch that would save there, or a torchrun restart, over checkpoints and without "
                        "--resume is refused")
    p.add_argument("--keep", type=int, default=None, metavar="N",
                   help="keep the last N complete checkpoints: once a save is complete, older ones are deleted "
                        "(default: keep every one)")
    p.add_argument("--impl", choices=("zerokit", "torch"), default="zerokit",
                   help="zerokit's wrapper for --stage, or its PyTorch peer (DDP, DDP + ZeroRedundancyOptimizer, "
                        "FSDP2 fully_shard) on the same model, data and AdamW")
    p.add_argument("--warmup", type=int, default=1,
                   help="steps left out of tokens/s (the first allocates buffers and optimizer state)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on each rank (default: as is)")
    p.add_argument("--sample-bytes", type=int, default=48,
                   help="bytes of text to generate before and after training (0: none)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the losses and figures as JSON here, and the loss curve beside it as .png (rank 0)")
    p.add_argument("--plot", type=Path, nargs="+", default=None, metavar="RUN.json",
                   help="train nothing: draw the loss curves of these --out files on one axes, to --to")
    p.add_argument("--to", type=Path, default=Path("loss.png"), help="the figure --plot writes")
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many ranks with zerokit.launch (not under torchrun)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar, memory table or text samples: only the device and the final line")
    preset, _ = _preset_parser().parse_known_args(argv)
    if preset.preset:
        p.set_defaults(**PRESETS[preset.preset])
    args = p.parse_args(argv)
    _refuse_combinations(p, args)
    return args


def _reshard(text):
    """--reshard-after-forward's value: true, false or a positive integer."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        k = int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give true, false or a number of ranks K") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"{k}: K is a number of ranks, 1 or more")
    return k


def _preset_parser():
    """--preset alone, read before the other options: its values become their defaults."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    return p


def _refuse_combinations(p, args):
    if args.batch % args.accum:
        p.error(f"--batch {args.batch} is not divisible by --accum {args.accum}")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not divisible by --heads {args.heads}")
    if args.impl == "torch" and (args.checkpoint_every or args.resume):
        # zerokit.checkpoint reads and writes zerokit's shards; the peers are here to be timed
        p.error("--impl torch runs PyTorch's DDP/ZeroRedundancyOptimizer/fully_shard, which zerokit.checkpoint "
                "does not save: leave out --checkpoint-every and --resume")
    if args.precision == "fp16" and args.impl == "torch":
        p.error("--precision fp16 needs a loss scaler, which the PyTorch peers here do not bring: use bf16")
    stage = get_stage(args.stage)
    if args.offload and (not stage.offloads or args.impl == "torch" or args.optimizer == "muon"):
        p.error("--offload streams a ZeRO stage's own AdamW state (lesson 08): --stage 1, 2 or 3, with AdamW, "
                "not --impl torch")
    if args.optimizer == "muon":
        # Muon orthogonalises each matrix's whole update: ZeRO-2 cuts gradients into flat shards, stage 3
        # into rows (FullyShard's DTensors), so a rank never holds a whole matrix's gradient to give it (lesson 09)
        if stage.muon is None or args.impl == "torch":
            p.error("--optimizer muon runs at --stage 0 (DataParallel + torch.optim.Muon) or 1 (zerokit.ZeRO1Muon): "
                    "Muon needs each matrix's whole gradient, which ZeRO-2's flat shards and stage 3's row shards "
                    "cut (lesson 09)")
        if stage.muon == "ZeRO1Muon" and (args.clip is not None or args.precision != "fp32"):
            p.error("--optimizer muon at --stage 1 takes neither --clip (ZeRO1Muon reduces the gradients inside "
                    "step(): there is no mean gradient before it to clip) nor a 16-bit --precision (its matrices stay "
                    "fp32): use --stage 0")
    if args.reshard_after_forward is not None and (not stage.fsdp_controls or args.offload):
        p.error("--reshard-after-forward is a control of stage 3's FullyShard (and of FSDP2 under --impl torch): "
                "give --stage 3, without --offload (the lessons' ZeRO3Adam reshards after every forward)")
    if args.resume and args.overwrite:
        p.error("--resume goes on from the checkpoints and --overwrite deletes them: give one of the two")
    if args.keep is not None and args.keep < 1:
        p.error(f"--keep {args.keep}: keep at least the last checkpoint (leave --keep out to keep every one)")
    if args.warmup < 0 or args.sample_bytes < 0:
        p.error("--warmup and --sample-bytes cannot be negative")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error("--peak-tflops must be positive")
