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
--precision bf16 computes in bfloat16: autocast for stage 0, zerokit.MixedPrecision (16-bit
weights, fp32 masters, gradients reduced in fp32) for 1 and 2, FullyShard's compute_dtype for 3.

The batch of step s is a function of (seed, s) alone: --batch sequences drawn from the text,
split evenly over the ranks (and over --accum micro-batches on each). So a run on any
number of ranks sees the same data and, in fp32, the same loss curve up to rounding, and a
checkpoint needs to record only the step to resume the data exactly where it stopped, on
any world size. Checkpoints (--checkpoint-every) go through zerokit.checkpoint.
"""

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

STAGES = (0, 1, 2, 3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m zerokit.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--stage", type=int, choices=STAGES, default=3)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
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
    p.add_argument("--data-mb", type=float, default=2.0, help="MiB of standard-library source to train on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every this many steps (0: never)")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    p.add_argument("--out", type=Path, default=None, help="write the losses and figures as JSON here (rank 0)")
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many ranks with zerokit.launch (not under torchrun)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.batch % args.accum:
        p.error(f"--batch {args.batch} is not divisible by --accum {args.accum}")
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


def global_batch(text, step, batch, seq_len, seed):
    """(inputs, targets) of `step`, the same on every rank and at every world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(text) - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([text[s:s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


# ---------------------------------------------------------------------------------------
# the job


def build(args, world_size):
    """(model, optimizer, parameter count) of --stage; every rank starts from the same weights."""
    import zerokit
    from zerokit.models import TinyTransformer

    torch.manual_seed(args.seed)
    model = TinyTransformer(vocab=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                            seq_len=args.seq_len)
    n = sum(p.numel() for p in model.parameters())  # before any wrapper shards them
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    bf16 = args.precision == "bf16"
    if args.stage == 0:
        model = zerokit.DataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), **hyper), n
    if args.stage in (1, 2):
        precision = zerokit.MixedPrecision("bf16", reduce_dtype=torch.float32) if bf16 else None
        cls = zerokit.ZeRO1 if args.stage == 1 else zerokit.ZeRO2
        return model, cls(model.parameters(), torch.optim.AdamW, precision=precision, **hyper), n
    blocks = list(model.blocks)
    model = zerokit.FullyShard(model, units=blocks, compute_dtype=torch.bfloat16 if bf16 else None)
    return model, torch.optim.AdamW(model.parameters(), **hyper), n


def clip_(args, model, opt):
    """Scale the gradient to global norm --clip; the norm before. Each stage knows its gradients:
    replicated and averaged (0), or disjoint shards whose squares add up over the ranks (1-3)."""
    if args.stage in (1, 2):
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


def last_checkpoint(directory):
    done = sorted((p for p in Path(directory).glob("step*") if (p / "COMPLETE").exists()),
                  key=lambda p: int(p.name[4:]))
    return done[-1] if done else None


def train(rank, world_size, args):
    import zerokit.checkpoint
    from zerokit.widgets import progress

    if args.batch % (world_size * args.accum):
        raise ValueError(f"--batch {args.batch} must divide by world size x --accum = {world_size * args.accum}")
    text = corpus(args.data_mb)
    cut = int(len(text) * 0.95)
    train_text, val_text = text[:cut], text[cut:]
    model, opt, n_params = build(args, world_size)
    start = 0
    if args.resume and (found := last_checkpoint(args.checkpoint_dir)) is not None:
        saved = json.loads((found / "train.json").read_text())
        for key in ("batch", "seq_len", "seed", "data_mb"):  # the data stream must be the one saved
            if saved[key] != getattr(args, key):
                raise ValueError(f"{found} was saved with --{key.replace('_', '-')} {saved[key]}, this run has "
                                 f"{getattr(args, key)}: its data position would not mean the same samples")
        zerokit.checkpoint.load(found, model, opt)
        start = saved["step"]
    per_rank = args.batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses, t0, tokens = {}, time.perf_counter(), 0
    bar = progress(range(start, args.steps), desc=f"stage {args.stage}, N = {world_size}") \
        if rank == 0 and not args.quiet else range(start, args.steps)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.stage == 0 and args.precision == "bf16")
    for step in bar:
        x, y = global_batch(train_text, step, args.batch, args.seq_len, args.seed)
        x, y = x[rows], y[rows]
        total = torch.zeros(())
        for k in range(args.accum):
            xs, ys = x[k::args.accum], y[k::args.accum]
            with autocast:
                logits = model(xs)
            loss = F.cross_entropy(logits.float().reshape(-1, 256), ys.reshape(-1))
            (loss / args.accum).backward()
            total += loss.detach() / args.accum
        if args.clip is not None:
            clip_(args, model, opt)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)  # the global batch's mean loss, for the record
        losses[step + 1] = float(total) / world_size
        tokens += args.batch * args.seq_len
        if rank == 0 and hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[step + 1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            path = args.checkpoint_dir / f"step{step + 1}"
            zerokit.checkpoint.save(path, model, opt)
            if rank == 0:
                (path / "train.json").write_text(json.dumps({"step": step + 1, **{
                    k: getattr(args, k) for k in ("batch", "seq_len", "seed", "data_mb")}}))
            dist.barrier()
    seconds = time.perf_counter() - t0
    val = evaluate(model, val_text, args)
    result = {"stage": args.stage, "precision": args.precision, "world_size": world_size, "start": start,
              "losses": losses, "val_loss": val, "tokens_per_s": tokens / seconds if seconds else None,
              "params": n_params}
    if rank == 0:
        print(f"stage {args.stage}, N = {world_size}, {args.precision}: steps {start + 1}-{args.steps}, "
              f"final loss {losses.get(args.steps, float('nan')):.4f}, validation {val:.4f}, "
              f"{result['tokens_per_s']:.0f} tokens/s")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
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


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: it started this rank
        if args.nproc:
            raise SystemExit("--nproc starts ranks itself: leave it out under torchrun")
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    import zerokit

    zerokit.launch(train, args.nproc or 1, args=(args,), backend="gloo", timeout=None)


if __name__ == "__main__":
    sys.exit(main())
