r"""Train a small GPT with the course's pieces, as a plain torchrun job (the capstone's script).

    torchrun --nproc_per_node=4 -m zerokit.train --stage 3 --steps 200
    python -m zerokit.train --nproc 2 --stage 2            # zerokit.launch starts the ranks
    # two machines, two processes each (tests/test_train.py runs two agents on one machine):
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --rdzv-backend=c10d \
             --rdzv-endpoint=HOST:29500 -m zerokit.train --stage 3      # node 1: --node_rank=1

The model is zerokit.models.TinyTransformer, a GPT (pre-norm blocks, causal attention) on
bytes: its vocabulary is the 256 byte values, so there is no tokenizer to fetch. The text is
the Python standard library's own source (the `.py` files at the top of `sysconfig`'s stdlib
path, in sorted order, up to `--data-mb`): on every machine with Python, without a
download, and real prose and code rather than a synthetic stream. Two machines with
different Python versions have different text; one machine always has the same.

The stages are the course's, in PyTorch's shapes, with torch.optim.AdamW:
    0  zerokit.DataParallel(model)                  (DDP)
    1  zerokit.ZeRO1(params, AdamW)                 (ZeroRedundancyOptimizer)
    2  zerokit.ZeRO2(params, AdamW)                 (FSDP2, no reshard after forward)
    3  zerokit.FullyShard(model, units=blocks)      (FSDP2 fully_shard)
--optimizer muon puts the blocks' matrices under Muon (lesson 09: torch.optim.Muon at stage 0,
zerokit.ZeRO1Muon at stage 1, each matrix owned whole by one rank) and the rest under AdamW;
ZeRO-2/3 cut the gradients into flat shards and refuse it. --recompute keeps only each
block's input and recomputes the rest in backward (zerokit.checkpoint_modules, lesson 08).
--precision bf16 computes in bfloat16: autocast for stage 0, zerokit.MixedPrecision (16-bit
weights, fp32 masters, gradients reduced in fp32) for 1 and 2, FullyShard's compute_dtype for 3.
--offload disk|cpu keeps AdamW's state off the device (lesson 08) through the lessons' own classes,
ZeRO1Adam/ZeRO2Adam/ZeRO3Adam (AdamW bit for bit), at stages 1-3.
--precision fp16 the same in float16, with lesson 06's dynamic loss scale: inside ZeRO1/ZeRO2
(MixedPrecision("fp16")) at stages 1 and 2, around the plain AdamW at 0 and 3 (LossScaling);
either way an inf or nan on any rank makes every rank skip the step.

The batch of step s is a function of (seed, s) alone: --batch sequences drawn from the text,
split evenly over the ranks (and over --accum micro-batches on each). So a run on any
number of ranks sees the same data and, in fp32, the same loss curve up to rounding, and a
checkpoint needs to record only the step to resume the data exactly where it stopped, on
any world size. Checkpoints (--checkpoint-every) go through zerokit.checkpoint.

Kill and restart: --resume means "go on from the last complete checkpoint if there is one,
else start at step 0" (the run says which), so the same command line serves a first launch
and torchrun's relaunch after a rank dies:

    torchrun --nproc_per_node=2 --max-restarts=1 -m zerokit.train --checkpoint-every 20 --resume

A checkpoint records the data position (the step) and what it depends on (--batch,
--seq-len, --seed, --data-mb and a checksum of the text); a resume that cannot mean the
same samples is an error, never a silent restart of the epoch. The environment variable
ZEROKIT_TRAIN_KILL_AT=STEP:RANK makes that rank SIGKILL itself right after STEP, on a job's
first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset): the fault the tests inject.

What it prints (rank 0, all of it off with --quiet): a progress bar with tokens/s and the
loss; after the first step, each rank's model-state bytes by category
(zerokit.memory.census) beside zerokit.memory.theory_bytes; a sample of generated text
before and after training. --out RUN.json also draws RUN.png, the loss against tokens
seen; `python -m zerokit.train --plot A.json B.json --to loss.png` overlays saved runs.

--impl torch runs the stage's PyTorch peer instead, on the same model, data and AdamW
(zerokit/bench/train_peers.py: DDP; DDP + ZeroRedundancyOptimizer; FSDP2's fully_shard
without and with resharding after forward), so both print tokens/s on the same job;
`python -m zerokit.bench.train_peers` measures the table in the README.
"""

import argparse
import json
import os
import re
import signal
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

STAGES = (0, 1, 2, 3)
THEORY_STAGE = ("ddp", "zero1", "zero2", "zero3")  # zerokit.memory.theory_bytes's names for 0-3
# what a data position means: a checkpoint saved with other values of these would resume other samples
DATA_KEYS = ("batch", "seq_len", "seed", "data_mb")
KILL_ENV = "ZEROKIT_TRAIN_KILL_AT"
PROMPT = b"import os\n\n\ndef "  # the sample's start: the model should go on with a function name


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerokit.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, choices=STAGES, default=3)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run included)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks together")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step on each rank")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=None, help="clip the gradient's global norm to this")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: Muon on the blocks' matrices (lesson 09; at stage 1 zerokit.ZeRO1Muon, each matrix "
                        "owned whole by one rank), AdamW on the rest; stages 0 and 1 only")
    p.add_argument("--offload", choices=("disk", "cpu"), default=None,
                   help="keep AdamW's state off the device (lesson 08: zerokit.offload, the lessons' ZeRO1Adam/"
                        "ZeRO2Adam/ZeRO3Adam, which are AdamW bit for bit); stages 1-3; cpu needs CUDA parameters")
    p.add_argument("--recompute", action="store_true",
                   help="recompute each block's activations in backward (zerokit.checkpoint_modules, lesson 08)")
    p.add_argument("--data-mb", type=float, default=2.0, help="MiB of standard-library source to train on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every this many steps (0: never)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--resume", action="store_true",
                   help="continue from the last complete checkpoint in --checkpoint-dir if there is one, else "
                        "start at step 0 (so a torchrun restart picks up where the job died)")
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
                   help="no progress bar, memory table or text samples: only the final line")
    args = p.parse_args(argv)
    if args.batch % args.accum:
        p.error(f"--batch {args.batch} is not divisible by --accum {args.accum}")
    if args.impl == "torch" and (args.checkpoint_every or args.resume):
        # zerokit.checkpoint reads and writes zerokit's shards; the peers are here to be timed
        p.error("--impl torch runs PyTorch's DDP/ZeroRedundancyOptimizer/fully_shard, which zerokit.checkpoint "
                "does not save: leave out --checkpoint-every and --resume")
    if args.precision == "fp16" and args.impl == "torch":
        p.error("--precision fp16 needs a loss scaler, which the PyTorch peers here do not bring: use bf16")
    if args.offload and (args.stage == 0 or args.impl == "torch" or args.optimizer == "muon"):
        p.error("--offload streams a ZeRO stage's own AdamW state (lesson 08): --stage 1, 2 or 3, with AdamW, "
                "not --impl torch")
    if args.optimizer == "muon":
        # Muon orthogonalises each matrix's whole update: ZeRO-2/3 cut gradients and weights into flat
        # shards, so a rank never holds a whole matrix's gradient to give it (lesson 09)
        if args.stage not in (0, 1) or args.impl == "torch":
            p.error("--optimizer muon runs at --stage 0 (DataParallel + torch.optim.Muon) or 1 (zerokit.ZeRO1Muon): "
                    "Muon needs each matrix's whole gradient, which ZeRO-2/3's flat shards cut (lesson 09)")
        if args.stage == 1 and (args.clip is not None or args.precision != "fp32"):
            p.error("--optimizer muon at --stage 1 takes neither --clip (ZeRO1Muon reduces the gradients inside "
                    "step(): there is no mean gradient before it to clip) nor a 16-bit --precision (its matrices stay "
                    "fp32): use --stage 0")
    if args.warmup < 0 or args.sample_bytes < 0:
        p.error("--warmup and --sample-bytes cannot be negative")
    return args


# ---------------------------------------------------------------------------------------
# data: bytes of the standard library's source


def corpus(megabytes):
    """The training text as a uint8 tensor: stdlib .py files in sorted order, up to `megabytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    limit, chunks, size = int(megabytes * 2**20), [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data[:limit - size])
        size += len(chunks[-1])
        if size >= limit:
            break
    if size < 2**16:
        raise RuntimeError(f"only {size} bytes of Python source under {root}: too little to train on")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def checksum(text):
    """CRC-32 of the training text: two Pythons' standard libraries differ, and a data position
    (a step) on one text is not the same samples on another."""
    return zlib.crc32(text.to(torch.uint8).numpy().tobytes())


def texts(args):
    """(training text, validation text: its last 5%, the whole text's checksum)."""
    text = corpus(args.data_mb)
    cut = int(len(text) * 0.95)
    return text[:cut], text[cut:], checksum(text)


def global_batch(text, step, batch, seq_len, seed):
    """(inputs, targets) of `step`, the same on every rank and at every world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([text[s:s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------------------
# the job


def build(args, world_size):
    """(model, optimizer, parameter count) of --stage and --impl; every rank starts from the same weights."""
    import zerokit
    from zerokit.models import TinyTransformer

    torch.manual_seed(args.seed)
    model = TinyTransformer(vocab=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                            seq_len=args.seq_len)
    n = sum(p.numel() for p in model.parameters())  # before any wrapper shards them
    if args.recompute:  # before any wrapper: the blocks themselves keep only their inputs
        zerokit.checkpoint_modules(model.blocks)
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    bf16 = args.precision == "bf16"  # the torch peers' one 16-bit format (fp16 is refused for them)
    half = HALF.get(args.precision)
    if args.optimizer == "muon":
        return (*build_muon(args, model, hyper), n)
    if args.offload:  # the lessons' classes: AdamW with its state where lesson 08 puts it
        precision = zerokit.MixedPrecision(half, reduce_dtype=torch.float32) if half else None
        if args.stage == 3:
            return model, zerokit.ZeRO3Adam(model, units=list(model.blocks), precision=precision,
                                            offload=args.offload, **hyper), n
        cls = zerokit.ZeRO1Adam if args.stage == 1 else zerokit.ZeRO2Adam
        return model, cls(model.parameters(), precision=precision, offload=args.offload, **hyper), n
    if args.impl == "torch":
        from zerokit.bench.train_peers import build_peer

        return (*build_peer(args.stage, model, bf16=bf16, **hyper), n)
    if args.stage == 0:
        model = zerokit.DataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), **hyper), n
    if args.stage in (1, 2):
        # fp16: MixedPrecision scales the loss itself (lesson 06's dynamic scaler, its verdict all-reduced)
        precision = zerokit.MixedPrecision(half, reduce_dtype=torch.float32) if half else None
        cls = zerokit.ZeRO1 if args.stage == 1 else zerokit.ZeRO2
        return model, cls(model.parameters(), torch.optim.AdamW, precision=precision, **hyper), n
    blocks = list(model.blocks)
    model = zerokit.FullyShard(model, units=blocks, compute_dtype=half)
    return model, torch.optim.AdamW(model.parameters(), **hyper), n


class Optimizers:
    """Several optimizers stepped and zeroed as one (--optimizer muon: Muon on the blocks' matrices,
    AdamW on the rest, as torch.optim.Muon's documentation pairs them). zerokit.checkpoint saves one
    optimizer: a checkpoint holds one part per optimizer, in a folder named after it."""

    def __init__(self, **parts):
        self.parts = parts

    def step(self):
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def state(self):  # for the memory table: every part's per-parameter state
        return {p: s for opt in self.parts.values() for p, s in opt.state.items()}

    def memory_categories(self):
        out = {}
        for opt in self.parts.values():
            for cat, tensors in getattr(opt, "memory_categories", dict)().items():
                out.setdefault(cat, []).extend(tensors)
        return out


def parts(opt):
    """[(folder in a checkpoint, optimizer)]: the optimizer itself at the top, or each part of Optimizers."""
    return list(opt.parts.items()) if isinstance(opt, Optimizers) else [("", opt)]


def build_muon(args, model, hyper):
    """(model, Optimizers) for --optimizer muon. Muon's learning rate is matched to AdamW's update
    size (adjust_lr_fn="match_rms_adamw", Moonlight's rule), so one --lr serves both."""
    import zerokit

    matrices = [p for p in model.blocks.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if not any(p is m for m in matrices)]
    muon = dict(hyper, adjust_lr_fn="match_rms_adamw")
    if args.stage == 0:
        model = zerokit.DataParallel(model)
        return model, Optimizers(muon=torch.optim.Muon(matrices, **muon), adamw=torch.optim.AdamW(rest, **hyper))
    return model, Optimizers(muon=zerokit.ZeRO1Muon(matrices, **muon),
                             adamw=zerokit.ZeRO1(rest, torch.optim.AdamW, **hyper))


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaling:
    """fp16 at stages 0 and 3, whose optimizer is a plain torch one: lesson 06's dynamic loss scale
    around it, through the same MixedPrecisionState that zerokit.ZeRO1/ZeRO2 hold for
    MixedPrecision("fp16") at stages 1 and 2. After backward the gradients (fp32: DataParallel's
    replicated mean, FullyShard's reduced shards) are divided by the scale in place, and one
    all-reduce of a flag tells every rank whether any rank saw an inf or nan: then every rank skips
    the step and the scale halves, so the ranks' scales and weights never part."""

    def __init__(self):
        from zerokit.mixed_precision import MixedPrecision, precision_state

        self.precision = precision_state(MixedPrecision("fp16"))
        self.scaler = self.precision.scaler  # the LossScaler: its scale and counters

    def load(self, state):
        """From a checkpoint's train.json: a resumed run goes on with the scale it had."""
        self.scaler.scale, self.scaler.clean_steps, self.scaler.skipped_steps = state

    def state(self):
        return [self.scaler.scale, self.scaler.clean_steps, self.scaler.skipped_steps]

    def scale(self, loss):
        return self.precision.scale_loss(loss)

    @torch.no_grad()
    def unscale_and_check(self, model):
        """Divide the gradients by the scale; True when every rank's are finite (the step may go on)."""
        # fp32 gradients: fp32_gradients divides these very tensors (.float() of fp32 is itself)
        self.precision.fp32_gradients([p.grad for p in model.parameters() if p.grad is not None])
        return self.precision.should_step()


def loss_scaling(args):
    """A LossScaling where this job needs one of its own (fp16, stage 0 or 3), else None."""
    own = args.stage in (0, 3) and not args.offload  # the lessons' ZeRO3Adam scales its loss itself
    return LossScaling() if args.precision == "fp16" and own else None


def skipped_steps(opt, scaler):
    """Steps an fp16 loss scale skipped (an inf or nan on some rank), or None without one."""
    inner = getattr(getattr(opt, "precision", None), "scaler", None)  # ZeRO1/ZeRO2's MixedPrecision("fp16")
    found = scaler.scaler if scaler is not None else inner
    return None if found is None else found.skipped_steps


def autocast_for(args):
    """torch.autocast in the job's 16-bit dtype where the stage computes under it (uses_autocast), else off."""
    return torch.autocast("cpu", dtype=HALF.get(args.precision, torch.bfloat16), enabled=uses_autocast(args))


def train_step(args, model, opt, train_text, step, rows, autocast, scaler=None):
    """Forward, backward (over --accum micro-batches), clipping and opt.step() of `step` on this
    rank's `rows` of the global batch; the rank's mean loss. The caller zeroes the gradients.
    scaler: fp16's LossScaling at stages 0 and 3 (a step with an inf or nan on some rank is skipped)."""
    x, y = global_batch(train_text, step, args.batch, args.seq_len, args.seed)
    x, y = x[rows], y[rows]
    total = torch.zeros(())
    for k in range(args.accum):
        xs, ys = x[k::args.accum], y[k::args.accum]
        with autocast:
            logits = model(xs)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), ys.reshape(-1))
        scaled = loss / args.accum
        if scaler is not None:
            scaled = scaler.scale(scaled)
        elif hasattr(opt, "scale_loss"):  # zerokit.ZeRO1/ZeRO2: the loss scale of MixedPrecision("fp16"), or 1
            scaled = opt.scale_loss(scaled)
        scaled.backward()
        total += loss.detach() / args.accum
    if scaler is not None and not scaler.unscale_and_check(model):
        return total  # an overflow on some rank: every rank skips this step
    if args.clip is not None:
        clip_(args, model, opt)
    opt.step()
    return total


def uses_autocast(args):
    """16 bits by torch.autocast: zerokit's stage 0 and the DDP-based peers (stages 0 and 1), whose
    weights stay fp32; the other stages hold 16-bit weights themselves (MixedPrecision, compute_dtype,
    FSDP2's MixedPrecisionPolicy)."""
    return args.precision != "fp32" and (args.stage == 0 or (args.impl == "torch" and args.stage == 1))


def clip_(args, model, opt):
    """Scale the gradient to global norm --clip; the norm before. Each stage knows its gradients:
    replicated and averaged (0), or disjoint shards whose squares add up over the ranks (1-3)."""
    if args.impl == "torch":
        # DDP's gradients are the replicated mean and FSDP2's are DTensor shards: torch's clip knows both
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if args.stage in (1, 2) or args.offload:  # zerokit's ZeRO optimizers clip their own reduced shards
        return float(opt.clip_grad_norm_(args.clip))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    if args.stage == 3:
        dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if norm > args.clip:
        for g in grads:
            g.mul_(args.clip / (norm + 1e-6))
    return norm


# ---------------------------------------------------------------------------------------
# checkpoints, resume, and the fault the tests inject


def checkpoints(directory):
    """The usable checkpoints in `directory`, oldest first: `step<k>` folders with zerokit.checkpoint's
    COMPLETE marker and this script's train.json (the data position, written just after the save;
    a job killed between the two left a checkpoint it cannot place in the data). Not `step<k>.partial`
    (a save that did not finish) nor `step<k>.old` (one being replaced by a newer save of that step)."""
    found = []
    for path in Path(directory).glob("step*"):
        m = re.fullmatch(r"step(\d+)", path.name)
        complete = (path / "COMPLETE").exists() or any((part / "COMPLETE").exists() for part in path.glob("*/"))
        if m and complete and (path / "train.json").exists():
            found.append((int(m.group(1)), path))
    return [path for _, path in sorted(found)]


def last_checkpoint(directory):
    done = checkpoints(directory)
    return done[-1] if done else None


def resume(args, model, opt, text_sum, world_size, restarts, scaler=None):
    """(step to start at, what to tell the user or None). Under --resume the last checkpoint is
    loaded into model and opt (a collective) when there is one; otherwise the run starts at 0."""
    import zerokit.checkpoint

    if not args.resume:
        found = last_checkpoint(args.checkpoint_dir) if restarts else None
        if found is not None:  # torchrun relaunched us: starting over would redo the epoch silently
            raise RuntimeError(f"torchrun restarted this job (restart {restarts}) but it was launched without "
                               f"--resume: it would start again at step 0 over the checkpoints in "
                               f"{args.checkpoint_dir} (the last is {found.name}); launch it with --resume")
        return 0, (f"no --resume: starting again at step 0" if restarts else None)
    found = last_checkpoint(args.checkpoint_dir)
    if found is None:
        return 0, f"--resume: no complete checkpoint in {args.checkpoint_dir}, starting at step 0"
    saved = json.loads((found / "train.json").read_text())
    for key in DATA_KEYS:  # the data stream must be the one saved
        if saved[key] != getattr(args, key):
            raise ValueError(f"{found} was saved with --{key.replace('_', '-')} {saved[key]}, this run has "
                             f"{getattr(args, key)}: its data position would not mean the same samples")
    if saved.get("text_crc32", text_sum) != text_sum:
        raise ValueError(f"{found} was saved on another training text (CRC-32 {saved['text_crc32']:08x}, this "
                         f"one {text_sum:08x}: another Python's standard library?), so its data position would "
                         f"not mean the same samples")
    if saved["step"] > args.steps:
        raise ValueError(f"{found} is at step {saved['step']}, past --steps {args.steps}: give --steps "
                         f"{saved['step']} or more to go on from it")
    for folder, part in parts(opt):
        zerokit.checkpoint.load(found / folder, model, part)
    if scaler is not None and saved.get("loss_scaling"):
        scaler.load(saved["loss_scaling"])
    return saved["step"], (f"resumed from {found} at step {saved['step']} (saved on N = "
                           f"{saved.get('world_size', '?')}, running on N = {world_size})")


def save_checkpoint(args, model, opt, step, rank, world_size, text_sum, scaler=None):
    import zerokit.checkpoint

    path = args.checkpoint_dir / f"step{step}"
    for folder, part in parts(opt):
        zerokit.checkpoint.save(path / folder, model, part)
    if rank == 0:  # the data position, beside the weights and optimizer state (see checkpoints())
        (path / "train.json").write_text(json.dumps({"step": step, "world_size": world_size,
                                                     "text_crc32": text_sum,
                                                     "loss_scaling": scaler.state() if scaler else None,
                                                     **{k: getattr(args, k) for k in DATA_KEYS}}))
    dist.barrier()


def kill_point(rank, restarts):
    """The step after which this rank SIGKILLs itself (ZEROKIT_TRAIN_KILL_AT=STEP:RANK), or None.
    Only on a job's first attempt: a relaunched job killed at the same step again would use up
    every restart torchrun has and never finish."""
    spec = os.environ.get(KILL_ENV, "").strip()
    if not spec:
        return None
    m = re.fullmatch(r"(\d+):(\d+)", spec)
    if m is None:
        raise ValueError(f"{KILL_ENV}={spec!r}: expected STEP:RANK, for example 3:1")
    step, who = map(int, m.groups())
    return step if who == rank and restarts == 0 else None


# ---------------------------------------------------------------------------------------
# what a student reads: memory by category, samples of text, the loss curve


def model_state_bytes(model, opt):
    """This rank's model-state bytes by category, as zerokit.memory.census counts them (distinct
    storages, first claim wins), of whatever the stage holds: zerokit's flat buffers and shards
    (memory_categories), DDP's buckets, FSDP2's DTensor shards (their local tensors)."""
    from zerokit.bench.accounting import MODEL_STATE, holdings
    from zerokit.memory import census

    class Held:  # hands holdings() to census as an optimizer's declared categories
        def memory_categories(self):
            return holdings(model, opt)

    got = census(None, Held(), "cpu", scan=False)
    return {k: got[k] for k in MODEL_STATE}


def report_memory(mine, args, world_size, n_params, step):
    """Every rank's model-state bytes (gathered: a collective) beside zerokit.memory.theory_bytes; rank 0 prints."""
    from zerokit.memory import format_bytes, theory_bytes

    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return everyone
    precision = "mixed" if args.precision != "fp32" and not uses_autocast(args) else "fp32"
    theory = theory_bytes(n_params, THEORY_STAGE[args.stage], world_size, precision)
    cols = ("parameters", "gradients", "optimizer_states")
    lines = [f"model state per rank after step {step} (zerokit.memory.census), beside "
             f"theory_bytes(Ψ = {n_params:,}, {THEORY_STAGE[args.stage]!r}, N = {world_size}, {precision!r}):",
             f"{'':>8}" + "".join(f"{c.replace('_', ' '):>18}" for c in cols + ("total",))]
    for r, got in enumerate(everyone):
        lines.append(f"{f'rank {r}':>8}" + "".join(f"{format_bytes(got[c]):>18}" for c in cols)
                     + f"{format_bytes(sum(got[c] for c in cols)):>18}")
    lines.append(f"{'theory':>8}" + "".join(f"{format_bytes(theory[c]):>18}" for c in cols + ("total",)))
    if args.optimizer == "muon":
        lines.append("  (theory: AdamW's 8 bytes of state per parameter; Muon keeps 4 on its matrices, a momentum, "
                     "and at stage 1 each on the rank that owns it: the measured state is below the line)")
    if precision == "mixed":
        lines.append("  (theory: 2 + 2 + 12 bytes per parameter; gradients reduced in fp32 hold 4, and an fp32 "
                     "shard that is its own master counts as parameters)")
    print("\n".join(lines), flush=True)
    return everyone


def readable(data):
    """Bytes as text a terminal shows safely: invalid UTF-8 and control characters (an untrained
    model's bytes are noise, escape sequences included) become U+FFFD."""
    text = data.decode("utf-8", errors="replace")
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


@torch.no_grad()
def generate(model, n, seq_len, seed, temperature=0.8):
    """PROMPT and `n` bytes sampled after it, each from the model's next-byte distribution at
    `temperature`, with a generator seeded by `seed`. Every rank runs it (under ZeRO-3 a forward
    is a collective) and draws the same bytes; the count is fixed, so no rank waits on another."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(list(PROMPT)).unsqueeze(0)
    for _ in range(n):
        logits = model(ids[:, -seq_len:])[0, -1].float()
        nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return readable(bytes(ids[0].tolist()))


def show_sample(model, args, step, rank):
    sample = generate(model, args.sample_bytes, args.seq_len, args.seed)
    if rank == 0:
        rule = "-" * 60
        print(f"sample at step {step} ({args.sample_bytes} bytes after the prompt, temperature 0.8, "
              f"seed {args.seed}):\n{rule}\n{sample}\n{rule}", flush=True)
    return sample


def label(result):
    impl = "torch peer" if result.get("impl") == "torch" else "zerokit"
    text = f"stage {result['stage']} {impl}, N = {result['world_size']}, {result['precision']}"
    text += ", Muon + AdamW" if result.get("optimizer") == "muon" else ""
    return text + (f" (resumed at step {result['start']})" if result.get("start") else "")


def plot_losses(results, to, title=None):
    """The training loss against tokens seen, one line per run, on one axes, as a PNG at `to`
    (matplotlib's Agg canvas: no display, and no change to pyplot's backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for result in results:
        steps = sorted(result["losses"], key=int)
        ax.plot([int(k) * result["tokens_per_step"] for k in steps], [result["losses"][k] for k in steps],
                label=label(result), linewidth=1.2)
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title or "python -m zerokit.train")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(to).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(to, dpi=110)
    return Path(to)


def load_run(path):
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--plot: cannot read {path}: {exc}") from None
    missing = [k for k in ("losses", "tokens_per_step", "stage", "world_size", "precision") if k not in result]
    if missing:
        raise SystemExit(f"--plot: {path} is not a run python -m zerokit.train --out wrote (no {', '.join(missing)})")
    return result


# ---------------------------------------------------------------------------------------
# the job


def train(rank, world_size, args):
    from zerokit.widgets import progress

    if args.batch % (world_size * args.accum):
        raise ValueError(f"--batch {args.batch} must divide by world size x --accum = {world_size * args.accum}")
    if args.threads:
        torch.set_num_threads(args.threads)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    kill_at = kill_point(rank, restarts)
    train_text, val_text, text_sum = texts(args)
    model, opt, n_params = build(args, world_size)
    scaler = loss_scaling(args)
    start, said = resume(args, model, opt, text_sum, world_size, restarts, scaler)
    if rank == 0 and said:  # said even when --quiet: where a run starts is never a detail
        print((f"torchrun restart {restarts}: " if restarts else "") + said, flush=True)
    samples, memory = {}, None
    if not args.quiet and args.sample_bytes:
        samples[start] = show_sample(model, args, start, rank)
    per_rank = args.batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    steps = range(start, args.steps)
    warmup = min(args.warmup, max(len(steps) - 1, 0))  # at least one timed step when there is one
    losses, tokens, seconds = {}, 0, 0.0  # tokens and seconds of the timed steps (after warm-up)
    step_seconds = []  # each timed step's, for a median that a busy machine's bursts do not move
    bar = progress(steps, desc=f"stage {args.stage}{' torch' if args.impl == 'torch' else ''}, N = {world_size}") \
        if rank == 0 and not args.quiet else steps
    autocast = autocast_for(args)
    for step in bar:
        t = time.perf_counter()
        total = train_step(args, model, opt, train_text, step, rows, autocast, scaler)
        if step == start and not args.quiet:  # the gradients are still there: every category is full
            busy = time.perf_counter() - t
            memory = report_memory(model_state_bytes(model, opt), args, world_size, n_params, step + 1)
            t = time.perf_counter() - busy  # the report's time is not the step's
        opt.zero_grad()
        dist.all_reduce(total)  # the global batch's mean loss, for the record
        losses[step + 1] = float(total) / world_size
        if step - start >= warmup:
            step_seconds.append(time.perf_counter() - t)
            seconds += step_seconds[-1]
            tokens += args.batch * args.seq_len
        if bar is not steps:
            bar.set_postfix(loss=f"{losses[step + 1]:.3f}", refresh=False,
                            **({"tok_s": f"{tokens / seconds:.0f}"} if seconds else {}))
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(args, model, opt, step + 1, rank, world_size, text_sum, scaler)
        if kill_at == step + 1:  # the injected fault: this rank dies as a killed process does, at once
            print(f"{KILL_ENV}: rank {rank} kills itself with SIGKILL after step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if hasattr(bar, "close"):
        bar.close()
    if not args.quiet and args.sample_bytes and len(steps):
        samples[args.steps] = show_sample(model, args, args.steps, rank)
    val = evaluate(model, val_text, args)
    # every rank's last collectives (evaluate's all-gathers under ZeRO-3) are over before rank 0
    # alone goes on to write files and the others tear their process groups down
    dist.barrier()
    result = {"stage": args.stage, "impl": args.impl, "precision": args.precision, "optimizer": args.optimizer,
              "recompute": args.recompute, "world_size": world_size,
              "skipped_steps": skipped_steps(opt, scaler),
              "start": start, "batch": args.batch, "seq_len": args.seq_len,
              "tokens_per_step": args.batch * args.seq_len, "losses": losses, "val_loss": val,
              "tokens_per_s": tokens / seconds if seconds else None, "step_seconds": step_seconds,
              "params": n_params, "memory": memory, "samples": samples}
    if rank == 0:
        what = f"stage {args.stage}{' (torch peer)' if args.impl == 'torch' else ''}, N = {world_size}, " \
               f"{args.precision}"
        if not losses:
            print(f"{what}: nothing left to train (the job is at step {start} of {args.steps}), "
                  f"validation {val:.4f}", flush=True)
        else:
            speed = f", {result['tokens_per_s']:.0f} tokens/s" if result["tokens_per_s"] else ""
            print(f"{what}: steps {start + 1}-{args.steps}, final loss {losses[args.steps]:.4f}, "
                  f"validation {val:.4f}{speed}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
            if losses:
                plot_losses([result], args.out.with_suffix(".png"))
    return result


@torch.no_grad()
def evaluate(model, val_text, args, batches=4):
    """The mean loss on held-out text (the last 5%), the same sequences at every world size."""
    total = 0.0
    for b in range(batches):
        x, y = global_batch(val_text, b, args.batch, args.seq_len, args.seed + 1)
        logits = model(x)
        total += float(F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1)))
    return total / batches


def init_under_torchrun():
    """dist.init_process_group("gloo") in a worker torchrun started, safe after a restart.

    torchrun (torch 2.13, the c10d rendezvous) hands every attempt of a job the same TCPStore,
    its own, and init_process_group keys gloo's addresses by group name alone: a relaunched
    rank can read the address a killed rank of the previous attempt published and fail with
    "Gloo connectFullMesh failed ... Connection refused" (about one restart in three here;
    pytorch/pytorch#135712). On one node every worker's TORCHELASTIC_RESTART_COUNT is the same
    (one agent counts), so each attempt gets keys of its own under that count. Across nodes the
    agents' counts can disagree (pytorch/pytorch#108158), which would split the ranks between
    two prefixes: there, launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead
    (rank 0 then hosts a fresh store per attempt)."""
    # Before the group exists: torch.distributed.nn.functional's functions default to
    # group=group.WORLD, read when it is imported, and the first torch.optim optimizer imports it
    # (through torch._dynamo). Imported after init_process_group, those defaults hold the group
    # past destroy_process_group: gloo's threads then live into the interpreter's exit, where a rank
    # of 3 restarted jobs in 140 here aborted after its last step ("terminate called without an
    # active exception", SIGABRT; none of 140 with this import). zerokit.launch's ranks leave with
    # os._exit.
    import torch.distributed.nn.functional  # noqa: F401

    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not (restarts and shared and os.environ.get("GROUP_WORLD_SIZE", "1") == "1"):
        if restarts and shared and os.environ.get("RANK") == "0":
            print("torchrun restarted a job of several nodes that share the agent's store: if the ranks fail to "
                  "connect (a dead attempt's gloo addresses), launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                  flush=True)
        dist.init_process_group("gloo")
        return
    store, rank, world_size = next(dist.rendezvous("env://"))  # the agent's store, as init_process_group gets it
    dist.init_process_group("gloo", store=dist.PrefixStore(f"zerokit.train/attempt{restarts}", store),
                            rank=rank, world_size=world_size)


def main(argv=None):
    args = parse_args(argv)
    if args.plot:
        to = plot_losses([load_run(p) for p in args.plot], args.to)
        print(f"{len(args.plot)} runs drawn to {to}")
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: it started this rank
        if args.nproc:
            raise SystemExit("--nproc starts ranks itself: leave it out under torchrun")
        init_under_torchrun()
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    import zerokit

    zerokit.launch(train, args.nproc or 1, args=(args,), backend="gloo", timeout=None)


if __name__ == "__main__":
    sys.exit(main())
