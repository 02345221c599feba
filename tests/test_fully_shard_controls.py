"""zerokit.fully_shard's controls, measured against their formulas (zerokit/fully_shard/).

FSDP2 cuts each parameter on its own, along dim 0: with R rows and N ranks every rank holds
c = ceil(R / N) rows, padded with zero rows to c, so a parameter of shape (R, d1, ...) costs
c * d1 * ... elements on every rank, and one fully_shard call's S is the sum of that over its
parameters. Each all-gather of a call moves N S elements (the paper's convention: its output)
and each reduce-scatter N S (its input). What a rank holds is read off the records of the calls
(`state_of(module).groups`, each group's ShardedParam records: the padded shard, the gathered
buffer, hpZ's kept piece, the gradients), as the bytes of the storages they hold; the
collectives by zerokit.CommCounter. The model is FSDP2's test model for uneven shapes: layers
(7, 15), (15, 3), (3, 16), (16, 17) and a root that owns a parameter of its own; fully_shard on
each layer, then on the root.

- reshard_after_forward True / False / None / 2 (hpZ), on 4 ranks laid out as 2 "nodes" of 2: the
  parameter bytes held between forward and backward (S, + N S, + the root's N S, + N S / 2 over
  every call), backward's all-gather bytes and how many cross a node (hpZ: none); each setting
  trains bitwise as the others (the same arithmetic); a node size that does not divide N refused;
- gradient sync off for k - 1 micro-batches: nothing reduced meanwhile, one reduce-scatter per call
  a step, the full fp32 gradients (4 Ψ bytes, no padding) held, and the result equal to synchronised
  accumulation within fp32 rounding (not bitwise: the micro-batches are summed before the mean over
  ranks instead of after it), the FullyShard shell bitwise the calls it makes;
- unshard / reshard, backward's default and explicit prefetch, a list of modules as one call,
  output_dtype and cast_forward_inputs;
- in place: the model's class, its DTensor parameters and gradients (this rank's rows), state_dict;
- torch's own clip_grad_norm_ on the DTensor gradients, and the shell's: the norm over every rank.

zerokit.zeropp.ZeROppAdam's reshard_after_forward on lesson 05's flat buckets is tests/test_reshard.py;
PyTorch's own FSDP2 behaviour tests, run on both implementations, are tests/test_fsdp2_*.py.
"""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import zerokit
from conftest import ceil_div, run_ranks
from zerokit.fully_shard.api import FSDPModule, fully_shard
from zerokit.fully_shard.state import state_of

NODE = 2  # ranks per "node": 4 ranks are 2 nodes of 2


class Uneven(nn.Module):
    """Layers of uneven shapes (FSDP2's own tests use (7, 15), (15, 3), (16, 17)), and a root that
    owns a parameter of its own, so that the root's call is not empty."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid = nn.Linear(7, 15), nn.Linear(15, 3)
        self.up, self.out = nn.Linear(3, 16), nn.Linear(16, 17)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 17))

    def forward(self, x):
        h = torch.relu(self.mid(torch.relu(self.inp(x))))
        return self.out(torch.relu(self.up(h))) * self.scale


def uneven(seed=0):
    torch.manual_seed(seed)
    return Uneven()


def layers(model):
    return [model.inp, model.mid, model.up, model.out]


def shard(model, units=None, **settings):
    """FSDP2's calls: fully_shard on each unit (default: each layer), then on the root."""
    for unit in units or layers(model):
        fully_shard(unit, **settings)
    return fully_shard(model, **settings)


def data(rank, step, n=4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 7, generator=g), torch.randn(n, 17, generator=g)


def loss_of(model, rank, step):
    x, y = data(rank, step)
    return nn.functional.mse_loss(model(x), y)


def padded(shape, n):
    """Elements of a parameter's padded dim-0 shard: ceil(rows / N) rows of the other dimensions."""
    rest = 1
    for d in shape[1:]:
        rest *= d
    return ceil_div(shape[0], n) * rest


def rows_held(rows, n, rank):
    """(start, length): the rows of a dim 0 of `rows` that rank `rank` of n holds, as torch.chunk cuts it."""
    c = ceil_div(rows, n)
    start = min(rank * c, rows)
    return start, min(c, rows - start)


def call_sizes(n):
    """S of each call, in the order shard() makes them: the four layers, then the root."""
    model = uneven()
    return [sum(padded(p.shape, n) for p in m.parameters(recurse=False)) for m in layers(model)] + \
        [padded(model.scale.shape, n)]


def records(model):
    """Every ShardedParam record of the fully_shard calls inside `model`."""
    found, out = [], []
    for m in model.modules():
        state = state_of(m)
        if state is not None and all(state is not s for s in found):
            found.append(state)
            for group in state.groups:
                out += group.params
    return out


def _storage_bytes(tensors):
    """Bytes of the distinct storages of `tensors` (None skipped; a freed buffer, resized to 0, counts 0)."""
    sizes = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(sizes.values())


def held(model):
    """{"parameters", "gradients"}: bytes the records hold now. Parameters: the padded shards, the gathered
    buffers while allocated, hpZ's pieces; gradients: the full local ones (no-sync), the shards' .grad."""
    params, grads = [], []
    for r in records(model):
        params += [r.padded, r.gathered, r.post_forward_flat]
        grads += [r.accumulated_grad, None if r.unsharded_param is None else r.unsharded_param.grad,
                  None if r.sharded_param.grad is None else r.sharded_param.grad.to_local()]
    return {"parameters": _storage_bytes(params), "gradients": _storage_bytes(grads)}


def full_weights(model):
    return {n: p.full_tensor() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------
# each case runs on every rank; one launch per world size runs the cases the tests below read


CONTROLS = (True, False, None, NODE)


def _reshard(rank, world_size):
    out = {}
    for control in CONTROLS:
        model = shard(uneven(), reshard_after_forward=control)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, steps = [], []
        for step in range(2):  # the first step, and one after an optimizer step: what every step after holds
            at_rest = held(model)["parameters"]
            with zerokit.CommCounter() as fwd:
                loss = loss_of(model, rank, step)
            after_forward = held(model)["parameters"]
            with zerokit.CommCounter() as bwd:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            steps.append({"at_rest": at_rest, "held": after_forward, "fwd_ag": fwd.node_split(NODE, "all_gather"),
                          "bwd_ag": bwd.node_split(NODE, "all_gather"),
                          "bwd_rs": bwd.node_split(NODE, "reduce_scatter"), "bwd_ag_calls": bwd.count("all_gather")})
        out[control] = {"losses": losses, "steps": steps, "weights": full_weights(model)}
    return out


def _refused(rank, world_size):
    said = []
    for bad in (3, 0, "2", 2.0):
        with pytest.raises(ValueError) as info:
            fully_shard(uneven().inp, reshard_after_forward=bad)
        said.append(str(info.value))
    return said


MICRO = 3  # micro-batches per step: the first MICRO - 1 with gradient sync off


def _accumulate(rank, world_size):
    out = {}
    for system in ("synced", "no-sync", "no-sync, FullyShard"):
        model = zerokit.FullyShard(uneven()) if system.endswith("FullyShard") else shard(uneven())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        inner = model.module if system.endswith("FullyShard") else model
        record = {"quiet": [], "step_rs": [], "grads_held": []}
        for step in range(3):
            with zerokit.CommCounter() as whole:
                for k in range(MICRO):
                    last = k == MICRO - 1
                    if system != "synced":
                        model.set_requires_gradient_sync(last)
                    with zerokit.CommCounter() as micro:
                        loss_of(model, rank, MICRO * step + k).backward()
                    if not last and system != "synced":
                        record["quiet"].append(micro.count("reduce_scatter") + micro.count("all_reduce"))
                        record["grads_held"].append(held(inner)["gradients"])
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
            record["step_rs"].append(whole.count("reduce_scatter"))
        record["weights"] = model.full_parameters() if system.endswith("FullyShard") else full_weights(model)
        out[system] = record
    return out


def _gathers_before(module, counter, seen, backward=False):
    """Note how many all-gathers the counter has seen when `module`'s forward (or backward) starts."""
    note = lambda *_: seen.append(counter.count("all_gather"))  # noqa: E731
    if backward:
        return module.register_full_backward_pre_hook(note)
    return module.register_forward_pre_hook(note)


def _units(rank, world_size):
    out = {}
    # unshard / reshard: the module shows the unsharded parameter while its call is gathered
    model = shard(uneven())
    with zerokit.CommCounter() as c:
        model.inp.unshard()
    out["unshard"] = (c.count("all_gather"), type(model.inp.weight).__name__, tuple(model.inp.weight.shape))
    with zerokit.CommCounter() as c:
        loss_of(model, rank, 0).backward()  # inp's forward finds it gathered: one all-gather fewer
    out["forward_after_unshard"] = c.count("all_gather")
    with zerokit.CommCounter() as c:
        loss_of(model, rank, 0).backward()
    out["forward_plain"] = c.count("all_gather")
    model.out.unshard(async_op=True).wait()
    shown = (type(model.out.weight).__name__, tuple(model.out.weight.shape))
    model.out.reshard()
    w = model.out.weight
    out["reshard"] = (shown, (type(w).__name__, tuple(w.shape), tuple(w.to_local().shape)))

    # backward's prefetch: which gathers have begun when inp's forward, or up's backward, starts
    for mode in ("default", "explicit"):
        model = shard(uneven())
        if mode == "explicit":
            model.set_modules_to_forward_prefetch(layers(model))  # the root's forward starts every layer's gather
            model.out.set_modules_to_backward_prefetch([model.up, model.mid, model.inp])
        seen_fwd, seen_bwd = [], []
        loss_of(model, rank, 0).backward()  # a first step: the root's lazy initialisation
        with zerokit.CommCounter() as c:
            hooks = [_gathers_before(model.inp, c, seen_fwd), _gathers_before(model.up, c, seen_bwd, backward=True)]
            loss = loss_of(model, rank, 1)
            forward_gathers = c.count("all_gather")
            loss.backward()
        for h in hooks:
            h.remove()
        out[mode] = (seen_fwd[0], seen_bwd[0] - forward_gathers, forward_gathers, c.count("all_gather"))

    # two modules in one call (fully_shard([inp, mid])): gathered once, bitwise the same at N = 2
    weights = {}
    for grouped in (False, True):
        model = uneven()
        units = [[model.inp, model.mid], model.up, model.out] if grouped else None
        shard(model, units=units)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        full_inside = []
        model.mid.register_forward_pre_hook(lambda m, a: full_inside.append(m.weight.numel()))
        for step in range(3):
            with zerokit.CommCounter() as c:
                loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
        weights["grouped" if grouped else "one per layer"] = (full_weights(model), c.count("all_gather"), full_inside)
    out["groups"] = weights

    # output_dtype and cast_forward_inputs, at every call
    model = shard(uneven(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    dtypes = []
    model.mid.register_forward_pre_hook(lambda m, a: dtypes.append(("mid in", a[0].dtype)))
    model.mid.register_forward_hook(lambda m, a, o: dtypes.append(("mid out", o.dtype)))
    result = model(data(rank, 0)[0])
    out["dtypes"] = dtypes + [("model out", result.dtype)]
    loose = shard(uneven(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    with pytest.raises(RuntimeError) as info:
        loose(data(rank, 0)[0])  # fp32 input, bf16 weights: nothing casts it
    out["uncast"] = str(info.value)
    return out


def _in_place(rank, world_size):
    model = uneven()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    same = shard(model) is model
    shown = {n: (type(p).__name__, tuple(p.shape), str(p.placements), tuple(p.to_local().shape))
             for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    steps = []
    for step in range(3):
        loss_of(model, rank, step).backward()
        # what a test written for FSDP2 reads after backward: every parameter's gradient, a DTensor like it
        steps.append({n: None if p.grad is None else (type(p.grad).__name__, tuple(p.grad.shape),
                                                      str(p.grad.placements), tuple(p.grad.to_local().shape))
                      for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    shell = zerokit.FullyShard(uneven())
    shell_opt = torch.optim.AdamW(shell.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        loss_of(shell, rank, step).backward()
        shell_opt.step()
        shell_opt.zero_grad(set_to_none=step % 2 == 0)
    state = {k: (type(v).__name__, tuple(v.shape)) for k, v in model.state_dict().items()}
    refused = []
    for call, kind in ((lambda: fully_shard(model), ValueError), (lambda: fully_shard(model.mid), ValueError),
                       (lambda: copy.deepcopy(model), RuntimeError)):
        with pytest.raises(kind) as info:
            call()
        refused.append(str(info.value))
    return {"same": same, "kinds": [isinstance(m, FSDPModule) for m in [model] + layers(model)],
            "class": type(model).__name__, "is_uneven": isinstance(model, Uneven), "shapes": shapes, "shown": shown,
            "steps": steps,
            "optimizer_got": [p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters())],
            "numel": sum(p.to_local().numel() for p in model.parameters()), "full": full_weights(model),
            "shell": shell.full_parameters(), "state": state, "refused": refused}


CLIP = {2.0: 0.1, float("inf"): 0.04}  # below the first step's norm for each norm type


def _clip_reference(n, norm_type):
    """One process, the whole batch (every rank's rows), torch's clip_grad_norm_ and AdamW."""
    model = uneven()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(4):
        xs, ys = zip(*(data(r, step) for r in range(n)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP[norm_type], norm_type=norm_type).item())
        opt.step()
        opt.zero_grad()
    return norms, {name: p.detach().clone() for name, p in model.named_parameters()}


def _clip(rank, world_size):
    out = {}
    for face in ("torch's, in place", "FullyShard's"):
        for norm_type in CLIP:
            model = zerokit.FullyShard(uneven()) if face == "FullyShard's" else shard(uneven())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            norms = []
            for step in range(4):
                loss_of(model, rank, step).backward()
                if face == "FullyShard's":
                    norm = model.clip_grad_norm_(CLIP[norm_type], norm_type=norm_type)
                else:  # torch's own on the DTensor gradients: a DTensor norm, its full value a collective
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP[norm_type],
                                                          norm_type=norm_type).full_tensor()
                norms.append(norm.item())
                opt.step()
                opt.zero_grad()
            out[(face, norm_type)] = (norms, full_weights(model))
    # the one-process reference, computed here (one rank's thread, as a one-rank launch would): one launch fewer
    out["reference"] = {p: _clip_reference(world_size, p) for p in CLIP}
    return out


CASES = {"reshard": _reshard, "refused": _refused, "accumulate": _accumulate, "units": _units,
         "in_place": _in_place, "clip": _clip}
LAUNCHES = {2: ("accumulate", "units", "in_place", "clip"), 3: ("in_place", "clip"),
            4: ("reshard", "refused", "accumulate")}


def _cases(rank, world_size, names):
    return {name: CASES[name](rank, world_size) for name in names}


@pytest.fixture(scope="module")
def ranks():
    """ranks(n, case): every rank's result of `case` at world size n, from one launch per world size."""
    done = {}

    def get(n, case):
        if n not in done:
            done[n] = run_ranks(_cases, n, LAUNCHES[n])
        return [r[case] for r in done[n]]

    return get


# ---------------------------------------------------------------------------------------
# reshard_after_forward: memory and traffic per control, 4 ranks as 2 x 2


@pytest.mark.distributed
def test_reshard_after_forward_memory_and_traffic_against_the_formula(ranks):
    n = 4
    sizes = call_sizes(n)
    total, root = sum(sizes), sizes[-1]
    # what each control holds between forward and backward beyond the shards (fp32: 4 bytes): nothing, every
    # call's gathered buffer, the root's alone (FSDP2's default keeps it), this rank's 1/2 of each (hpZ)
    beyond = {True: 0, False: 4 * n * total, None: 4 * n * root, NODE: 4 * n * total // NODE}
    # backward's all-gather: every call again (True), all but the root (None), none (False), every call
    # gathered inside the node from the pieces kept (hpZ)
    regathered = {True: n * total, False: 0, None: n * (total - root), NODE: n * total}
    for rank, got in enumerate(ranks(n, "reshard")):
        for control in CONTROLS:
            for step, s in enumerate(got[control]["steps"]):
                where = f"rank {rank}, reshard_after_forward={control}, step {step}"
                assert s["at_rest"] == 4 * total, (where, s["at_rest"], 4 * total)
                assert s["held"] == 4 * total + beyond[control], (where, s["held"], 4 * total, beyond[control])
                assert s["fwd_ag"] == {"intra": 0, "inter": 4 * n * total}, where  # forward: over all 4 ranks
                assert s["bwd_rs"] == {"intra": 0, "inter": 4 * n * total}, where  # the gradients: over all 4
                if control == NODE:  # hpZ: backward's gathers never leave the node
                    assert s["bwd_ag"] == {"intra": 4 * n * total, "inter": 0}, where
                else:
                    assert s["bwd_ag"] == {"intra": 0, "inter": 4 * regathered[control]}, where
                if control is False:
                    assert s["bwd_ag_calls"] == 0, where
        for control in CONTROLS:  # the same arithmetic: bitwise the same training
            assert got[control]["losses"] == got[True]["losses"], control
            for name, w in got[True]["weights"].items():
                assert torch.equal(got[control]["weights"][name], w), (control, name)
    print(f"N = 4 as 2 x 2, S = {total} elements a rank over 5 calls: parameter bytes held after forward (rank 0): "
          + ", ".join(f"{c}: {got[c]['steps'][0]['held']}" for c in CONTROLS))


@pytest.mark.distributed
def test_a_node_size_that_does_not_divide_the_ranks_is_refused(ranks):
    said = ranks(4, "refused")[0]
    assert len(said) == 4 and all("a divisor of the shard world size (4)" in s for s in said), said


# ---------------------------------------------------------------------------------------
# gradient sync off: accumulation without reducing each micro-batch


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_sync_off_accumulates_without_reducing(ranks, world_size):
    psi = sum(p.numel() for p in uneven().parameters())
    calls, total = len(call_sizes(world_size)), sum(call_sizes(world_size))
    for rank, got in enumerate(ranks(world_size, "accumulate")):
        assert got["synced"]["step_rs"] == [MICRO * calls] * 3  # each micro-batch reduce-scatters every call
        for system in ("no-sync", "no-sync, FullyShard"):
            r = got[system]
            assert r["quiet"] == [0] * (3 * (MICRO - 1)), (system, r["quiet"])  # nothing reduced while off
            assert r["step_rs"] == [calls] * 3, (system, r["step_rs"])  # one reduce-scatter per call, a step
            # the full fp32 gradients, 4 Psi bytes; in step 2 also the zeroed shard .grad that step 1's
            # zero_grad(set_to_none=False) kept: each call's reduce-scattered row, 4 S
            kept = [0, 0, 4 * total]
            want = [4 * psi + kept[step] for step in range(3) for _ in range(MICRO - 1)]
            assert r["grads_held"] == want, (system, r["grads_held"], want)
        synced, quiet = got["synced"]["weights"], got["no-sync"]["weights"]
        worst = max((synced[n] - quiet[n]).abs().max().item() for n in synced)
        assert worst <= 1e-6, worst  # fp32 rounding: the sum over micro-batches and the mean over ranks swap
        for name, w in quiet.items():  # the shell makes the same calls: bitwise the same
            assert torch.equal(got["no-sync, FullyShard"]["weights"][name], w), name
    print(f"N = {world_size}: no-sync against synced accumulation, max |difference| {worst:.2e} "
          f"({'bitwise' if worst == 0 else 'not bitwise'})")


# ---------------------------------------------------------------------------------------
# unshard / reshard, prefetch, a list of modules as one call, output_dtype and cast_forward_inputs


@pytest.mark.distributed
def test_unshard_prefetch_groups_and_casts(ranks):
    calls = len(call_sizes(2))
    for rank, got in enumerate(ranks(2, "units")):
        assert got["unshard"] == (1, "Parameter", (15, 7)), got["unshard"]
        # a step gathers every call for forward, and all but the root (kept, FSDP2's default) for backward
        assert got["forward_plain"] == 2 * calls - 1
        assert got["forward_after_unshard"] == got["forward_plain"] - 1
        shown, after = got["reshard"]
        assert shown == ("Parameter", (17, 16)), shown
        assert after == ("DTensor", (17, 16), (rows_held(17, 2, rank)[1], 16)), after
        # forward: gathers begun when inp's forward starts (its own pre-hook runs before the test's):
        # the root's and inp's; with the root prefetching every layer, all five
        assert got["default"][0] == 2 and got["explicit"][0] == 5, got
        # backward (the root kept gathered): up's backward pre-hook runs before fully_shard's hook on up's
        # output (the module's hook wraps that output), so out's gather is done and up's, which the previous
        # call in backward prefetches by default; out prefetching up, mid and inp explicitly: four
        assert got["default"][1] == 2 and got["explicit"][1] == 4, got
        assert got["explicit"][2:] == got["default"][2:] == (calls, 2 * calls - 1), got  # the same gathers, earlier
        (grouped, grouped_calls, full_inside), (plain, plain_calls, _) = got["groups"]["grouped"], \
            got["groups"]["one per layer"]
        assert plain_calls - grouped_calls == 2  # one gather fewer in forward and in backward
        assert full_inside == [15 * 3] * 3, full_inside  # mid's weight full in its forward
        for name, w in plain.items():
            assert torch.equal(grouped[name], w), name
        assert got["dtypes"] == [("mid in", torch.bfloat16), ("mid out", torch.float32),
                                 ("model out", torch.float32)], got["dtypes"]
        assert "dtype" in got["uncast"], got["uncast"]


# ---------------------------------------------------------------------------------------
# in place: the model's own parameters are DTensors, this rank's rows


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_the_models_parameters_are_dtensor_shards(ranks, world_size):
    results = ranks(world_size, "in_place")
    psi = sum(p.numel() for p in uneven().parameters())
    for rank, got in enumerate(results):
        assert got["same"] and got["kinds"] == [True] * 5 and got["is_uneven"], got["class"]
        assert got["class"] == "FSDPUneven"
        assert list(got["shown"]) == list(got["shapes"]), "the model keeps its parameter names, in order"
        for name, shape in got["shapes"].items():
            local = (rows_held(shape[0], world_size, rank)[1], *shape[1:])
            assert got["shown"][name] == ("DTensor", shape, "(Shard(dim=0),)", local), (name, got["shown"][name])
            for step, seen in enumerate(got["steps"]):
                assert seen[name] == ("DTensor", shape, "(Shard(dim=0),)", local), (rank, step, name, seen[name])
        assert all(got["optimizer_got"])
        for name, w in got["full"].items():
            assert tuple(w.shape) == got["shapes"][name]
            assert torch.equal(w, got["shell"][name]), name  # the shell makes the same calls: its numbers
        assert got["state"] == {n: ("DTensor", s) for n, s in got["shapes"].items()}  # FSDP2's state_dict
        said = got["refused"]
        assert "already sharded" in said[0] and "already sharded" in said[1], said
        assert "cannot be deep-copied" in said[2], said
    assert sum(got["numel"] for got in results) == psi  # together the rows are the model, once


# ---------------------------------------------------------------------------------------
# clipping: torch's own clip_grad_norm_ on the DTensor gradients is the norm over every rank


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_is_the_norm_over_every_rank(ranks, world_size):
    apart = {"norm": 0.0, "weights": 0.0}
    for got in ranks(world_size, "clip"):
        reference = got["reference"]
        runs = {k: v for k, v in got.items() if k != "reference"}
        assert len(runs) == 2 * len(CLIP)  # both faces, both norms
        for (face, p), (norms, weights) in runs.items():
            ref_norms, ref_weights = reference[p]
            assert ref_norms[0] > CLIP[p]  # the clip acts: a real comparison
            assert norms == pytest.approx(ref_norms, rel=1e-6), (face, p, norms, ref_norms)
            worst = max((weights[n] - w).abs().max().item() for n, w in ref_weights.items())
            assert worst <= 1e-5, (face, p, worst)
            apart["weights"] = max(apart["weights"], worst)
            apart["norm"] = max(apart["norm"], max(abs(a - b) / b for a, b in zip(norms, ref_norms)))
    print(f"N = {world_size}, 4 clipped steps against one process: norms {apart['norm']:.1e} apart (relative), "
          f"weights {apart['weights']:.1e}")
