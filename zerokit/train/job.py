"""The job: one rank's training run (`train`), and the command line that starts the ranks (`main`)."""

import json
import os
import signal
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .build import build, shape
from .checkpointing import KILL_ENV, kill_point, resume, save_checkpoint
from .data import global_batch, texts
from .device import local_placement, placement, prepare, take_place
from .show import model_state_bytes, plot_losses, load_run, report_memory, show_sample
from .speed import device_peak, flops_per_token, mfu
from .step import autocast_for, loss_scaling, skipped_steps, train_step


def train(rank, world_size, args):
    """Train on this rank (its process group is up) from step 0, or from the last checkpoint under
    --resume, to --steps; rank 0 prints and writes what the options ask for. Returns the run's record
    (losses of every step from 1, a resumed attempt's earlier steps included; tokens/s and MFU of this
    attempt's timed steps; memory; samples)."""
    from zerokit.widgets import progress

    if args.batch % (world_size * args.accum):
        raise ValueError(f"--batch {args.batch} must divide by world size x --accum = {world_size * args.accum}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = take_place(getattr(args, "device", "auto"))
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    kill_at = kill_point(rank, restarts)
    train_text, val_text, text_sum = texts(args)
    model, opt, n_params = build(args, world_size, device)
    scaler = loss_scaling(args)
    start, losses, said = resume(args, model, opt, text_sum, world_size, restarts, scaler)
    if rank == 0 and said:  # said even when --quiet: where a run starts is never a detail
        print("\n".join((f"torchrun restart {restarts}: " if restarts else "") + line for line in said), flush=True)
    speed = Speed(args, device, world_size)
    samples, memory = {}, None
    if not args.quiet and args.sample_bytes:
        samples[start] = show_sample(model, args, start, rank, device)
    per_rank = args.batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    steps = range(start, args.steps)
    warmup = min(args.warmup, max(len(steps) - 1, 0))  # at least one timed step when there is one
    tokens, seconds = 0, 0.0  # tokens and seconds of the timed steps (after warm-up)
    step_seconds = []  # each timed step's, for a median that a busy machine's bursts do not move
    bar = progress(steps, desc=f"stage {args.stage}{' torch' if args.impl == 'torch' else ''}, N = {world_size}") \
        if rank == 0 and not args.quiet else steps
    autocast = autocast_for(args, device)
    for step in bar:
        t = time.perf_counter()
        total = train_step(args, model, opt, train_text, step, rows, autocast, scaler, device)
        if step == start and not args.quiet:  # the gradients are still there: every category is full
            busy = time.perf_counter() - t
            memory = report_memory(model_state_bytes(model, opt, device), args, world_size, n_params, step + 1)
            t = time.perf_counter() - busy  # the report's time is not the step's
        opt.zero_grad()
        dist.all_reduce(total)  # the global batch's mean loss, for the record
        losses[step + 1] = float(total) / world_size  # float(): the step's work on a GPU is done here
        if step - start >= warmup:
            step_seconds.append(time.perf_counter() - t)
            seconds += step_seconds[-1]
            tokens += args.batch * args.seq_len
        if bar is not steps:
            bar.set_postfix(loss=f"{losses[step + 1]:.3f}", refresh=False,
                            **(speed.postfix(tokens / seconds) if seconds else {}))
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            save_checkpoint(args, model, opt, step + 1, rank, world_size, text_sum, scaler, losses)
        if kill_at == step + 1:  # the injected fault: this rank dies as a killed process does, at once
            print(f"{KILL_ENV}: rank {rank} kills itself with SIGKILL after step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if hasattr(bar, "close"):
        bar.close()
    if not args.quiet and args.sample_bytes and len(steps):
        samples[args.steps] = show_sample(model, args, args.steps, rank, device)
    val = evaluate(model, val_text, args, device=device)
    # every rank's last collectives (evaluate's all-gathers under ZeRO-3) are over before rank 0
    # alone goes on to write files and the others tear their process groups down
    dist.barrier()
    tokens_per_s = tokens / seconds if seconds else None
    result = {"stage": args.stage, "impl": args.impl, "precision": args.precision, "optimizer": args.optimizer,
              "recompute": args.recompute, "compile": getattr(args, "compile", False), "world_size": world_size,
              "device": str(device), "backend": dist.get_backend(), "skipped_steps": skipped_steps(opt, scaler),
              "start": start, "said": said, "batch": args.batch, "seq_len": args.seq_len,
              "tokens_per_step": args.batch * args.seq_len, "losses": losses, "val_loss": val,
              "tokens_per_s": tokens_per_s, "step_seconds": step_seconds, **speed.record(tokens_per_s),
              "params": n_params, "memory": memory, "samples": samples}
    if rank == 0:
        what = f"stage {args.stage}{' (torch peer)' if args.impl == 'torch' else ''}, N = {world_size}, " \
               f"{args.precision}"
        if start == args.steps:
            print(f"{what}: nothing left to train (the job is at step {start} of {args.steps}), "
                  f"validation {val:.4f}", flush=True)
        else:
            rate = f", {tokens_per_s:.0f} tokens/s, {speed.says(tokens_per_s)}" if tokens_per_s else ""
            print(f"{what}: steps {start + 1}-{args.steps}, final loss {losses[args.steps]:.4f}, "
                  f"validation {val:.4f}{rate}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
            if losses:
                plot_losses([result], args.out.with_suffix(".png"))
    return result


class Speed:
    """MFU of the job (zerokit.train.speed): the model's FLOPs per token, the device's peak, and how
    many devices the ranks compute on (ranks sharing a GPU count it once). A collective: every rank
    builds it."""

    def __init__(self, args, device, world_size):
        self.per_token = flops_per_token(shape(args))
        self.peak, self.source = device_peak(device, getattr(args, "peak_tflops", None))
        where = [None] * world_size
        dist.all_gather_object(where, (socket.gethostname(), str(device)))
        self.devices = len(set(where))

    def mfu(self, tokens_per_s):
        return mfu(tokens_per_s, self.per_token, self.peak, self.devices)

    def postfix(self, tokens_per_s):
        got = self.mfu(tokens_per_s)
        return {"tok_s": f"{tokens_per_s:.0f}", "mfu": "n/a" if got is None else f"{got:.1%}"}

    def says(self, tokens_per_s):
        got = self.mfu(tokens_per_s)
        if got is None:
            return f"MFU n/a ({self.source})"
        on = f" on {self.devices} devices" if self.devices > 1 else ""
        return f"MFU {got:.1%} (of {self.peak:g} TFLOPS{on}: {self.source}; {self.per_token / 1e6:.1f} MFLOP a token)"

    def record(self, tokens_per_s):
        return {"mfu": self.mfu(tokens_per_s), "flops_per_token": self.per_token, "peak_tflops": self.peak,
                "peak_source": self.source, "devices": self.devices}


@torch.no_grad()
def evaluate(model, val_text, args, batches=4, device=None):
    """The mean loss on held-out text (the last 5%), the same sequences at every world size."""
    total = 0.0
    for b in range(batches):
        x, y = global_batch(val_text, b, args.batch, args.seq_len, args.seed + 1)
        logits = model(x.to(device))
        total += float(F.cross_entropy(logits.float().reshape(-1, 256), y.to(device).reshape(-1)))
    return total / batches


def init_under_torchrun(backend="gloo"):
    """dist.init_process_group(backend) in a worker torchrun started, safe after a restart.

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
                  "connect (a dead attempt's addresses), launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                  flush=True)
        dist.init_process_group(backend)
        return
    store, rank, world_size = next(dist.rendezvous("env://"))  # the agent's store, as init_process_group gets it
    dist.init_process_group(backend, store=dist.PrefixStore(f"zerokit.train/attempt{restarts}", store),
                            rank=rank, world_size=world_size)


def main(argv=None):
    from .options import parse_args

    args = parse_args(argv)
    if args.plot:
        to = plot_losses([load_run(p) for p in args.plot], args.to)
        print(f"{len(args.plot)} runs drawn to {to}")
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: it started this rank
        if args.nproc:
            raise SystemExit("--nproc starts ranks itself: leave it out under torchrun")
        place = local_placement(args.device)
        if os.environ["RANK"] == "0":  # the first line of the job: where it runs, and why
            print(f"device: rank 0 on {place.device}, {place.backend}: {place.why}", flush=True)
        prepare(place)
        init_under_torchrun(place.backend)
        try:
            if take_place(args.device) != place.device:
                raise RuntimeError(f"zerokit.rank_device() says {take_place(args.device)}, the placement "
                                   f"{place.device}: the two device rules disagree")
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    import zerokit

    nproc = args.nproc or 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    place = placement(0, nproc, gpus, args.device)  # the launcher starts every rank on this machine
    print(f"device: rank 0 on {place.device}, {place.backend}: {place.why}", flush=True)
    zerokit.launch(train, nproc, args=(args,), backend=place.backend, env=place.env, timeout=None)
