"""zerokit.checkpoint with any elementwise torch optimizer, under every wrapper, on real gloo ranks.

| promise | test |
|---|---|
| save, resume: the loaded state is bit for bit what the ranks held; at the same N the run goes on bit for bit | test_resume_and_reshard |
| reshard N -> N' (2 -> 3, 3 -> 2) and across wrappers (ZeRO1, ZeRO2, DataParallel, FullyShard, zerokit's and torch's fully_shard calls, one process) | test_resume_and_reshard |
| consolidate: the full fp32 weights of any of them | test_consolidate |
| another optimizer class, or other state keys, refused on every rank with the reason; nothing changed | test_refusals |
| the lessons' Adam and torch's AdamW load each other's checkpoints | test_resume_and_reshard (adam cases) |

Optimizers: SGD (momentum, nesterov, weight decay: a momentum buffer per element), Adagrad (a
running sum per element, a step count per parameter), AdamW through the generic path (m, v, a
step). The model is EdgeCaseNet: a tied weight, a frozen parameter, an unused one (never stepped,
so it has no state, and must still have none after a load), a buffer, sizes not divisible by 2 or 3.

The truth is never the checkpoint's own reading: what the ranks held when they saved, read through
the wrappers' public state (state_shards() of ZeRO1/ZeRO2; under FullyShard and fully_shard each
DTensor parameter's and state's local rows, placed where torch.chunk puts this rank's rows; opt.state
of a replicated model), and a run that was never interrupted. A sharded model that loads has run a
forward under no_grad first (the root then keeps its gathered parameters): the load must still reach
the next forward. The loaded state is bit for bit what was saved,
always. The steps after a load are bit for bit the uninterrupted run's at the same world size
(N = 2, each rank its own slice), whichever wrapper resumes: every wrapper averages the same two
per-rank gradients, and a + b rounds the same in either order. At another world size they differ
by the order N' gradients are summed in: within 1e-5 (measured ~1e-7; pytest -s prints them).
"""

import json
import math
import sys

import cloudpickle
import pytest
import torch

import zerokit
import zerokit.checkpoint as ckpt
from conftest import batch, max_diff, new_model, rank_slice, run_ranks
from zerokit.checkpoint.files import CheckpointError
from zerokit.models import loss_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.distributed

BATCH, SAVE_AT, MORE = 12, 3, 2
TOL = 1e-5
LOSS_SCALER = "(loss scaler)"
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.01, foreach=False)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False)),
    # only to be refused: other state keys than the checkpoints'
    "sgd-no-momentum": (torch.optim.SGD, dict(lr=0.05, foreach=False)),
    "amsgrad": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=False)),
}
TRAINED = [n for n, p in new_model("edge").named_parameters() if p.requires_grad]
SHAPES = {n: p.shape for n, p in new_model("edge").named_parameters() if p.requires_grad}

# (world size, wrapper, optimizer) saved after SAVE_AT steps -> where each checkpoint is loaded:
# [(world size, wrapper)]. Every wrapper saves once and loads at least twice; every optimizer is
# resharded 2 -> 3 and goes to another wrapper; "adam" (zerokit.ZeRO1Adam) crosses into torch's AdamW.
SAVES = {
    (2, "zero1", "sgd"): [(2, "zero1"), (3, "zero2"), (2, "dp"), (3, "fs"), (1, "one")],
    (2, "zero2", "adagrad"): [(2, "zero2"), (3, "zero1"), (2, "fs")],
    (2, "fs", "adamw"): [(2, "fs"), (3, "dp"), (2, "adam")],
    (2, "dp", "adagrad"): [(2, "dp"), (3, "fs")],
    (3, "fs", "sgd"): [(2, "zero1"), (2, "dp")],
    (3, "zero2", "adamw"): [(2, "fs")],
    (2, "adam", "adamw"): [(3, "zero2")],
    # zerokit.fully_shard called by hand (a block, then the root) and torch's own fully_shard: the same
    # DTensor parameters, so one job saves them and either loads the other's, and the flat stages' too
    (2, "fsdp", "adamw"): [(2, "torch-fsdp"), (3, "fsdp"), (2, "zero1")],
    (3, "torch-fsdp", "sgd"): [(2, "fsdp")],
    # fp16 weights, fp32 masters and a loss scale that grows every step: resumed at the same N only
    # (at another N fp16 training itself goes elsewhere: the rounding of the gradients' sums differs)
    (2, "zero1-fp16", "sgd"): [(2, "zero1-fp16")],
}


def make(wrapper, opt_name, seed=0):
    """(model to call, the model to name and save, optimizer) for a wrapper around EdgeCaseNet."""
    cls, kw = OPTIMIZERS[opt_name]
    model = new_model("edge", seed)
    if wrapper == "zero1":
        return model, model, zerokit.ZeRO1(model.parameters(), cls, **kw)
    if wrapper == "zero1-fp16":
        fp16 = zerokit.MixedPrecision("fp16", init_scale=2.0**10, growth_interval=1)
        return model, model, zerokit.ZeRO1(model.parameters(), cls, precision=fp16, **kw)
    if wrapper == "zero2":  # small buckets: several, each with its own padding
        return model, model, zerokit.ZeRO2(model.parameters(), cls, bucket_mb=60 * 4 / 2**20, **kw)
    if wrapper == "adam":  # the lessons' own Adam: torch's AdamW bit for bit
        return model, model, zerokit.ZeRO1Adam(model.parameters(), lr=kw["lr"], weight_decay=kw["weight_decay"])
    if wrapper == "fs":  # units that keep the tied embed/head weight in one group (the root's)
        fs = zerokit.FullyShard(model, units=[model.block, model.frozen, model.unused])
        return fs, fs, cls(fs.parameters(), **kw)
    if wrapper in ("fsdp", "torch-fsdp"):  # FSDP2's calls: each unit, then the root
        if wrapper == "fsdp":
            shard = zerokit.fully_shard
        else:
            from torch.distributed.fsdp import fully_shard as shard
        shard(model.block)
        shard(model)
        return model, model, cls([p for p in model.parameters() if p.requires_grad], **kw)
    if wrapper == "dp":
        dp = zerokit.DataParallel(model, bucket_mb=100 * 4 / 2**20)
        return dp, dp, cls([p for p in dp.parameters() if p.requires_grad], **kw)
    assert wrapper == "one"  # a plain model and optimizer in one process
    return model, model, cls([p for p in model.parameters() if p.requires_grad], **kw)


def train(run, opt, start, steps, rank, world):
    for step in range(start, start + steps):
        x, y = batch("edge", step, BATCH)
        loss = loss_for("edge", run(rank_slice(x, rank, world)).float(), rank_slice(y, rank, world))
        (opt.scale_loss(loss) if hasattr(opt, "scale_loss") else loss).backward()
        opt.step()
        opt.zero_grad()


def _rows(t, rank, world):
    """The rows of a tensor of t.shape[0] rows that rank holds of a dim-0 shard across world ranks, as
    torch.chunk cuts them (FSDP2's layout): [start, end)."""
    chunks = torch.arange(t.shape[0]).chunk(world)
    held_rows = chunks[rank] if rank < len(chunks) else torch.arange(0)
    start = int(held_rows[0]) if len(held_rows) else t.shape[0]
    return start, start + len(held_rows)


def full_weights(saved, opt):
    """{name: full fp32 weights} of the trained parameters (a collective under FullyShard and fully_shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(saved, zerokit.FullyShard):
        full = saved.full_parameters()
    elif any(isinstance(p, DTensor) for p in saved.parameters()):
        full = {n: p.full_tensor() for n, p in saved.named_parameters()}
    else:
        model = saved.module if isinstance(saved, zerokit.DataParallel) else saved
        full = dict(model.named_parameters())
    return {n: full[n].detach().float().clone() for n in TRAINED}


def held(saved, opt):
    """What this rank holds, read through the wrappers' public state: [(name, lo, hi, {key: values})],
    with key "weights" and every per-element state key, and {name: {scalar key: value}} (absent:
    no state). Independent of zerokit.checkpoint's own reading."""
    pieces, numbers = [], {}

    def add(name, lo, hi, weights, state):  # weights and state: 1-D, elements [lo, hi) of the parameter
        values = {"weights": weights.detach().clone()}
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                values[k] = v.reshape(-1).clone()
            else:
                numbers[name] = {**numbers.get(name, {}), k: float(v)}
        pieces.append((name, lo, hi, values))

    from torch.distributed.tensor import DTensor

    model = saved.module if isinstance(saved, (zerokit.DataParallel, zerokit.FullyShard)) else saved
    names = {p: n for n, p in model.named_parameters()}
    if isinstance(opt, (zerokit.ZeRO1, zerokit.ZeRO2)):
        for sh in opt.state_shards():
            for s, param in zip(sh.bucket.segments, sh.params):  # a segment Parameter, stepped by a torch optimizer
                add(names[sh.bucket.params[s.index]], s.param_lo, s.param_hi, param,
                    (sh.optimizer or opt).state.get(param, {}))
    elif any(isinstance(p, DTensor) for p in model.parameters()):  # FullyShard, fully_shard: this rank's rows
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for name, p in model.named_parameters():
            start, end = _rows(p, rank, world)
            if not p.requires_grad or start == end:
                continue
            width = math.prod(p.shape[1:])  # elements per row
            state = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in opt.state.get(p, {}).items()}
            assert p.to_local().shape[0] == end - start, (name, p.to_local().shape, start, end)
            add(name, start * width, end * width, p.to_local().reshape(-1), state)
    elif isinstance(opt, zerokit.ZeRO1Adam):  # the lessons' contract: m, v and a step count per parameter
        for sh in opt.state_shards():
            for s in sh.bucket.segments:
                step, at = sh.steps[s.index], slice(s.shard_lo, s.shard_hi)
                state = {"exp_avg": sh.exp_avg[at], "exp_avg_sq": sh.exp_avg_sq[at], "step": step} if step else {}
                add(names[sh.bucket.params[s.index]], s.param_lo, s.param_hi, sh.weights[at], state)
    else:  # a replicated model: every parameter whole
        for name, p in model.named_parameters():
            if p.requires_grad:
                add(name, 0, p.numel(), p.reshape(-1), opt.state.get(p, {}))
    scaler = getattr(getattr(opt, "precision", None), "scaler", None)
    if scaler is not None:  # fp16: the loss scale and its growth counter are state too
        numbers[LOSS_SCALER] = {"scale": scaler.scale, "clean_steps": scaler.clean_steps}
    return pieces, numbers


def assemble(per_rank):
    """{name: {key: full flat tensor}} (NaN where no rank held it) and {name: numbers} from every rank's held()."""
    full, numbers = {}, {}
    for pieces, nums in per_rank:
        for name, lo, hi, values in pieces:
            for k, t in values.items():
                full.setdefault(name, {}).setdefault(k, torch.full((math.prod(SHAPES[name]),), float("nan")))
                full[name][k][lo:hi] = t
        numbers.update(nums)
    return full, numbers


def differences(pieces, numbers, truth, what):
    """Where the pieces a rank holds differ, bit for bit, from the truth (saved state): a list of lines."""
    full, saved_numbers = truth
    out = []
    for name, lo, hi, values in pieces:
        if values.keys() != full[name].keys():
            out.append(f"{what}: {name} holds {sorted(values)}, saved {sorted(full[name])}")
            continue
        for k, t in values.items():
            if not torch.equal(t, full[name][k][lo:hi]):
                out.append(f"{what}: {name} {k} [{lo}, {hi}) differs from what was saved")
    if numbers != {n: v for n, v in saved_numbers.items() if n == LOSS_SCALER or any(p[0] == n for p in pieces)}:
        out.append(f"{what}: per-parameter numbers {numbers} != saved {saved_numbers}")
    return out


# ---------------------------------------------------------------------------------------
# the jobs


def _save(rank, world, root):
    out = {}
    for (n, wrapper, opt_name) in SAVES:
        if n != world:
            continue
        run, saved, opt = make(wrapper, opt_name)
        train(run, opt, 0, SAVE_AT, rank, world)
        for group in opt.param_groups:  # as a scheduler would: a load must restore it, or what follows differs
            group["lr"] /= 2
        ckpt.save(root / f"{n}-{wrapper}-{opt_name}", saved, opt)
        state = held(saved, opt)
        train(run, opt, SAVE_AT, MORE, rank, world)
        out[n, wrapper, opt_name] = (state, full_weights(saved, opt))
    return out


def _load(rank, world, root, truth):
    """Every load at this world size: (problems, {(source, target): max |diff| to the uninterrupted run})."""
    problems, diffs = [], {}
    for source, targets in SAVES.items():
        n, wrapper, opt_name = source
        for (m, target) in targets:
            if m != world:
                continue
            state, after = truth[source]
            run, saved, opt = make(target, opt_name, seed=7)  # other weights: the load must overwrite them
            if target in ("fs", "fsdp", "torch-fsdp"):  # the root keeps its gathered weights after this forward
                with torch.no_grad():
                    run(rank_slice(batch("edge", 0, BATCH)[0], rank, world))
            ckpt.load(root / f"{n}-{wrapper}-{opt_name}", saved, opt)
            problems += differences(*held(saved, opt), state, f"{source} -> {world} x {target}")
            train(run, opt, SAVE_AT, MORE, rank, world)
            diffs[source, target] = max_diff(full_weights(saved, opt), after)
    return problems, diffs


def _save_then_load(rank, world, root, truth):
    return _save(rank, world, root), _load(rank, world, root, truth)


# ---------------------------------------------------------------------------------------
# the tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every checkpoint of SAVES, and per source: (the state every rank held, assembled; the weights
    of the uninterrupted run after MORE more steps). The 3-rank launch also loads the 2-rank ones."""
    root = tmp_path_factory.mktemp("any")
    truth, loads = {}, {}
    at2 = run_ranks(_save, 2, root)
    for key in at2[0]:
        truth[key] = (assemble([r[key][0] for r in at2]), at2[0][key][1])
    at3 = run_ranks(_save_then_load, 3, root, truth)
    for key in at3[0][0]:
        truth[key] = (assemble([r[0][key][0] for r in at3]), at3[0][0][key][1])
    loads[3] = [r[1] for r in at3]
    loads[2] = run_ranks(_load, 2, root, truth)
    loads[1] = [_load(0, 1, root, truth)]  # one process, no process group: a plain model and optimizer
    return root, truth, loads


@pytest.mark.timeout(120)
def test_resume_and_reshard(saved):
    _, _, loads = saved
    worst = {}
    for world, results in loads.items():
        for problems, diffs in results:
            assert not problems, "\n".join(problems[:6])
            for (source, target), diff in diffs.items():
                if source[0] == world:  # the same data on each rank: bit for bit, whichever wrapper resumes
                    assert diff == 0.0, (source, world, target, diff)
                assert diff <= TOL, (source, world, target, diff)
                worst[source, (world, target)] = max(worst.get((source, (world, target)), 0.0), diff)
    expected = {(s, t) for s, ts in SAVES.items() for t in ts}
    assert set(worst) == expected, expected - set(worst)
    print("\nmax |weights - uninterrupted run| after a load and "
          f"{MORE} more steps:\n" + "\n".join(f"  {s[0]} x {s[1]} ({s[2]}) -> {t[0]} x {t[1]}: {d:.2g}"
                                            for (s, t), d in sorted(worst.items())))


@pytest.mark.timeout(60)
def test_consolidate(saved):
    root, truth, _ = saved
    for (n, wrapper, opt_name), ((full, _), _) in truth.items():
        state = ckpt.consolidate(root / f"{n}-{wrapper}-{opt_name}")
        plain = new_model("edge", seed=3)
        plain.load_state_dict(state)  # strict: every key, tied and frozen included
        assert state["head.weight"] is state["embed.weight"]
        for name in TRAINED:
            assert torch.equal(state[name].reshape(-1), full[name]["weights"]), (n, wrapper, opt_name, name)
        frozen = new_model("edge").frozen.weight
        assert torch.equal(state["frozen.weight"], frozen.half().float() if "fp16" in wrapper else frozen)
        meta = json.loads((root / f"{n}-{wrapper}-{opt_name}" / "metadata.json").read_text())
        if wrapper == "adam":  # the lessons' Adam: version 1, as before
            assert (meta["version"], meta["tensors"]) == (1, ["weights", "exp_avg", "exp_avg_sq"])
            continue
        assert meta["version"] == 2 and meta["optimizer_class"] == f"torch.optim.{OPTIMIZERS[opt_name][0].__name__}"
        kinds = {"sgd": ["momentum_buffer"], "adagrad": ["sum"], "adamw": ["exp_avg", "exp_avg_sq"]}[opt_name]
        assert meta["tensors"] == ["weights", *kinds]
        entries = {p["name"]: p for b in meta["buckets"] for p in b["params"]}
        # never stepped: no state (Adagrad makes its state at construction: a step count of 0)
        assert entries["unused.weight"]["scalars"] == ({"step": 0.0} if opt_name == "adagrad" else None)
        assert entries["block.0.weight"]["step"] == (0 if opt_name == "sgd" else SAVE_AT)


def _refusals(rank, world, root):
    """Loads that must be refused on every rank with one message, changing nothing."""
    out = {}
    cases = {"another class": ("zero1", "adagrad", "2-zero1-sgd"),
             "other keys": ("dp", "sgd-no-momentum", "2-zero1-sgd"),
             "lessons' Adam from SGD": ("adam", "adamw", "2-zero1-sgd"),
             "torch AdamW(amsgrad) from the lessons' Adam": ("zero2", "amsgrad", "2-adam-adamw")}
    for case, (wrapper, opt_name, path) in cases.items():
        run, saved, opt = make(wrapper, opt_name, seed=5)
        train(run, opt, 0, 1, rank, world)
        before = held(saved, opt)
        try:
            ckpt.load(root / path, saved, opt)
            out[case] = None
        except CheckpointError as exc:
            out[case] = (str(exc), isinstance(exc, ValueError))
        after = held(saved, opt)
        assert not differences(*after, assemble([before]), case), case
    return out


@pytest.mark.timeout(60)
def test_refusals(saved):
    root, _, _ = saved
    results = run_ranks(_refusals, 2, root)
    expected = {"another class": ("torch.optim.SGD", "torch.optim.Adagrad"),
                "other keys": ("momentum_buffer", "hyperparameters"),
                "lessons' Adam from SGD": ("torch.optim.SGD", "torch.optim.AdamW"),
                "torch AdamW(amsgrad) from the lessons' Adam": ("max_exp_avg_sq",)}
    for case, fragments in expected.items():
        said = [r[case] for r in results]
        assert said[0] is not None and said[0] == said[1], (case, said)  # every rank, one message
        message, is_value_error = said[0]
        assert is_value_error and all(f in message for f in fragments) and "\n" not in message, (case, message)
        print(f"\n{case}: {message}")
