"""zerokit's fully_shard beside torch's, bit for bit (issue 45: "Bitwise", and DCP both ways).

Each scenario builds the same model twice in the same ranks, shards one with
torch.distributed.fsdp.fully_shard and one with zerokit.fully_shard with the same calls and
settings (a fully_shard per block, then the root; torch's own policy objects), steps both with the
same torch optimizer on the same per-rank batches, and holds them to torch.equal: every step's
loss, every gradient shard, every parameter shard, and at the end every full parameter. The lead's
zerokit uses FSDP2's collectives in FSDP2's order (the all-gather on a copy-in buffer, the
reduce-scatter on a chunk-cat buffer with ReduceOp.AVG in fp32/bf16), which is what makes bitwise
possible at N = 4 too. A DCP checkpoint written by one system is read by the other, both ways, and
training continues bit for bit.

These run for zerokit only (against torch inside the scenario); tests/test_fsdp2_*.py hold both
systems to PyTorch's own behaviour tests.

Scenarios (name, world size N, <- the PyTorch test it ports; then what it asserts):

- bitwise_transformer_fp32_N2 (N=2, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    Transformer, fp32, 3 AdamW steps: losses, gradient shards, shards and final full parameters
    torch.equal to torch's fully_shard
- bitwise_transformer_bf16_N2 (N=2, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    Transformer, bf16, 3 AdamW steps: losses, gradient shards, shards and final full parameters
    torch.equal to torch's fully_shard
- bitwise_transformer_bf16_reduce_bf16_N2 (N=2, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    Transformer, bf16 reduce bf16, 3 AdamW steps: losses, gradient shards, shards and final full
    parameters torch.equal to torch's fully_shard
- bitwise_uneven_fp32_reshard_False_N2 (N=2, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    uneven layers and a root parameter, reshard_after_forward=False: torch.equal to torch's every step
- bitwise_transformer_fp32_N4 (N=4, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    Transformer, fp32, 3 AdamW steps: losses, gradient shards, shards and final full parameters
    torch.equal to torch's fully_shard
- bitwise_transformer_bf16_N4 (N=4, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    Transformer, bf16, 3 AdamW steps: losses, gradient shards, shards and final full parameters
    torch.equal to torch's fully_shard
- bitwise_transformer_bf16_reduce_bf16_N4 (N=4, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    Transformer, bf16 reduce bf16, 3 AdamW steps: losses, gradient shards, shards and final full
    parameters torch.equal to torch's fully_shard
- bitwise_uneven_fp32_reshard_False_N4 (N=4, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    uneven layers and a root parameter, reshard_after_forward=False: torch.equal to torch's every step
- bitwise_uneven_bf16_reshard_2_N4 (N=4, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    uneven layers, bf16, reshard_after_forward=2: torch.equal to torch's every step
- bitwise_mixed_dtypes_in_a_group_N2 (N=2, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    the root's group holds an fp32 parameter and a frozen bf16 one (gathered as bytes): torch.equal to
    torch's every step
- bitwise_no_sync_and_clip_N2 (N=2, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    3 microbatches without sync but the last, then torch's clip_grad_norm_: losses, total norms and
    shards torch.equal to torch's
- bitwise_no_sync_bf16_N4 (N=4, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    bf16 compute, fp32 reduce, 3 microbatches without sync but the last: torch.equal to torch's
- bitwise_hsdp_N4 (N=4, zerokit only) <- issue 45 (bitwise beside torch's fully_shard)
    HSDP on a (2, 2) mesh: torch.equal to torch's every step
- dcp_saved_by_torch_loaded_by_zerokit (N=2, zerokit only) <- issue 45 (DCP both ways)
    a model and AdamW checkpoint written by dcp.save from torch's fully_shard, read by dcp.load into
    zerokit's: the same shards, and 3 more steps bit for bit alike
- dcp_saved_by_zerokit_loaded_by_torch (N=2, zerokit only) <- issue 45 (DCP both ways)
    a model and AdamW checkpoint written by dcp.save from zerokit's fully_shard, read by dcp.load into
    torch's: the same shards, and 3 more steps bit for bit alike
"""

import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp2_scenarios import Api, Outcomes, Scenarios, Transformer, tokens

SC = Scenarios()
ISSUE = "issue 45 (bitwise beside torch's fully_shard)"


class Uneven(nn.Module):
    """Layers of uneven shapes ((7, 15), (15, 3), (3, 16), (16, 17), as FSDP2's tests use) and a
    parameter of the root's own; mixed: beside it, in the root's group, a frozen bf16 parameter (two
    dtypes in one all-gather, which FSDP2 sends as bytes)."""

    def __init__(self, mixed=False):
        super().__init__()
        self.inp, self.mid = nn.Linear(7, 15), nn.Linear(15, 3)
        self.up, self.out = nn.Linear(3, 16), nn.Linear(16, 17)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 17))
        self.offset = nn.Parameter(torch.linspace(-1, 1, 17).bfloat16(), requires_grad=False) if mixed else None

    def forward(self, x):
        h = torch.relu(self.mid(torch.relu(self.inp(x))))
        y = self.out(torch.relu(self.up(h))) * self.scale
        return y if self.offset is None else y + self.offset.float()

    def blocks(self):
        return [self.inp, self.mid, self.up, self.out]


def _model(kind):
    torch.manual_seed(42)
    return Transformer(vocab_size=27, n_layers=2) if kind == "transformer" else Uneven(mixed=kind == "mixed")


def _shard(fully_shard, model, **kw):
    blocks = model.layers if isinstance(model, Transformer) else model.blocks()
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _batch(model, rank, step):
    if isinstance(model, Transformer):
        return tokens(model, 2, seed=1000 * rank + step)
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(1000 * rank + step))


def _policy(precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"fp32": MixedPrecisionPolicy(),
            "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "bf16_reduce_bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}[precision]


def bitwise_training(s, kind, precision, reshard_after_forward=None, hsdp=False, microbatches=1, clip=None,
                     steps=3):
    from torch.distributed.device_mesh import init_device_mesh

    torch_api = Api("torch")
    mesh = (init_device_mesh("cpu", (2, s.world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp
            else init_device_mesh("cpu", (s.world_size,)))
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=_policy(precision))
    models = {"torch": _shard(torch_api.fully_shard, _model(kind), **kw),
              "zerokit": _shard(s.fully_shard, _model(kind), **kw)}
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for k, m in models.items()}
    for step in range(steps):
        losses, norms = {}, {}
        for name, model in models.items():
            total = []
            for mb in range(microbatches):
                if microbatches > 1:
                    model.set_requires_gradient_sync(mb == microbatches - 1)
                out = model(_batch(model, s.rank, microbatches * step + mb))
                loss = out.float().pow(2).mean()
                loss.backward()
                total.append(loss.detach())
            losses[name] = torch.stack(total)
            if clip is not None:
                norms[name] = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor()
        s.check.equal(losses["zerokit"], losses["torch"], f"step {step}: losses")
        if clip is not None:
            s.check.equal(norms["zerokit"], norms["torch"], f"step {step}: clip_grad_norm_'s total norm")
        for (pname, p), (_, q) in zip(models["torch"].named_parameters(), models["zerokit"].named_parameters()):
            if p.grad is None or q.grad is None:  # a frozen parameter: no gradient on either
                s.check.true(p.grad is None and q.grad is None, f"step {step}: {pname} has a gradient on one only")
                continue
            s.check.equal(q.grad.to_local(), p.grad.to_local(), f"step {step}: {pname} gradient shard")
        for o in optims.values():
            o.step()
            o.zero_grad()
        for (pname, p), (_, q) in zip(models["torch"].named_parameters(), models["zerokit"].named_parameters()):
            s.check.equal(q.to_local(), p.to_local(), f"step {step}: {pname} shard")
    for (pname, p), (_, q) in zip(models["torch"].named_parameters(), models["zerokit"].named_parameters()):
        s.check.equal(q.full_tensor(), p.full_tensor(), f"final {pname}")


for n in (2, 4):
    for precision in ("fp32", "bf16", "bf16_reduce_bf16"):
        SC.add(f"bitwise_transformer_{precision}_N{n}", n, ISSUE,
               f"Transformer, {precision.replace('_', ' ')}, 3 AdamW steps: losses, gradient shards, shards and final "
               "full parameters torch.equal to torch's fully_shard", bitwise_training, systems=("zerokit",),
               kind="transformer", precision=precision)
    SC.add(f"bitwise_uneven_fp32_reshard_False_N{n}", n, ISSUE,
           "uneven layers and a root parameter, reshard_after_forward=False: torch.equal to torch's every step",
           bitwise_training, systems=("zerokit",), kind="uneven", precision="fp32", reshard_after_forward=False)
SC.add("bitwise_uneven_bf16_reshard_2_N4", 4, ISSUE, "uneven layers, bf16, reshard_after_forward=2: torch.equal to "
       "torch's every step", bitwise_training, systems=("zerokit",), kind="uneven", precision="bf16",
       reshard_after_forward=2)
SC.add("bitwise_mixed_dtypes_in_a_group_N2", 2, ISSUE, "the root's group holds an fp32 parameter and a frozen bf16 "
       "one (gathered as bytes): torch.equal to torch's every step", bitwise_training, systems=("zerokit",),
       kind="mixed", precision="fp32")
SC.add("bitwise_no_sync_and_clip_N2", 2, ISSUE, "3 microbatches without sync but the last, then torch's "
       "clip_grad_norm_: losses, total norms and shards torch.equal to torch's", bitwise_training,
       systems=("zerokit",), kind="transformer", precision="fp32", microbatches=3, clip=0.5)
SC.add("bitwise_no_sync_bf16_N4", 4, ISSUE, "bf16 compute, fp32 reduce, 3 microbatches without sync but the last: "
       "torch.equal to torch's", bitwise_training, systems=("zerokit",), kind="transformer", precision="bf16",
       microbatches=3)
SC.add("bitwise_hsdp_N4", 4, ISSUE, "HSDP on a (2, 2) mesh: torch.equal to torch's every step", bitwise_training,
       systems=("zerokit",), kind="transformer", precision="fp32", hsdp=True)


def dcp_across_systems(s, saver):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    apis = {"torch": Api("torch"), "zerokit": s.api}
    loader = "zerokit" if saver == "torch" else "torch"

    def train(model, optim, steps):
        losses = []
        for step in steps:
            loss = model(_batch(model, s.rank, step)).float().pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        return torch.stack(losses)

    saved = _shard(apis[saver].fully_shard, _model("transformer"))
    saved_optim = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    train(saved, saved_optim, range(3))
    path = [tempfile.mkdtemp(prefix="fsdp2-cross-") if s.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        dcp.save({"model": get_model_state_dict(saved), "optim": get_optimizer_state_dict(saved, saved_optim)},
                 checkpoint_id=path[0])
        torch.manual_seed(7)  # other initial values, so that a load that did nothing shows
        loaded = _shard(apis[loader].fully_shard, Transformer(vocab_size=27, n_layers=2))
        loaded_optim = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
        state = {"model": get_model_state_dict(loaded), "optim": get_optimizer_state_dict(loaded, loaded_optim)}
        dcp.load(state, checkpoint_id=path[0])
        set_model_state_dict(loaded, state["model"])
        set_optimizer_state_dict(loaded, loaded_optim, state["optim"])
    finally:
        dist.barrier()
        if s.rank == 0:
            shutil.rmtree(path[0], ignore_errors=True)
    for (name, p), (_, q) in zip(saved.named_parameters(), loaded.named_parameters()):
        s.check.equal(q.to_local(), p.to_local(), f"{name} shard after the load")
    s.check.equal(train(loaded, loaded_optim, range(3, 6)), train(saved, saved_optim, range(3, 6)),
                  "3 more steps' losses (the optimizer state came across too)")
    for (name, p), (_, q) in zip(saved.named_parameters(), loaded.named_parameters()):
        s.check.equal(q.full_tensor(), p.full_tensor(), f"{name} after 3 more steps")


for saver in ("torch", "zerokit"):
    loader = "zerokit" if saver == "torch" else "torch"
    SC.add(f"dcp_saved_by_{saver}_loaded_by_{loader}", 2, "issue 45 (DCP both ways)",
           f"a model and AdamW checkpoint written by dcp.save from {saver}'s fully_shard, read by dcp.load into "
           f"{loader}'s: the same shards, and 3 more steps bit for bit alike", dcp_across_systems,
           systems=("zerokit",), saver=saver)


OUT = Outcomes(SC, timeout=240)


def test_the_docstring_table_lists_every_scenario():
    assert SC.missing_from(__doc__) == []


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("system,name,world_size", SC.cases())
def test_scenario(system, name, world_size):
    failures = OUT.failures(system, name, world_size)
    assert failures is None, failures
