"""zerokit.FullyShard (zerokit/fully_shard/wrapper.py): the course's shell over zerokit.fully_shard,
any torch optimizer.

`FullyShard(model)` is `zerokit.fully_shard(unit)` on each unit (by default every module that owns
a trainable parameter), then on the model: FSDP2's design, each parameter a DTensor placed
Shard(0), this rank's ceil(rows / N) rows of it (test_fully_shard_controls.py measures the
controls, test_fully_shard_parity.py the calls against torch's fully_shard). What the shell
promises, against references that are torch alone, run inside a one-rank zerokit launch (one
intra-op thread, as each rank has: a matmul's rounding depends on the thread count):
- N = 2, both ranks on the SAME batch: bit for bit (torch.equal) with one process on that
  batch, after every step, for SGD (momentum, nesterov, weight decay) and AdamW: the mean of
  two identical gradients, (x + x) / 2, is exact, and both optimizers are elementwise, so
  stepping a DTensor's rows is stepping the parameter at those rows;
- N = 2 and 3, each rank its own slice of the batch: within 1e-5 (the N partial gradients
  sum in another order than one backward over the whole batch);
- bf16 and fp16 compute: within 1e-4 of one process holding fp32 master weights, a 16-bit
  copy of them for forward and backward, and fp32 gradients onto the master. It runs the
  ranks' micro-batches one after the other and averages their 16-bit gradients in fp32, as
  the ranks do (compute_dtype is `MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32)`):
  a 16-bit backward over the whole batch rounds each weight gradient's sum once, the ranks round
  each micro-batch's sum, so that reference would differ by the 16-bit rounding of a gradient
  (~4e-3 relative), which is not what this test is about;
- EdgeCaseNet: a tied weight (one parameter, its first name), a frozen one (sharded too, as FSDP2
  shards it, and never moved), an unused one (.grad None on every rank, so AdamW's weight decay
  skips it as on one process), the tied pair left to the root's call as FSDP2 wants shared
  parameters (units=[model.block]);
- accumulation over two backward passes, and a backward that raised, with FSDP2's remedies;
- memory and traffic per rank: the padded shards, sum over parameters of ceil(rows / N) * cols
  elements, and each all-gather and reduce-scatter N times a unit's padded shards.
"""

import copy

import pytest
import torch

import zerokit
from conftest import batch, ceil_div, new_model, rank_slice, run_ranks
from zerokit.memory import census
from zerokit.models import build_model, loss_for, model_batch, model_loss, num_parameters

STEPS, BATCH = 5, 12
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False)),
}


def _shell(kind, compute_dtype=None):
    model = new_model(kind)
    # EdgeCaseNet's tied embedding and head stay in the root's call: FSDP2 wants a shared parameter in one
    units = [model.block] if kind == "edge" else None
    return zerokit.FullyShard(model, compute_dtype=compute_dtype, units=units)


def _train(rank, world_size, kind, opt_name, same_data, compute_dtype=None, probe=None, model=None):
    """STEPS steps of FullyShard + a torch optimizer; the full fp32 parameters after each step."""
    fs = model or _shell(kind, compute_dtype)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(fs.parameters(), **kw)
    snaps = []
    for step in range(STEPS):
        x, y = batch(kind, step, BATCH)
        if not same_data:
            x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        loss_for(kind, fs(x).float(), y).backward()
        if probe:
            probe(fs)
        opt.step()
        opt.zero_grad()
        snaps.append(fs.full_parameters())
    return snaps


def _reference(rank, world_size, kind, opt_name):
    """One process, the whole batch, the unsharded torch optimizer."""
    model = new_model(kind)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls([p for p in model.parameters() if p.requires_grad], **kw)
    snaps = []
    for step in range(STEPS):
        x, y = batch(kind, step, BATCH)
        loss_for(kind, model(x), y).backward()
        opt.step()
        opt.zero_grad()
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snaps


def _mixed_reference(rank, world_size, kind, dtype, n_micro):
    """fp32 master weights, a `dtype` copy for forward and backward, the mean of n_micro
    micro-batch gradients in fp32 onto the master, AdamW on the master: no zerokit."""
    master = new_model(kind)
    half = copy.deepcopy(master).to(dtype)
    cls, kw = OPTIMIZERS["adamw"]
    opt = cls(master.parameters(), **kw)
    snaps = []
    for step in range(STEPS):
        with torch.no_grad():
            for h, m in zip(half.parameters(), master.parameters()):
                h.copy_(m)  # rounded to 16 bits, once per step
        x, y = batch(kind, step, BATCH)
        total = [torch.zeros_like(m) for m in master.parameters()]
        for r in range(n_micro):
            xr, yr = rank_slice(x, r, n_micro), rank_slice(y, r, n_micro)
            loss_for(kind, half(xr.to(dtype)).float(), yr).backward()
            for t, h in zip(total, half.parameters()):
                t += h.grad.float()
                h.grad = None
        for m, t in zip(master.parameters(), total):
            m.grad = t / n_micro
        opt.step()
        opt.zero_grad()
        snaps.append({n: p.detach().clone() for n, p in master.named_parameters()})
    return snaps


def _accumulate_reference(rank, world_size):
    """One process, twice the whole batch's loss (the sum of the ranks' two micro-batch mean losses over N),
    SGD with .grad zeroed in place."""
    model = new_model("edge")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9, foreach=False)
    snaps = []
    for step in range(STEPS):
        x, y = batch("edge", step, BATCH)
        (2 * loss_for("edge", model(x), y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snaps


def _references(rank, world_size):
    out = {(kind, name): _reference(rank, world_size, kind, name) for kind in ("mlp", "edge") for name in OPTIMIZERS}
    for dtype in (torch.bfloat16, torch.float16):
        out[("mixed", dtype)] = _mixed_reference(rank, world_size, "mlp", dtype, 2)
    out["accumulate"] = _accumulate_reference(rank, world_size)
    return out


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_references, 1)[0]


def _cases(rank, world_size, names):
    return {name: CASES[name](rank, world_size) for name in names}


# the cases each world size's one launch runs (a launch costs a second or two of start-up on 2 cores)
LAUNCHES = {2: ("same batch", "split batch", "mixed", "accumulate", "after a failed backward", "memory", "misuse"),
            3: ("split batch", "edge", "memory")}


@pytest.fixture(scope="module")
def ranks():
    """ranks(n, case): every rank's result of `case` at world size n, from one launch per world size."""
    done = {}

    def get(n, case):
        if n not in done:
            done[n] = run_ranks(_cases, n, LAUNCHES[n])
        return [r[case] for r in done[n]]

    return get


def _worst(snaps, ref_snaps):
    assert len(snaps) == len(ref_snaps) == STEPS
    worst = 0.0
    for got, want in zip(snaps, ref_snaps):
        assert got.keys() == want.keys()
        worst = max(worst, max((got[k] - want[k]).abs().max().item() for k in want))
    return worst


def _same_batch(rank, world_size):
    return {name: _train(rank, world_size, "mlp", name, same_data=True) for name in OPTIMIZERS}


@pytest.mark.distributed
def test_two_ranks_on_the_same_batch_are_bitwise_one_process(reference, ranks):
    for rank, results in enumerate(ranks(2, "same batch")):
        for name, snaps in results.items():
            for step, (got, want) in enumerate(zip(snaps, reference[("mlp", name)])):
                bad = [k for k in want if not torch.equal(got[k], want[k])]
                assert not bad, f"{name} rank {rank} step {step + 1}: not bitwise equal in {bad}"


def _split_batch(rank, world_size):
    return {name: _train(rank, world_size, "mlp", name, same_data=False) for name in OPTIMIZERS}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_on_their_own_slices_match_one_process_on_the_whole_batch(reference, ranks, world_size):
    """Not bitwise: N partial sums add in another order than one matmul over the whole batch."""
    worst = 0.0
    for results in ranks(world_size, "split batch"):
        for name, snaps in results.items():
            d = _worst(snaps, reference[("mlp", name)])
            assert d <= 1e-5, (world_size, name, d)
            worst = max(worst, d)
    print(f"N = {world_size}: max |FullyShard - one process| = {worst:.2e}")


def _mixed(rank, world_size):
    return {dtype: _train(rank, world_size, "mlp", "adamw", same_data=False, compute_dtype=dtype)
            for dtype in (torch.bfloat16, torch.float16)}


@pytest.mark.distributed
def test_16_bit_compute_matches_one_process_casting_the_same_way(reference, ranks):
    for results in ranks(2, "mixed"):
        for dtype, snaps in results.items():
            assert all(t.dtype == torch.float32 for snap in snaps for t in snap.values())
            d = _worst(snaps, reference[("mixed", dtype)])
            assert d <= 1e-4, (dtype, d)
            print(f"{dtype}: max |FullyShard - one process casting the same way| = {d:.2e}")


def _edge(rank, world_size):
    """EdgeCaseNet with AdamW (weight decay: a zero gradient in place of None would move a weight)."""
    seen = {}

    def probe(fs):  # right after backward
        for name, p in fs.named_parameters():
            g = p.grad
            seen.setdefault(name, set()).add(
                None if g is None else (type(g).__name__, g.dtype, tuple(g.shape) == tuple(p.shape)))

    snaps = _train(rank, world_size, "edge", "adamw", same_data=False, probe=probe)
    fs = _shell("edge")
    at_rest = {n: (type(p).__name__, tuple(p.shape), p.to_local().shape[0], p.requires_grad)
               for n, p in fs.named_parameters()}
    return snaps, seen, at_rest, new_model("edge").frozen.weight.detach().clone()


@pytest.mark.distributed
def test_tied_frozen_and_unused_parameters(reference, ranks):
    shapes = {n: tuple(p.shape) for n, p in new_model("edge").named_parameters()}
    n = 3
    for rank, (snaps, seen, at_rest, frozen0) in enumerate(ranks(n, "edge")):
        assert _worst(snaps, reference[("edge", "adamw")]) <= 1e-5
        assert "head.weight" not in at_rest and "embed.weight" in at_rest  # tied: one parameter, its first name
        assert at_rest.keys() == shapes.keys()
        for name, (kind, shape, rows, trainable) in at_rest.items():
            # every parameter, the frozen ones too: a DTensor of its full shape, this rank's ceil(rows / N) rows
            # (the last ranks fewer: torch.chunk's cut)
            full_rows = shapes[name][0]
            want = max(0, min(ceil_div(full_rows, n), full_rows - rank * ceil_div(full_rows, n)))
            assert (kind, shape, rows) == ("DTensor", shapes[name], want), (rank, name, kind, shape, rows)
            assert trainable == (not name.startswith("frozen.")), name
        assert all(torch.equal(s["frozen.weight"], frozen0) for s in snaps)
        for name, outcomes in seen.items():
            if name.startswith("unused.") or name.startswith("frozen."):
                assert outcomes == {None}, (rank, name, outcomes)  # no rank used it, or frozen: no gradient
            else:
                assert outcomes == {("DTensor", torch.float32, True)}, (rank, name, outcomes)


def _accumulate(rank, world_size):
    """Two backward passes per step (each rank its two micro-batches), .grad zeroed in place, and a forward
    with grad enabled and no backward before each step. That forward leaves the root's call gathered (FSDP2's
    default for the root, its backward would come first), and a forward of a gathered call gathers nothing:
    its next forward would compute with the weights from before the step, in torch's fully_shard as in
    zerokit's. fs.reshard() after it, FSDP2's remedy, frees them."""
    fs = _shell("edge")
    opt = torch.optim.SGD([p for p in fs.parameters() if p.requires_grad], lr=0.05, momentum=0.9, foreach=False)
    snaps = []
    for step in range(STEPS):
        x, y = batch("edge", step, BATCH)
        x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
        for k in range(2):
            loss_for("edge", fs(rank_slice(x, k, 2)), rank_slice(y, k, 2)).backward()
        fs(x).sum()  # a look at the output, with grad enabled, and no backward
        fs.reshard()
        opt.step()
        opt.zero_grad(set_to_none=False)
        snaps.append(fs.full_parameters())
    return snaps


@pytest.mark.distributed
def test_gradient_accumulation_and_a_forward_without_backward(reference, ranks):
    for snaps in ranks(2, "accumulate"):
        d = _worst(snaps, reference["accumulate"])
        assert d <= 1e-5, d


class _Refuse(torch.autograd.Function):
    """Identity forward; backward raises, after the layers above it have their gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("refused")


def _after_a_failed_backward(rank, world_size):
    fs = _shell("mlp")
    x, y = batch("mlp", 0, BATCH)
    handle = fs.module.layers[0].register_forward_hook(lambda m, args, out: _Refuse.apply(out))
    with pytest.raises(ValueError, match="refused"):
        loss_for("mlp", fs(x), y).backward()
    handle.remove()
    fs.module.reset_iter_state()  # FSDP2's remedy, on the root: every call resharded, the step forgotten
    fs.zero_grad()  # the layers above the failure got their gradients
    return _train(rank, world_size, "mlp", "sgd", same_data=False, model=fs)


@pytest.mark.distributed
def test_a_backward_that_raised_leaves_nothing_behind_after_reset_iter_state(reference, ranks):
    for snaps in ranks(2, "after a failed backward"):
        assert _worst(snaps, reference[("mlp", "sgd")]) <= 1e-5


def _memory(rank, world_size):
    model = build_model("mlp")
    psi = num_parameters(model)
    shapes = [tuple(p.shape) for p in model.parameters()]
    fs = zerokit.FullyShard(model)
    opt = torch.optim.SGD(fs.parameters(), lr=0.1)
    x, y = model_batch("mlp", 4, seed=rank)
    with zerokit.CommCounter() as comm:
        model_loss("mlp", fs(x), y).backward()
    # what FullyShard declares it holds (memory_categories: the DTensors' local storage), counted by the census;
    # not census(fs, ...), which cannot read a DTensor's storage
    after_backward = census(None, fs, "cpu", scan=False)
    opt.step()
    opt.zero_grad()
    at_rest = census(None, fs, "cpu", scan=False)
    calls = {op: [c.numel for c in comm.calls if c.op == op] for op in ("all_gather", "reduce_scatter")}
    return psi, shapes, after_backward, at_rest, sum(p.to_local().numel() for p in fs.parameters()), calls


def _padded(shape, n):
    """Elements of a parameter's padded dim-0 shard: ceil(rows / N) rows of the other dimensions."""
    rows, rest = shape[0], 1
    for d in shape[1:]:
        rest *= d
    return ceil_div(rows, n) * rest


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_holds_its_rows_of_every_parameter(ranks, world_size):
    """...padded to ceil(rows / N), and pays ZeRO-3's traffic for it: each unit (an OddMLP layer: its weight
    and bias) all-gathered for forward, freed, gathered again for backward, its gradients reduce-scattered,
    each collective N times the unit's padded shards."""
    n = world_size
    results = ranks(n, "memory")
    for rank, (psi, shapes, after_backward, at_rest, numel, calls) in enumerate(results):
        units = [_padded(w, n) + _padded(b, n) for w, b in zip(shapes[::2], shapes[1::2])]  # a layer's shards
        padded = sum(units)
        assert sorted(calls["reduce_scatter"]) == sorted(n * u for u in units), calls
        assert sorted(calls["all_gather"]) == sorted(2 * [n * u for u in units]), calls
        assert at_rest["parameters"] == 4 * padded  # the padded storage of each shard, fp32
        assert at_rest["gradients"] == 0
        assert after_backward["gradients"] == 4 * padded  # each unit's reduce-scattered row, fp32
        rows = [max(0, min(ceil_div(s[0], n), s[0] - rank * ceil_div(s[0], n))) for s in shapes]
        assert numel == sum(r * (_padded(s, 1) // s[0]) for r, s in zip(rows, shapes))  # this rank's real rows
        assert 4 * psi / n <= at_rest["parameters"] < 4 * (psi / n + sum(_padded(s, 1) // s[0] for s in shapes))
    assert sum(r[4] for r in results) == results[0][0]  # together the shards are the model, once


def _misuse(rank, world_size):
    model = new_model("mlp")
    names = [n for n, _ in model.named_parameters()]
    said = []
    for bad in (dict(units=[torch.nn.Linear(2, 2)]), dict(compute_dtype=torch.int8)):
        with pytest.raises(ValueError) as info:
            zerokit.FullyShard(new_model("mlp"), **bad)
        said.append(str(info.value))
    fs = zerokit.FullyShard(model)
    state = fs.state_dict()  # FSDP2's: the model's own names, each value this rank's DTensor of the full shape
    kinds = {k: (type(v).__name__, tuple(v.shape)) for k, v in state.items()}
    return said, names, kinds, {n: tuple(p.shape) for n, p in new_model("mlp").named_parameters()}


@pytest.mark.distributed
def test_misuse_is_refused_with_a_clear_message_and_state_dict_is_fsdp2s(ranks):
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        zerokit.FullyShard(new_model("mlp"))
    said, names, kinds, shapes = ranks(2, "misuse")[0]
    assert "units must be modules inside the model" in said[0]
    assert "compute_dtype must be None, torch.bfloat16 or torch.float16" in said[1]
    assert list(kinds) == names
    assert kinds == {n: ("DTensor", shapes[n]) for n in names}


CASES = {"same batch": _same_batch, "split batch": _split_batch, "mixed": _mixed, "edge": _edge,
         "accumulate": _accumulate, "after a failed backward": _after_a_failed_backward, "memory": _memory,
         "misuse": _misuse}
