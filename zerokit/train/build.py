"""What a job trains: the model, the stage's wrapper and its optimizer, on the rank's device."""

import torch

from .options import HALF


def gpt(args, device=None):
    """The job's zerokit.models.TinyTransformer on bytes (vocabulary 256), its weights drawn from
    --seed on the CPU (the same on every rank and every device), then moved to `device`.
    The capstone's blocks run attention through F.scaled_dot_product_attention (flash attention
    on a GPU)."""
    from zerokit.models import TinyTransformer

    torch.manual_seed(args.seed)
    model = TinyTransformer(vocab=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len)
    return model.to(device) if device is not None else model


def shape(args):
    """The job's model with no storage (the meta device): for counting parameters and FLOPs."""
    from zerokit.models import TinyTransformer

    with torch.device("meta"):
        return TinyTransformer(vocab=256, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                               seq_len=args.seq_len)


def build(args, world_size, device=None):
    """(model, optimizer, parameter count) of --stage and --impl on `device` (default: the CPU);
    every rank starts from the same weights."""
    import zerokit
    from zerokit.stages import lessons_optimizer, torch_peer, wrapper

    device = torch.device(device or "cpu")
    model = gpt(args, device)
    n = sum(p.numel() for p in model.parameters())  # before any wrapper shards them
    if args.recompute:  # before any wrapper: the blocks themselves keep only their inputs
        zerokit.checkpoint_modules(model.blocks)
    if getattr(args, "compile", None):
        compile_blocks(model, args.compile)
    hyper = dict(lr=args.lr, weight_decay=args.weight_decay)
    bf16 = args.precision == "bf16"  # the torch peers' one 16-bit format (fp16 is refused for them)
    half = HALF.get(args.precision)
    if args.optimizer == "muon":
        return (*build_muon(args, model, hyper), n)
    if args.offload:  # the lessons' classes: AdamW with its state where lesson 08 puts it
        if args.offload == "cpu" and device.type != "cuda":
            raise ValueError(f"--offload cpu keeps AdamW's state in pinned host memory, away from the GPU; this "
                             f"job's parameters are on {device}: use --offload disk, or a GPU")
        precision = zerokit.MixedPrecision(half, reduce_dtype=torch.float32) if half else None
        return model, lessons_optimizer(args.stage, model, units=list(model.blocks), precision=precision,
                                        offload=args.offload, **hyper), n
    if args.impl == "torch":
        return (*torch_peer(args.stage, model, bf16=bf16, device=device,
                            reshard_after_forward=args.reshard_after_forward, **hyper), n)
    # fp16 at stages 1 and 2: MixedPrecision scales the loss itself (lesson 06's dynamic scaler, its verdict
    # all-reduced); the blocks are FullyShard's units at stage 3
    return (*wrapper(args.stage, model, half=half, units=list(model.blocks),
                     reshard_after_forward=args.reshard_after_forward, **hyper), n)


def compile_blocks(model, backend="inductor"):
    """--compile: torch.compile each block's forward, in place (recomputation's wrapper included).

    The blocks' forwards, not the whole model and not the module's call: every stage's wrapper
    works through hooks around the blocks (ZeRO-3's gathers and frees, DataParallel's and ZeRO's
    gradient hooks on the parameters, FSDP2's), and those stay outside the compiled code, as
    torchtitan compiles FSDP2's blocks. Inside, the block is plain tensor code: one graph each."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend=backend)


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
    from zerokit.stages import get_stage

    matrices = [p for p in model.blocks.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if not any(p is m for m in matrices)]
    muon = dict(hyper, adjust_lr_fn="match_rms_adamw")
    if get_stage(args.stage).muon == "torch":  # stage 0: torch's Muon on every rank
        model = zerokit.DataParallel(model)
        return model, Optimizers(muon=torch.optim.Muon(matrices, **muon), adamw=torch.optim.AdamW(rest, **hyper))
    return model, Optimizers(muon=zerokit.ZeRO1Muon(matrices, **muon),
                             adamw=zerokit.ZeRO1(rest, torch.optim.AdamW, **hyper))
