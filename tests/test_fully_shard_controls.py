"""FullyShard's FSDP2 controls, measured (zerokit/fully_shard/: reshard.py, sharding.py, __init__.py).

Each control is measured on real ranks by zerokit.memory.census and zerokit.CommCounter and held
to its formula (the table of zerokit/fully_shard/reshard.py), on 4 ranks laid out as 2 "nodes" of 2:

- reshard_after_forward True / False / None / 2 (hpZ): the parameter bytes held between forward
  and backward, the all-gather bytes of backward, and how many of them cross a node; each is
  bitwise the others' training (the same arithmetic), and ReshardZeRO3Adam(k) is bitwise
  ZeRO3Adam, lesson 05's class;
- gradient sync off for k - 1 micro-batches: nothing communicated meanwhile, one reduce-scatter
  a step, the full gradients in the census, and the result equal to synchronised accumulation
  within fp32 rounding (not bitwise: the micro-batches are summed before the mean over ranks
  instead of after it, two roundings in another order);
- unshard / reshard, explicit prefetch, grouped units, output_dtype and cast_forward_inputs.

Formulas are taken over the units' padded flat buckets (a unit's elements padded to a multiple
of N: FlatBucket's layout, read from the sharding), which are checked to hold the model's Ψ.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerokit
from conftest import padding_bound, run_ranks
from zerokit.memory import census
from zerokit.fully_shard.reshard import ReshardZeRO3Adam

NODE = 2  # ranks per "node": 4 ranks are 2 nodes of 2


class Uneven(nn.Module):
    """Layers of uneven shapes (FSDP2's own tests use (7, 15), (15, 3), (16, 17)), and a root that
    owns a parameter of its own, so that the root unit is not empty."""

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


def data(rank, step, n=4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 7, generator=g), torch.randn(n, 17, generator=g)


def loss_of(model, rank, step):
    x, y = data(rank, step)
    return nn.functional.mse_loss(model(x), y)


# ---------------------------------------------------------------------------------------
# reshard_after_forward: memory and traffic per control, 4 ranks as 2 x 2


CONTROLS = (True, False, None, NODE)


def _reshard_case(rank, world_size):
    out = {}
    for control in CONTROLS:
        fs = zerokit.FullyShard(uneven(), reshard_after_forward=control)
        opt = torch.optim.Adam(fs.parameters(), lr=1e-2)
        sharding = fs._sharding
        padded = [b.padded_numel for b in sharding.buckets]
        root = [b.padded_numel for b, u in zip(sharding.buckets, sharding.bucket_units) if u == 0]
        losses, steps = [], []
        for step in range(3):
            with zerokit.CommCounter() as fwd:
                loss = loss_of(fs, rank, step)
            held = census(fs, fs, scan=False)["parameters"]
            with zerokit.CommCounter() as bwd:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            steps.append({"held": held, "fwd_ag": fwd.node_split(NODE, "all_gather"),
                          "bwd_ag": bwd.node_split(NODE, "all_gather"),
                          "bwd_rs": bwd.node_split(NODE, "reduce_scatter"), "bwd_ag_calls": bwd.count("all_gather")})
        out[control] = {"padded": padded, "root": sum(root), "losses": losses, "steps": steps,
                        "weights": fs.full_parameters()}
    # lesson 05's class against the same machinery with hpZ: the optimizer is Adam in both
    for name, cls, kw in (("zero3", zerokit.ZeRO3Adam, {}), ("hpz", ReshardZeRO3Adam, {"reshard_after_forward": NODE})):
        model = uneven()
        opt = cls(model, lr=1e-2, **kw)
        losses = []
        for step in range(3):
            loss = loss_of(model, rank, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with opt.gathered():
            out[name] = {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


@pytest.mark.distributed
def test_reshard_after_forward_memory_and_traffic_against_the_formula():
    n = 4
    psi = sum(p.numel() for p in uneven().parameters())
    for rank, got in enumerate(run_ranks(_reshard_case, n)):
        padded = got[True]["padded"]
        total = sum(padded)
        n_params = sum(1 for _ in uneven().parameters())
        assert psi <= total < psi + padding_bound(n_params, len(padded), n)  # the model, and padding only
        shard_bytes = 4 * total // n
        # what each control holds between forward and backward, beyond the shards (fp32: 4 bytes)
        beyond = {True: 0, False: 4 * total, None: 4 * got[True]["root"], NODE: 4 * total // NODE}
        # backward's all-gather volume: every unit again (True), all but the root (None), none (False),
        # every unit from its secondary shards inside the node (hpZ)
        regathered = {True: total, False: 0, None: total - got[True]["root"], NODE: total}
        for control in CONTROLS:
            for step, s in enumerate(got[control]["steps"]):
                where = f"rank {rank}, reshard_after_forward={control}, step {step}"
                assert s["held"] == shard_bytes + beyond[control], (where, s["held"], shard_bytes, beyond[control])
                assert s["fwd_ag"] == {"intra": 0, "inter": 4 * total}, where  # forward: over all 4 ranks
                assert s["bwd_rs"] == {"intra": 0, "inter": 4 * total}, where  # the gradients: over all 4 ranks
                if control == NODE:  # hpZ: backward's gathers never leave the node
                    assert s["bwd_ag"] == {"intra": 4 * total, "inter": 0}, where
                else:
                    assert s["bwd_ag"] == {"intra": 0, "inter": 4 * regathered[control]}, where
                if control is False:
                    assert s["bwd_ag_calls"] == 0, where
        assert got[NODE]["steps"][0]["held"] - shard_bytes == 4 * total // NODE  # Psi/k beside Psi/N
        for control in CONTROLS:  # the same arithmetic: bitwise the same training
            assert got[control]["losses"] == got[True]["losses"], control
            for name, w in got[True]["weights"].items():
                assert torch.equal(got[control]["weights"][name], w), (control, name)
        assert got["hpz"]["losses"] == got["zero3"]["losses"]
        for name, w in got["zero3"]["weights"].items():
            assert torch.equal(got["hpz"]["weights"][name], w), name
    print(f"Psi = {psi}, N = 4 as 2 x 2: held after forward (bytes, rank 0): "
          + ", ".join(f"{c}: {got[c]['steps'][0]['held']}" for c in CONTROLS))


def _refused(rank, world_size):
    said = []
    for bad in (3, 0, "2", 2.0):
        try:
            zerokit.FullyShard(uneven(), reshard_after_forward=bad)
        except (ValueError, TypeError) as exc:
            said.append(str(exc))
    return said


@pytest.mark.distributed
def test_a_node_size_that_does_not_divide_the_ranks_is_refused():
    said = run_ranks(_refused, 4)[0]
    assert len(said) == 4, said
    assert "must divide the 4 ranks" in said[0] and "must divide the 4 ranks" in said[1]
    assert "must be True, False, None or an int" in said[2] and "must be True, False, None or an int" in said[3]


# ---------------------------------------------------------------------------------------
# gradient sync off: accumulation without reducing each micro-batch


MICRO = 3  # micro-batches per step: the first MICRO - 1 with gradient sync off


def _accumulate(rank, world_size):
    psi = sum(p.numel() for p in uneven().parameters())
    out = {}
    for system in ("synced", "no-sync", "no-sync in place", "ZeRO3Adam.no_sync"):
        model = uneven()
        if system == "ZeRO3Adam.no_sync":
            opt = zerokit.ZeRO3Adam(model, lr=1e-2)
            sharding, owner = opt, model
        else:
            owner = zerokit.fully_shard(model) if system.endswith("in place") else zerokit.FullyShard(model)
            opt = torch.optim.Adam(owner.parameters(), lr=1e-2)
            sharding = getattr(owner, "_sharding", None) or owner._zerokit_sharding
        record = {"quiet": [], "step_rs": [], "grads_held": []}
        for step in range(3):
            with zerokit.CommCounter() as whole:
                for k in range(MICRO):
                    last = k == MICRO - 1
                    if system == "ZeRO3Adam.no_sync":
                        sync = last
                        context = opt.no_sync() if not last else _nothing()
                    else:
                        sync = last or system == "synced"
                        if system != "synced":
                            owner.set_requires_gradient_sync(last)
                        context = _nothing()
                    with zerokit.CommCounter() as micro, context:
                        loss_of(owner, rank, MICRO * step + k).backward()
                    if not sync:
                        record["quiet"].append(micro.count("reduce_scatter") + micro.count("all_reduce"))
                        record["grads_held"].append(census(owner, sharding, scan=False)["gradients"])
                opt.step()
                opt.zero_grad(set_to_none=step % 2 == 0)
            record["step_rs"].append(whole.count("reduce_scatter"))
        if system == "ZeRO3Adam.no_sync":
            with opt.gathered():
                record["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        else:
            record["weights"] = owner.full_parameters()
        record["buckets"] = len(sharding.buckets)
        # the shard parameters' own .grad, kept (zeroed) by zero_grad(set_to_none=False): views of one
        # buffer per bucket, this rank's padded shard of it (FlatBucket's layout); a bucket whose shard here
        # is padding alone (the alignment's, zerokit.flat) has no piece here, so no .grad keeps its buffer
        record["shard_numel"] = 0 if system == "ZeRO3Adam.no_sync" else sum(
            b.shard_numel for b in sharding.buckets if b.segments)
        out[system] = record
    return psi, out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_sync_off_accumulates_without_reducing(world_size):
    for rank, (psi, got) in enumerate(run_ranks(_accumulate, world_size)):
        buckets = got["synced"]["buckets"]
        assert got["synced"]["step_rs"] == [MICRO * buckets] * 3  # each micro-batch reduce-scatters
        for system in ("no-sync", "no-sync in place", "ZeRO3Adam.no_sync"):
            r = got[system]
            assert r["quiet"] == [0] * (3 * (MICRO - 1)), (system, r["quiet"])  # no reduction while off
            assert r["step_rs"] == [buckets] * 3, (system, r["step_rs"])  # one reduce-scatter a step
            # the full gradients, 4 Psi bytes, and in step 2 the zeroed shard .grad step 1's zero_grad kept
            kept = [0, 0, 4 * r["shard_numel"]]
            want = [4 * psi + kept[step] for step in range(3) for _ in range(MICRO - 1)]
            assert r["grads_held"] == want, (system, r["grads_held"], want)
        synced, quiet = got["synced"]["weights"], got["no-sync"]["weights"]
        worst = max((synced[n] - quiet[n]).abs().max().item() for n in synced)
        assert worst <= 1e-6, worst  # fp32 rounding: the sum over micro-batches and the mean over ranks swap
        for system in ("no-sync in place", "ZeRO3Adam.no_sync"):  # one machinery: bitwise the same
            for name, w in quiet.items():
                assert torch.equal(got[system]["weights"][name], w), (system, name)
    print(f"N = {world_size}: no-sync against synced accumulation, max |difference| {worst:.2e} "
          f"({'bitwise' if worst == 0 else 'not bitwise'})")


# ---------------------------------------------------------------------------------------
# unshard / reshard, explicit prefetch, grouped units, output_dtype and cast_forward_inputs


def _gathers_before(module, counter, seen, backward=False):
    """Note how many all-gathers the counter has seen when `module`'s forward (or backward) starts."""
    note = lambda *_: seen.append(counter.count("all_gather"))  # noqa: E731
    if backward:
        return module.register_full_backward_pre_hook(note)
    return module.register_forward_pre_hook(note)


def _units_case(rank, world_size):
    out = {}
    # unshard / reshard, in place: the unit's modules show the compute parameters while it is gathered
    model = zerokit.fully_shard(uneven())
    shard_shape = tuple(model.inp.weight.shape)
    with zerokit.CommCounter() as c:
        model.inp.unshard()
    out["unshard"] = (c.count("all_gather"), tuple(model.inp.weight.shape), model.inp.weight.numel() > 0)
    with zerokit.CommCounter() as c:
        loss_of(model, rank, 0).backward()  # inp's forward finds it gathered: one all-gather fewer
    out["forward_after_unshard"] = c.count("all_gather")
    with zerokit.CommCounter() as c:
        loss_of(model, rank, 0).backward()
    out["forward_plain"] = c.count("all_gather")
    shard_shape = tuple(model.out.weight.shape)
    handle = model.out.unshard(async_op=True)
    handle.wait()
    shown = tuple(model.out.weight.shape)
    model.out.reshard()
    out["reshard"] = (shown, tuple(model.out.weight.shape), shard_shape)

    # explicit prefetch: which gathers have started when inp's forward, or up's backward, begins
    for mode in ("implicit", "explicit", "none"):
        model = zerokit.fully_shard(uneven())
        layers = [model.inp, model.mid, model.up, model.out]
        if mode == "explicit":
            model.set_modules_to_forward_prefetch(layers)  # the root's forward starts every layer's gather
            model.out.set_modules_to_backward_prefetch([model.up, model.mid, model.inp])
        elif mode == "none":
            for m in [model] + layers:
                m.set_modules_to_forward_prefetch([])
                m.set_modules_to_backward_prefetch([])
        seen_fwd, seen_bwd = [], []
        loss_of(model, rank, 0).backward()  # a first step: the implicit prefetch learns the order
        with zerokit.CommCounter() as c:
            hooks = [_gathers_before(model.inp, c, seen_fwd), _gathers_before(model.up, c, seen_bwd, backward=True)]
            loss = loss_of(model, rank, 1)
            forward_gathers = c.count("all_gather")
            loss.backward()
        for h in hooks:
            h.remove()
        out[mode] = (seen_fwd[0], seen_bwd[0] - forward_gathers, forward_gathers, c.count("all_gather"))

    # a group of modules as one unit (FSDP2's fully_shard([inp, mid])): gathered once, bitwise the same
    weights = {}
    for units in (None, [[0, 1], 2, 3]):
        model = uneven()
        layers = [model.inp, model.mid, model.up, model.out]
        chosen = None if units is None else [[layers[i] for i in u] if isinstance(u, list) else layers[u]
                                             for u in units]
        fs = zerokit.FullyShard(model, units=chosen)
        opt = torch.optim.Adam(fs.parameters(), lr=1e-2)
        full_inside = []
        fs.module.mid.register_forward_pre_hook(lambda m, a: full_inside.append(m.weight.numel()))
        for step in range(3):
            with zerokit.CommCounter() as c:
                loss_of(fs, rank, step).backward()
            opt.step()
            opt.zero_grad()
        weights["grouped" if units else "one per layer"] = (fs.full_parameters(), c.table()["all_gather"]["calls"],
                                                              full_inside)
    out["groups"] = weights

    # output_dtype and cast_forward_inputs, at every unit
    model = zerokit.fully_shard(uneven(), compute_dtype=torch.bfloat16, output_dtype=torch.float32)
    dtypes = []
    model.mid.register_forward_pre_hook(lambda m, a: dtypes.append(("mid in", a[0].dtype)))
    model.mid.register_forward_hook(lambda m, a, o: dtypes.append(("mid out", o.dtype)))
    result = model(data(rank, 0)[0])
    out["dtypes"] = dtypes + [("model out", result.dtype)]
    loose = zerokit.fully_shard(uneven(), compute_dtype=torch.bfloat16, cast_forward_inputs=False)
    try:
        loose(data(rank, 0)[0])  # fp32 input, bf16 weights: nothing casts it
        out["uncast"] = "ran"
    except RuntimeError as exc:
        out["uncast"] = str(exc)
    return out


@pytest.mark.distributed
def test_unshard_prefetch_groups_and_casts():
    for rank, got in enumerate(run_ranks(_units_case, 2)):
        calls, shape, full = got["unshard"]
        assert calls == 1 and shape == (15, 7) and full, got["unshard"]
        assert got["forward_after_unshard"] == got["forward_plain"] - 1
        shown, after, shard_shape = got["reshard"]
        assert shown == (17, 16) and after == shard_shape and len(shard_shape) == 1, got["reshard"]
        # forward: gathers begun when inp computes (root and inp, + mid prefetched; explicit: all five)
        assert got["implicit"][0] == 3 and got["explicit"][0] == 5 and got["none"][0] == 2, got
        # backward (the root stays gathered): up's backward pre-hook runs before zerokit's hook on up's
        # output (the module's hook wraps that output), so out's gather is in, and up's if out's
        # backward prefetched it (implicit); explicit from out: up, mid and inp; no prefetch: out's alone
        assert got["implicit"][1] == 2 and got["explicit"][1] == 4 and got["none"][1] == 1, got
        for mode in ("implicit", "explicit", "none"):  # the same gathers, only earlier or later
            assert got[mode][2:] == got["implicit"][2:], (mode, got[mode])
        (grouped, grouped_calls, full_inside), (plain, plain_calls, _) = got["groups"]["grouped"], \
            got["groups"]["one per layer"]
        assert plain_calls - grouped_calls == 2  # one gather fewer in forward and in backward
        assert all(n == 15 * 3 for n in full_inside), full_inside  # mid's weight full in its forward
        for name, w in plain.items():
            assert torch.equal(grouped[name], w), name
        assert got["dtypes"] == [("mid in", torch.bfloat16), ("mid out", torch.float32),
                                 ("model out", torch.float32)], got["dtypes"]
        assert "dtype" in got["uncast"], got["uncast"]


# ---------------------------------------------------------------------------------------
# in place: the model's own parameters are the shards


def _in_place_case(rank, world_size):
    from zerokit.fully_shard import FullyShardedModule

    model = uneven()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    same = zerokit.fully_shard(model)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    seen = {}
    for step in range(3):
        loss_of(model, rank, step).backward()
        # what a test written for FSDP2 reads after backward: every parameter has a gradient, its shape
        seen[step] = {n: (None if p.grad is None else tuple(p.grad.shape), tuple(p.shape))
                      for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    wrapper = zerokit.FullyShard(uneven())
    wopt = torch.optim.AdamW(wrapper.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        loss_of(wrapper, rank, step).backward()
        wopt.step()
        wopt.zero_grad(set_to_none=step % 2 == 0)
    refused = []
    for call in (lambda: model.state_dict(), lambda: zerokit.fully_shard(model), lambda: model.inp.full_parameters(),
                 lambda: model.inp.set_requires_gradient_sync(False), lambda: zerokit.fully_shard(model.mid)):
        try:
            call()
            refused.append(None)
        except (NotImplementedError, ValueError, RuntimeError) as exc:
            refused.append(str(exc))
    return {"same": same is model, "kinds": [isinstance(m, FullyShardedModule) for m in (model, model.inp, model.out)],
            "class": type(model).__name__, "is_uneven": isinstance(model, Uneven), "shapes": shapes,
            "names": sorted(params), "optimizer_got": [p is params[n] for n, p in model.named_parameters()],
            "numels": {n: p.numel() for n, p in params.items()}, "seen": seen, "full": model.full_parameters(),
            "wrapper": wrapper.full_parameters(), "refused": refused}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_in_place_the_models_parameters_are_the_shards(world_size):
    results = run_ranks(_in_place_case, world_size)
    psi = sum(p.numel() for p in uneven().parameters())
    for rank, got in enumerate(results):
        assert got["same"] and got["kinds"] == [True, True, True] and got["is_uneven"], got["class"]
        assert got["names"] == sorted(got["shapes"]), "the model keeps its parameter names"
        assert all(got["optimizer_got"])
        for step, seen in got["seen"].items():
            for name, (grad_shape, shape) in seen.items():
                assert len(shape) == 1 and grad_shape == shape, (rank, step, name, grad_shape, shape)
        for name, w in got["full"].items():
            assert tuple(w.shape) == got["shapes"][name]
            assert torch.equal(w, got["wrapper"][name]), name  # one machinery: the wrapper's numbers
        said = got["refused"]
        assert "state_dict() would be a sliver" in said[0]
        assert "already sharded" in said[1] and "already sharded" in said[4]
        assert "for the whole model" in said[2] and "for the whole model" in said[3]
    assert sum(sum(got["numels"].values()) for got in results) == psi  # together the pieces are the model


# ---------------------------------------------------------------------------------------
# clipping: the norm over every rank, and torch's own refusing a piece


CLIP = {2.0: 0.1, float("inf"): 0.04}  # below the first step's norm for each norm type


def _clip_reference(rank, world_size, n, norm_type):
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


def _clip_case(rank, world_size):
    out = {}
    for face in ("wrapper", "in place"):
        for norm_type in (2.0, float("inf")):
            model = zerokit.FullyShard(uneven()) if face == "wrapper" else zerokit.fully_shard(uneven())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            norms = []
            for step in range(4):
                loss_of(model, rank, step).backward()
                norms.append(model.clip_grad_norm_(CLIP[norm_type], norm_type=norm_type).item())
                opt.step()
                opt.zero_grad()
            out[(face, norm_type)] = (norms, model.full_parameters())
    loss_of(model, rank, 0).backward()
    said = []
    for call in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5),
                 lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True),
                 lambda: next(p for p in model.parameters() if p.grad is not None).grad.norm()):
        try:
            call()
            said.append(None)
        except RuntimeError as exc:
            said.append(str(exc))
    model.set_requires_gradient_sync(False)
    loss_of(model, rank, 1).backward()
    try:
        model.clip_grad_norm_(0.5)
        said.append(None)
    except RuntimeError as exc:
        said.append(str(exc))
    return out, said


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_is_the_norm_over_every_rank(world_size):
    reference = {p: run_ranks(_clip_reference, 1, world_size, p)[0] for p in (2.0, float("inf"))}
    apart = {"norm": 0.0, "weights": 0.0}
    for rank, (got, said) in enumerate(run_ranks(_clip_case, world_size)):
        for (face, p), (norms, weights) in got.items():
            ref_norms, ref_weights = reference[p]
            assert ref_norms[0] > CLIP[p]  # the clip acts: a real comparison
            assert norms == pytest.approx(ref_norms, rel=1e-6), (face, p, norms, ref_norms)
            worst = max((weights[n] - w).abs().max().item() for n, w in ref_weights.items())
            assert worst <= 1e-5, (face, p, worst)
            apart["weights"] = max(apart["weights"], worst)
            apart["norm"] = max(apart["norm"], max(abs(a - b) / b for a, b in zip(norms, ref_norms)))
        assert all(s is not None and "one rank's piece of a sharded gradient" in s for s in said[:3]), said
        assert said[3] is not None and "requires_gradient_sync is off" in said[3], said[3]
    print(f"N = {world_size}, 4 clipped steps against one process: norms {apart['norm']:.1e} apart (relative), "
          f"weights {apart['weights']:.1e}")
