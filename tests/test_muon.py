"""zerokit.ZeRO1Muon (zerokit/muon.py): Muon with whole matrices owned by ranks.

Against torch.optim.Muon (the 2-D block matrices) beside torch.optim.AdamW (everything else)
on one process, run inside a one-rank launch (a matmul's rounding depends on the thread
count, so the reference runs the way the ranks run), on the zoo's transformer:
- muon_update_ is torch.optim.Muon bit for bit, tall and wide matrices, with and without
  Nesterov, both learning-rate adjustments;
- N = 2, both ranks on the same batch: every parameter and every owner's momentum bit for
  bit after each step (the mean of two identical gradients is exact, and the owner runs
  torch's operations in torch's order), with zerokit.ZeRO1Adam on the other parameters;
- N = 3, each rank its third of the batch: close (three gradients summed in another order,
  then Newton-Schulz in bfloat16, which rounds a 1e-7 difference to as much as 2^-8 of the
  update), and each rank holds momentum for the matrices it owns only;
- owners balance Newton-Schulz cost, not element count; a shard boundary's matrices counted;
- a parameter no rank has a gradient for is left alone; ZeRO1(params, torch.optim.Muon) and a
  1-D parameter are refused with a message that says what to do;
- checkpoints (zerokit.checkpoint): saved at N = 3, loaded at N = 2 (other owners) and into
  torch.optim.Muon on one process, every matrix's momentum arrives whole on its new owner and
  nowhere else, and training on continues bit for bit as the one-process run does.
"""

import pytest
import torch

import zerokit
from conftest import run_ranks
from zerokit.flat import FlatBucket
from zerokit.models import build_model, model_batch, model_loss
from zerokit.muon import assign_owners, muon_update_, newton_schulz_cost, straddling_matrices

pytestmark = pytest.mark.distributed

STEPS, BATCH = 4, 12
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95)
ADAMW = dict(lr=3e-3, weight_decay=0.01)


def _split(model):
    """torch's advice: Muon for the hidden layers' matrices, AdamW for the rest (embeddings too)."""
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    rest = [p for p in model.parameters() if not any(p is m for m in matrices)]
    return matrices, rest


def _build(sharded, seed=0):
    """The zoo's transformer with Muon on its block matrices and AdamW on the rest: zerokit's
    ZeRO-1 pair (sharded) or torch's own (one process)."""
    torch.manual_seed(seed)
    model = build_model("transformer")
    matrices, rest = _split(model)
    if sharded:
        return model, zerokit.ZeRO1Muon(matrices, **MUON), zerokit.ZeRO1Adam(rest, **ADAMW)
    return model, torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(rest, **ADAMW)


def _steps(model, optimizers, steps):
    """Steps on the whole batch of each step, the same on every rank."""
    for step in steps:
        x, y = model_batch("transformer", BATCH, seed=step)
        model_loss("transformer", model(x), y).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def _train(rank, world_size, sharded, same_data):
    model, muon, adam = _build(sharded)
    matrices, _ = _split(model)
    out = []
    for step in range(STEPS):
        x, y = model_batch("transformer", BATCH, seed=step)
        if sharded and not same_data:
            m = BATCH // world_size
            x, y = x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m]
        model_loss("transformer", model(x), y).backward()
        for opt in (muon, adam):
            opt.step()
            opt.zero_grad()
        momentum = {i: muon.state[p]["momentum_buffer"].clone() for i, p in enumerate(matrices) if p in muon.state}
        out.append(({n: p.detach().clone() for n, p in model.named_parameters()}, momentum))
    owned = [i for i, p in enumerate(matrices) if p in muon.state]
    return out, owned


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_train, 1, False, True)[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nesterov, adjust, shape", [(True, None, (7, 19)), (False, "match_rms_adamw", (23, 5)),
                                                     (True, "original", (11, 11))])
def test_muon_update_is_torch_muon_bit_for_bit(nesterov, adjust, shape):
    torch.manual_seed(1)
    ours, theirs = torch.randn(shape), None
    theirs = torch.nn.Parameter(ours.clone())
    opt = torch.optim.Muon([theirs], lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust)
    buf = torch.zeros(shape)
    for _ in range(10):
        grad = torch.randn(shape)
        theirs.grad = grad.clone()
        opt.step()
        muon_update_(ours, grad, buf, lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                     adjust_lr_fn=adjust)
        assert torch.equal(ours, theirs.detach())
        assert torch.equal(buf, opt.state[theirs]["momentum_buffer"])


@pytest.mark.timeout(120)
def test_two_ranks_on_the_same_batch_match_torch_muon_bit_for_bit(reference):
    expected, _ = reference
    results = run_ranks(_train, 2, True, True)
    for rank, (got, owned) in enumerate(results):
        assert owned, f"rank {rank} owns no matrix"
        for step, ((params, momentum), (ref_params, ref_momentum)) in enumerate(zip(got, expected)):
            for n in ref_params:
                assert torch.equal(params[n], ref_params[n]), f"rank {rank}, step {step + 1}: {n} differs"
            assert set(momentum) == set(owned)
            for i in owned:
                assert torch.equal(momentum[i], ref_momentum[i]), f"rank {rank}, step {step + 1}: momentum {i}"
    assert sorted(i for _, owned in results for i in owned) == sorted(expected[-1][1])  # each matrix one owner


@pytest.mark.timeout(120)
def test_three_ranks_on_their_own_data_stay_close_and_share_the_momentum(reference):
    expected, _ = reference
    results = run_ranks(_train, 3, True, False)
    final = expected[-1][0]
    for rank, (got, _) in enumerate(results):
        params = got[-1][0]
        worst = max(float((params[n] - final[n]).abs().max()) for n in final)
        assert worst < 2e-3, f"rank {rank}: {worst:.2e} from one process after {STEPS} steps"
        assert all(torch.equal(params[n], results[0][0][-1][0][n]) for n in params), "ranks disagree"
    owned = [set(o) for _, o in results]
    assert set.union(*owned) == set(range(len(expected[-1][1]))) and sum(map(len, owned)) == len(expected[-1][1])


def test_the_cost_is_the_multiply_adds_newton_schulz_runs():
    """2m²n + m³ for m ≤ n, whichever way the matrix stands: counted here from the products
    zerokit's Newton-Schulz issues (torch's dispatcher), one iteration's worth."""
    from torch.utils.flop_counter import FlopCounterMode

    for shape in ((32, 32), (2, 512), (512, 2), (22, 88)):
        flops = []
        for steps in (1, 2):
            with FlopCounterMode(display=False) as counter:
                zerokit.muon.newton_schulz(torch.randn(shape), steps=steps)
            flops.append(counter.get_total_flops())
        assert (flops[1] - flops[0]) // 2 == newton_schulz_cost(shape), shape  # 2 flops per multiply-add


def test_owners_balance_newton_schulz_cost_not_elements():
    # one 32 x 32 matrix costs 3·32³ = 98,304 multiply-adds, sixteen 2 x 512 ones 16·(2·2²·512 + 2³) =
    # 65,664 with sixteen times its elements: balanced by cost, one rank gets the square matrix alone
    shapes = [(32, 32)] + [(2, 512)] * 16
    owners = assign_owners(shapes, 2)
    load = [sum(newton_schulz_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(2)]
    elements = [sum(a * b for (a, b), o in zip(shapes, owners) if o == r) for r in range(2)]
    assert sorted(load) == [16 * 4104, 98304]
    assert sorted(elements) == [1024, 16 * 1024]
    assert assign_owners(shapes, 2) == owners  # every rank computes the same assignment


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_straddling_matrices_are_those_a_shard_boundary_cuts(world_size):
    params = list(build_model("transformer").parameters())
    shard = FlatBucket(params, world_size, 0).shard_numel
    cut, offset = 0, 0
    for p in params:
        first, last = offset // shard, (offset + p.numel() - 1) // shard
        cut += p.dim() == 2 and first != last
        offset += p.numel()
    assert straddling_matrices(params, world_size) == cut > 0


def _unused_is_left_alone(rank, world_size):
    torch.manual_seed(0)
    used, unused = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4, 6))
    opt = zerokit.ZeRO1Muon([used, unused], lr=0.1)
    before = unused.detach().clone()
    (used.sum() * (rank + 1)).backward()
    opt.step()
    return torch.equal(unused, before), unused in opt.state, used.detach().clone()


@pytest.mark.timeout(60)
def test_a_matrix_no_rank_has_a_gradient_for_is_left_alone():
    results = run_ranks(_unused_is_left_alone, 2)
    assert all(same and not has_state for same, has_state, _ in results)
    assert torch.equal(results[0][2], results[1][2])


def _refusals(rank, world_size):
    with pytest.raises(TypeError, match="ZeRO1Muon"):
        zerokit.ZeRO1(torch.nn.Linear(3, 3).parameters(), torch.optim.Muon)
    with pytest.raises(ValueError, match="2-D parameters only.*ZeRO1Adam"):
        zerokit.ZeRO1Muon(torch.nn.Linear(3, 3).parameters())
    return True


@pytest.mark.timeout(60)
def test_whole_matrix_optimizers_and_vectors_are_refused_with_what_to_use():
    assert run_ranks(_refusals, 2) == [True, True]


def _owned_momentum(model, muon):
    names = {p: n for n, p in model.named_parameters()}
    return {names[p]: s["momentum_buffer"].clone() for p, s in muon.state.items() if "momentum_buffer" in s}


def _save_at(rank, world_size, directory):
    """Three steps of ZeRO1Muon + ZeRO1Adam, every rank on the same batch; one checkpoint per optimizer."""
    model, muon, adam = _build(True)
    _steps(model, (muon, adam), range(3))
    zerokit.checkpoint.save(directory / "muon", model, muon)
    zerokit.checkpoint.save(directory / "adam", model, adam)
    return _owned_momentum(model, muon), {n: p.detach().clone() for n, p in model.named_parameters()}


def _load_and_go_on(rank, world_size, directory, sharded):
    """Another model (seed 1), loaded from the checkpoints; its momentum now, then two more steps."""
    model, muon, adam = _build(sharded, seed=1)
    zerokit.checkpoint.load(directory / "muon", model, muon)
    zerokit.checkpoint.load(directory / "adam", model, adam)
    loaded = _owned_momentum(model, muon), {n: p.detach().clone() for n, p in model.named_parameters()}
    _steps(model, (muon, adam), range(3, 5))
    return loaded, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(120)
def test_a_checkpoint_reshards_the_momentum_to_the_new_owners_and_training_goes_on_bit_for_bit(tmp_path):
    saved = run_ranks(_save_at, 3, tmp_path)
    momentum = {}
    for owned, _ in saved:
        assert not momentum.keys() & owned.keys(), "a matrix with two owners"
        momentum.update(owned)
    weights = saved[0][1]
    n_matrices = len(_split(build_model("transformer"))[0])
    assert len(momentum) == n_matrices  # every matrix stepped: a momentum to carry over each

    alone = run_ranks(_load_and_go_on, 1, tmp_path, False)[0]  # torch.optim.Muon + AdamW, one process
    two = run_ranks(_load_and_go_on, 2, tmp_path, True)  # ZeRO1Muon on 2 ranks: other owners than at 3
    for who, ((owned, loaded_weights), _) in [("one process", alone)] + [(f"rank {r} of 2", t) for r, t in enumerate(two)]:
        assert all(torch.equal(loaded_weights[n], weights[n]) for n in weights), f"{who}: weights not as saved"
        for n, m in owned.items():
            assert torch.equal(m, momentum[n]), f"{who}: momentum of {n} not as saved"
    owned_by_two = [set(t[0][0]) for t in two]
    assert set.union(*owned_by_two) == momentum.keys(), "a matrix's momentum lost"
    assert sum(map(len, owned_by_two)) == n_matrices, "each matrix's momentum on exactly one rank of 2"
    assert owned_by_two[0] != set(saved[0][0]), "rank 0 owns the same matrices at 2 as at 3: nothing resharded"
    assert alone[0][0].keys() == momentum.keys()
    for r, (_, after) in enumerate(two):  # the same batch on both ranks: exact, as in the tests above
        assert all(torch.equal(after[n], alone[1][n]) for n in after), f"rank {r}: two steps after loading"
