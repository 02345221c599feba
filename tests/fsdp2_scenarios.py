"""The machinery of the FSDP2 acceptance suite (tests/test_fsdp2_*.py).

PyTorch's own FSDP2 behaviour tests (test/distributed/_composable/fsdp/ in pytorch/pytorch),
rewritten as scenarios that run on CPU gloo against two systems with the same bodies, the same
assertions and the same tolerances:

    "torch"    torch.distributed.fsdp: fully_shard, FSDPModule, register_fsdp_forward_method
    "zerokit"  the same three names from zerokit (issue 45: FSDP2's design, rebuilt)

A scenario is a function `body(s, **params)` registered in a topic module's `Scenarios` table
with its world size, the torch test it comes from and what it asserts. `s` (a `Run`) hands the
body the system's API (`s.fully_shard`, `s.FSDPModule`, `s.register_fsdp_forward_method`), the
rank, the world size, and `s.check`, which records a failed assertion and lets the body go on:
every rank then takes the same path through the same collectives, so one rank's failed
comparison cannot leave the others waiting in a collective it never joins. Exceptions still
end a scenario (recorded with their traceback); a collective left unmatched then hangs the
launch, which fails by its timeout instead of hanging CI.

One launch per (topic, world size, system) runs every scenario of that topic in turn inside the
ranks (`run_scenarios`), resets the random seeds before and waits on a barrier after each, and
hands back per scenario and rank the failures (None when it passed) and its seconds. The topic
module's parametrized tests each assert one scenario's outcome from that cached launch
(`Outcomes`).

Only public API is used on either system. Where PyTorch's test reads FSDP2's internals, the
same fact is read publicly:
- sharded-ness: `isinstance(p, DTensor)`, `p.placements`, `p.device_mesh`, `p.to_local()`;
- the shard layout: `p.to_local()` against `torch.chunk(full, N, dim=0)[coordinate]` (FSDP2's
  dim-0 chunking; a rank past the last chunk holds an empty (0, ...) shard);
- collectives: counts from `torch.distributed.tensor.debug.CommDebugMode` (the c10d ops both
  systems reach: `_allgather_base_`, `_reduce_scatter_base_`, `allreduce_`), and their order,
  sizes, dtypes and group sizes from `CommSpy`, which wraps torch.distributed's
  all_gather_into_tensor / all_gather_single / reduce_scatter_tensor / reduce_scatter_single /
  all_reduce while a block runs;
- which FSDP module an all-gather or reduce-scatter belongs to: its size, N times the sum of
  that module's padded dim-0 shards (`comm_names`), checked to be unique in the model.
"""

import dataclasses
import inspect
import math
import time
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SYSTEMS = ("torch", "zerokit")
MAX_FAILURES = 6  # recorded per scenario and rank (the first ones say what went wrong)
# Training loops run 3 iterations where PyTorch's run 10 (the suite's time budget: FSDP2's hooks cost
# ~0.1 s per step of a small model on a loaded 2-core CPU); zero_grad's set_to_none still alternates,
# and every iteration's loss and shards are compared with the same tolerances.
ITERATIONS = 3


# ---- the systems


class Api:
    """fully_shard, FSDPModule and register_fsdp_forward_method of one system, looked up when used
    (a system that lacks a name fails the scenarios that use it, not the launch)."""

    def __init__(self, system):
        if system == "torch":
            import torch.distributed.fsdp as module
        elif system == "zerokit":
            import zerokit as module
        else:
            raise ValueError(f"unknown system {system!r}")
        self.system, self._module = system, module

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._module, name)


# ---- assertions that record and go on


class Checks:
    """Failed assertions of one scenario on one rank (the body keeps going after one)."""

    def __init__(self):
        self.failures = []
        self.count = 0  # assertions made: a scenario that asserted nothing fails

    def _record(self, ok, msg):
        self.count += 1
        if not ok and len(self.failures) < MAX_FAILURES:
            self.failures.append(str(msg))
        return ok

    def fail(self, msg):
        return self._record(False, msg)

    def true(self, cond, msg):
        return self._record(bool(cond), msg)

    def equal(self, a, b, msg):
        """a == b; tensors bit for bit (torch.equal, and the same dtype)."""
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            ok = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                  and torch.equal(a, b))
            return self._record(ok, f"{msg}: {_tensor_apart(a, b)}")
        return self._record(a == b, f"{msg}: {a!r} != {b!r}")

    def close(self, a, b, msg, **tolerance):
        """torch.testing.assert_close(a, b): by default the tolerances of PyTorch's own tests
        (TestCase.assertEqual: rtol 1.3e-6 / atol 1e-5 in fp32, 1.6e-2 / 1e-5 in bf16)."""
        try:
            torch.testing.assert_close(a, b, **tolerance)
        except AssertionError as exc:  # recorded as this scenario's failure, not passed over
            return self._record(False, f"{msg}: {str(exc).strip()[:400]}")
        return self._record(True, msg)

    def raises(self, exc_type, fn, msg, match=None):
        """fn() raises exc_type (a class or a tuple of them; with `match` in its message, when given)."""
        want = "/".join(t.__name__ for t in (exc_type if isinstance(exc_type, tuple) else (exc_type,)))
        try:
            fn()
        except exc_type as exc:
            return self._record(match is None or match in str(exc), f"{msg}: {want} without {match!r}: {exc}")
        except Exception as exc:  # another error is this check's failure, with its text
            return self._record(False, f"{msg}: raised {type(exc).__name__}: {exc} instead of {want}")
        return self._record(False, f"{msg}: raised nothing (expected {want})")


def _tensor_apart(a, b):
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return f"{type(a).__name__} vs {type(b).__name__}"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if a.numel() == 0:
        return "equal"
    return f"max |a - b| = {(a.double() - b.double()).abs().max().item():.3e}"


# ---- one scenario's view of its run


class Run:
    """What a scenario body gets: the system's API, its rank and world size, its checks."""

    def __init__(self, system, rank, world_size, check):
        self.system, self.rank, self.world_size, self.check = system, rank, world_size, check
        self.api = Api(system)

    @property
    def fully_shard(self):
        return self.api.fully_shard

    @property
    def FSDPModule(self):  # noqa: N802 (the class's own name)
        return self.api.FSDPModule

    @property
    def register_fsdp_forward_method(self):
        return self.api.register_fsdp_forward_method


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    world_size: int
    source: str  # the PyTorch test it ports (file::Class.test, or "derived from" one)
    asserts: str  # what it asserts, in a line
    body: object
    params: tuple = ()  # (key, value) pairs passed to body as keyword arguments
    systems: tuple = SYSTEMS  # the parity scenarios run only for zerokit (beside torch's)


class Scenarios:
    """A topic module's table of scenarios, in the order they run."""

    def __init__(self):
        self.items = []

    def add(self, name, world_size, source, asserts, body, systems=SYSTEMS, **params):
        if any(s.name == name for s in self.items):
            raise ValueError(f"two scenarios named {name!r}")
        self.items.append(Scenario(name, world_size, source, asserts, body, tuple(params.items()), tuple(systems)))

    def register(self, name, world_size, source, asserts, systems=SYSTEMS, **params):
        def decorate(body):
            self.add(name, world_size, source, asserts, body, systems, **params)
            return body
        return decorate

    def at(self, world_size, system):
        return [s for s in self.items if s.world_size == world_size and system in s.systems]

    def world_sizes(self):
        return sorted({s.world_size for s in self.items})

    def cases(self):
        """(system, name, world size) for pytest's parametrize, with readable ids."""
        import pytest

        return [pytest.param(system, s.name, s.world_size, id=f"{system}-N{s.world_size}-{s.name}")
                for s in self.items for system in s.systems]

    def table(self):
        """The scenario table of the topic module's docstring: per scenario its name, world size, the
        PyTorch test it ports, and what it asserts (wrapped)."""
        import textwrap

        rows = []
        for s in self.items:
            only = "" if s.systems == SYSTEMS else f", {'/'.join(s.systems)} only"
            rows.append(f"- {s.name} (N={s.world_size}{only}) <- {s.source}\n"
                        + textwrap.fill(s.asserts, 104, initial_indent="    ", subsequent_indent="    ",
                                          break_on_hyphens=False))
        return "\n".join(rows)

    def missing_from(self, doc):
        """The scenarios whose table row (as table() writes it) the docstring lacks or states otherwise."""
        flat = " ".join(doc.split())
        rows = [row if row.startswith("- ") else "- " + row for row in self.table().split("\n- ")]
        return [row[2:].split(" (N=")[0] for row in rows if " ".join(row.split()) not in flat]


def run_scenarios(rank, world_size, system, scenarios):
    """Inside each rank: every scenario in turn; {name: (failures or None, seconds, CPU seconds)}."""
    torch.set_num_threads(1)
    out = {}
    for sc in scenarios:
        check = Checks()
        start, cpu = time.perf_counter(), time.process_time()
        torch.manual_seed(0)
        try:
            sc.body(Run(system, rank, world_size, check), **dict(sc.params))
            failures = check.failures or (None if check.count else ["the scenario asserted nothing"])
        except Exception:  # the scenario's outcome: its traceback, with the checks failed before it
            failures = check.failures + [traceback.format_exc(limit=-14)[-4000:]]
        out[sc.name] = (failures, time.perf_counter() - start, time.process_time() - cpu)
        dist.barrier()
    return out


class Outcomes:
    """One cached launch per (world size, system) of a topic's scenarios; each test reads one."""

    def __init__(self, scenarios, timeout):
        self.scenarios, self.timeout = scenarios, timeout
        self._cache = {}

    def launch(self, system, world_size):
        key = (system, world_size)
        if key not in self._cache:
            todo = self.scenarios.at(world_size, system)
            from conftest import run_ranks  # here, not at import: the ranks import the topic modules, not pytest's

            try:
                self._cache[key] = ("ok", run_ranks(run_scenarios, world_size, system, todo, timeout=self.timeout))
            except Exception as exc:  # a launch that failed (a timeout) fails each of its tests with its reason
                self._cache[key] = ("launch failed", f"{type(exc).__name__}: {exc}")
        return self._cache[key]

    def failures(self, system, name, world_size):
        """None if every rank passed the scenario, else the first failing rank's failures."""
        status, value = self.launch(system, world_size)
        if status != "ok":
            return f"the launch of N={world_size} ({system}) failed: {value}"
        for rank, per_rank in enumerate(value):
            failures = per_rank[name][0]
            if failures:
                return f"rank {rank}:\n" + "\n".join(failures)
        return None


# ---- sharded parity against a replicated reference (PyTorch's check_sharded_parity, publicly)


def expected_local(full, dtensor_like):
    """This rank's shard of `full` under dtensor_like's mesh and placements, cut by torch.chunk
    (FSDP2's layout: a rank past the last chunk holds an empty (0, ...) shard)."""
    from torch.distributed.tensor import Shard

    mesh, t = dtensor_like.device_mesh, full
    for mesh_dim, placement in enumerate(dtensor_like.placements):
        if isinstance(placement, Shard):
            n, i = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
            chunks = torch.chunk(t, n, dim=placement.dim)
            t = chunks[i] if i < len(chunks) else t.narrow(placement.dim, 0, 0)
    return t


def sharded_parity(s, ref_module, model, what="", **tolerance):
    """Each parameter of `model` a DTensor whose local shard (and gradient's) equals the chunk of
    the replicated reference's (PyTorch's check_sharded_parity, with its default tolerances)."""
    from torch.distributed.tensor import DTensor

    ref_named, named = list(ref_module.named_parameters()), list(model.named_parameters())
    s.check.equal([n for n, _ in named], [n for n, _ in ref_named], f"{what} parameter names")
    for (name, ref), (_, p) in zip(ref_named, named):
        if not isinstance(p, DTensor):
            s.check.fail(f"{what} {name} is a {type(p).__name__}, not a DTensor")
            continue
        s.check.close(p.to_local(), expected_local(ref.detach(), p), f"{what} {name} shard", **tolerance)
        if ref.grad is None:
            s.check.true(p.grad is None, f"{what} {name}: a gradient where the reference has none")
            continue
        if not isinstance(p.grad, DTensor):
            s.check.fail(f"{what} {name}.grad is {type(p.grad).__name__}, not a DTensor")
            continue
        s.check.close(p.grad.to_local(), expected_local(ref.grad, p), f"{what} {name} gradient shard", **tolerance)


def all_reduce_grads(module, group=None, size=None):
    """The data-parallel mean of the gradients (SUM, then divide: gloo has no AVG)."""
    size = size or dist.get_world_size(group)
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(size)


def ddp(module, **kwargs):
    """torch's DistributedDataParallel on CPU gloo: the data-parallel reference."""
    return nn.parallel.DistributedDataParallel(module, **kwargs)


def broadcast_module(module):
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t, src=0)


def is_dtensor(t):
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# ---- collectives: counts (CommDebugMode) and a spy on torch.distributed's calls


def comm_counts(comm_mode):
    """{"all_gather", "reduce_scatter", "all_reduce"} counts of a CommDebugMode (the c10d ops)."""
    c10d = torch.ops.c10d
    counts = comm_mode.get_comm_counts()
    return {"all_gather": counts.get(c10d._allgather_base_, 0),
            "reduce_scatter": counts.get(c10d._reduce_scatter_base_, 0),
            "all_reduce": counts.get(c10d.allreduce_, 0),
            "kinds": len(counts)}


class CommSpy:
    """While active, records each torch.distributed all-gather / reduce-scatter / all-reduce call:
    SimpleNamespace(kind "AG" / "RS" / "AR", numel (AG: output, RS: input), dtype, group_size, name)."""

    FUNCTIONS = {"all_gather_into_tensor": "AG", "all_gather_single": "AG",
                 "reduce_scatter_tensor": "RS", "reduce_scatter_single": "RS", "all_reduce": "AR"}

    def __init__(self, names=None):
        self.events, self.names = [], names or {}
        self._saved = {}

    def __enter__(self):
        for fname, kind in self.FUNCTIONS.items():
            orig = getattr(dist, fname)
            self._saved[fname] = orig
            setattr(dist, fname, self._wrap(orig, kind))
        return self

    def __exit__(self, *exc):
        for fname, orig in self._saved.items():
            setattr(dist, fname, orig)
        self._saved.clear()

    def _wrap(self, orig, kind):
        signature = inspect.signature(orig)

        def spy(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            values = list(bound.values())
            if kind == "AG":
                tensor, dtype_of = values[0], values[1]
            elif kind == "RS":
                tensor, dtype_of = values[1], values[1]
            else:
                tensor, dtype_of = values[0], values[0]
            group = bound.get("group")
            self.events.append(SimpleNamespace(
                kind=kind, numel=tensor.numel(), dtype=dtype_of.dtype, out_dtype=values[0].dtype,
                out_numel=values[0].numel(), group_size=dist.get_world_size(group),
                name=self.names.get((kind if kind != "AR" else "RS", tensor.numel()), f"?{tensor.numel()}")))
            return orig(*args, **kwargs)

        return spy

    def mark(self, label):
        """A point in the log between collectives (e.g. a tensor hook firing)."""
        self.events.append(SimpleNamespace(kind="MARK", name=label, numel=0))

    def of(self, kind):
        return [e for e in self.events if e.kind == kind]

    def sequence(self, kinds=("AG", "RS")):
        return [(e.kind, e.name) for e in self.events if e.kind in kinds]


def comm_names(s, model, names):
    """{(kind, numel): module name} for the all-gathers and reduce-scatters of each FSDP module of
    `model` ({module: name}): N times the sum of its parameters' padded dim-0 shards, over the
    parameters it manages (its own, not those of an FSDP module inside it). Checks the sizes are
    unique, else the events could not be told apart."""
    fsdp = [m for m in model.modules() if isinstance(m, s.FSDPModule)]
    table, owners = {}, 0
    for m in fsdp:
        inner = {id(p) for c in m.modules() if c is not m and isinstance(c, s.FSDPModule) for p in c.parameters()}
        managed = {id(p): p for p in m.parameters() if id(p) not in inner}
        n = s.world_size
        numel = sum(math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]) * n for p in managed.values())
        if numel:
            table[numel] = names[m]
            owners += 1
    s.check.true(len(table) == owners, f"the modules' all-gather sizes are not unique: {table}")
    return {**{("AG", k): v for k, v in table.items()}, **{("RS", k): v for k, v in table.items()}}


# ---- models (small, as PyTorch's tests use; sizes chosen odd where padding matters)


class MLP(nn.Module):
    """PyTorch's common_fsdp.MLP: in_proj (dim -> mult * dim), relu, out_proj, relu, + buffer."""

    def __init__(self, dim, *, bias=True, with_buffer=False, dim_multiplier=4):
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,)))
        else:
            self.buffer = None

    def forward(self, x):
        z = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        if self.buffer is not None:
            z = z + self.buffer
        return z

    def reset_parameters(self):
        if self.buffer is not None:
            torch.nn.init.normal_(self.buffer)


class DoubleLinear(nn.Module):
    """PyTorch's DoubleLinear: two linears on the same input; both outputs, or the first only.
    `out2` lets the second differ in size (the comm tests tell modules apart by size)."""

    def __init__(self, dim, use_second_linear=True, out1=None, out2=None):
        super().__init__()
        self.lin1 = nn.Linear(dim, out1 or dim)
        self.lin2 = nn.Linear(dim, out2 or dim)
        self.use_second_linear = use_second_linear

    def forward(self, x):
        if self.use_second_linear:
            return F.relu(self.lin1(x)), F.relu(self.lin2(x))
        return F.relu(self.lin1(x))


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim, n_heads, hidden):
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(dim), Attention(dim, n_heads)
        self.ffn_norm, self.feed_forward = nn.LayerNorm(dim), FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A small decoder (PyTorch's common_dtensor.Transformer in miniature): token and position
    embeddings, blocks (attention, feed-forward), a final norm and an output projection, the
    output optionally tied to the token embedding. `hidden` per block may differ (comm tests)."""

    def __init__(self, vocab_size=24, dim=16, n_layers=3, n_heads=2, max_seq_len=8, weight_tying=False,
                 hidden=None):
        super().__init__()
        hidden = hidden or [4 * dim] * n_layers
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, h) for h in hidden)
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        if weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tokens(model, batch=2, seq=None, seed=None):
    g = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randint(0, model.vocab_size, (batch, seq or model.max_seq_len), generator=g)


def shard_blocks(s, model, **kwargs):
    """fully_shard on each Transformer block, then on the root (FSDP2's calling pattern)."""
    for layer in model.layers:
        s.fully_shard(layer, **kwargs)
    s.fully_shard(model, **kwargs)
    return model


def train_parity(s, ref, ref_optim, model, optim, inputs, *, iterations=ITERATIONS, loss=lambda out: out.sum(),
                 what="", parity=False):
    """PyTorch's train-parity loop: per iteration zero_grad (set_to_none alternating), forward,
    backward, step on both; the losses equal (assertEqual's tolerances) every iteration."""
    for it in range(iterations):
        inp = inputs(it)
        losses = []
        for m, o in ((ref, ref_optim), (model, optim)):
            o.zero_grad(set_to_none=it % 2 == 0)
            losses.append(loss(m(inp)))
            losses[-1].backward()
            o.step()
        s.check.close(losses[1], losses[0], f"{what} loss at iteration {it}")
    return losses


__all__ = ["SYSTEMS", "Api", "Checks", "Run", "Scenario", "Scenarios", "run_scenarios", "Outcomes", "expected_local",
           "sharded_parity", "all_reduce_grads", "ddp", "broadcast_module", "is_dtensor",
           "comm_counts", "CommSpy", "comm_names", "MLP", "DoubleLinear", "Transformer", "Block", "FeedForward",
           "tokens", "shard_blocks", "train_parity", "ITERATIONS"]
