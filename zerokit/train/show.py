"""What a student reads from a run: memory by category, samples of text, the loss curve."""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from .options import THEORY_STAGE
from .step import uses_autocast

PROMPT = b"import os\n\n\ndef "  # the sample's start: the model should go on with a function name


def model_state_bytes(model, opt, device=None):
    """This rank's model-state bytes by category on `device` (default: the CPU), as zerokit.memory.census
    counts them (distinct storages, first claim wins), of whatever the stage holds: zerokit's flat
    buffers and shards (memory_categories), DDP's buckets, FSDP2's DTensor shards (their local tensors)."""
    from zerokit.memory import census

    from .peers import MODEL_STATE, Held

    got = census(None, Held(model, opt), torch.device(device or "cpu").type, scan=False)
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
def generate(model, n, seq_len, seed, temperature=0.8, device=None):
    """PROMPT and `n` bytes sampled after it, each from the model's next-byte distribution at
    `temperature`, with a generator seeded by `seed`. Every rank runs it (under ZeRO-3 a forward
    is a collective) and draws the same bytes; the count is fixed, so no rank waits on another.
    The model runs on `device` (default: the CPU); each byte is drawn on the CPU, with the CPU
    generator, from the probabilities brought back: one generator and one draw on every device."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(list(PROMPT)).unsqueeze(0)
    for _ in range(n):
        logits = model(ids[:, -seq_len:].to(device))[0, -1].float().cpu()
        nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return readable(bytes(ids[0].tolist()))


def show_sample(model, args, step, rank, device=None):
    sample = generate(model, args.sample_bytes, args.seq_len, args.seed, device=device)
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
