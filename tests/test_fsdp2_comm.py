"""FSDP2's collectives: how many, in which order, on which groups (PyTorch's test_fully_shard_comm.py),
on `torch` and `zerokit` alike (tests/fsdp2_scenarios.py: one launch per world size and system,
checks that record and go on, public API only).

PyTorch's tests count collectives with CommDebugMode (kept: the c10d ops `_allgather_base_` and
`_reduce_scatter_base_` both systems reach) and record the order of FSDPParamGroup.unshard /
post_backward / reshard by patching those private methods. Here the order is read from the
collectives themselves: a CommSpy on torch.distributed's all-gather and reduce-scatter calls, each
named by its size (N times the sum of its module's padded dim-0 shards; the blocks' feed-forward
widths differ so that the sizes are unique, checked). An unshard that really communicates is an
all-gather; a post-backward that reduces is a reduce-scatter (a post-backward with no gradient,
which PyTorch's list shows, reduces nothing and is absent here). Reshard events have no collective;
where PyTorch's forward-prefetch test reads them, the prefetch is read instead from where each
all-gather falls against the blocks' forwards (a forward pre-hook on each block's attention marks
the log). The checkpointed (AC) variants and the grouped multi-module prefetch are left out, as are
the tests of FSDP2's internal collective functions (foreach_all_gather / foreach_reduce,
chunk_cat kernels), set_reduce_scatter_divide_factor / max_input_buffers (not in the contract).

Scenarios (name, world size N, <- the PyTorch test it ports; then what it asserts):

- communication_count_reshard_True (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_fully_shard_communication_count
    one all-gather per FSDP module in forward; in backward one per resharded module (None: not the root,
    False: none) and one reduce-scatter per module (CommDebugMode)
- communication_count_reshard_False (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_fully_shard_communication_count
    one all-gather per FSDP module in forward; in backward one per resharded module (None: not the root,
    False: none) and one reduce-scatter per module (CommDebugMode)
- communication_count_reshard_2 (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_fully_shard_communication_count
    one all-gather per FSDP module in forward; in backward one per resharded module (None: not the root,
    False: none) and one reduce-scatter per module (CommDebugMode)
- communication_count_reshard_None (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_fully_shard_communication_count
    one all-gather per FSDP module in forward; in backward one per resharded module (None: not the root,
    False: none) and one reduce-scatter per module (CommDebugMode)
- manual_reshard_with_reshard_after_forward_false (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_manual_reshard_with_reshard_after_forward_false
    reshard_after_forward=False, then reshard() on every FSDP module before backward: backward
    all-gathers each module again and reduce-scatters each once
- set_reshard_after_forward_True_recurse_True (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_set_reshard_after_forward
    set_reshard_after_forward at runtime (opposite to the constructor's value; recurse=False: the root
    only) gives the all-gather counts of that setting
- set_reshard_after_forward_True_recurse_False (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_set_reshard_after_forward
    set_reshard_after_forward at runtime (opposite to the constructor's value; recurse=False: the root
    only) gives the all-gather counts of that setting
- set_reshard_after_forward_False_recurse_True (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_set_reshard_after_forward
    set_reshard_after_forward at runtime (opposite to the constructor's value; recurse=False: the root
    only) gives the all-gather counts of that setting
- set_reshard_after_forward_False_recurse_False (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_set_reshard_after_forward
    set_reshard_after_forward at runtime (opposite to the constructor's value; recurse=False: the root
    only) gives the all-gather counts of that setting
- set_reshard_after_forward_None_recurse_True (N=2) <- test_fully_shard_comm.py::TestFullyShardCommunication.test_set_reshard_after_forward
    set_reshard_after_forward at runtime (opposite to the constructor's value; recurse=False: the root
    only) gives the all-gather counts of that setting
- backward_prefetch_reshard_True (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_fully_shard_backward_prefetch (forward_backward)
    all-gathers and reduce-scatters in PyTorch's event order: forward root, blocks 0-2; backward (root
    if resharded), block i-1 gathered before block i reduces
- backward_prefetch_reshard_False (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_fully_shard_backward_prefetch (forward_backward)
    all-gathers and reduce-scatters in PyTorch's event order: forward root, blocks 0-2; backward (root
    if resharded), block i-1 gathered before block i reduces
- backward_prefetch_reshard_2 (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_fully_shard_backward_prefetch (forward_backward)
    all-gathers and reduce-scatters in PyTorch's event order: forward root, blocks 0-2; backward (root
    if resharded), block i-1 gathered before block i reduces
- backward_prefetch_reshard_None (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_fully_shard_backward_prefetch (forward_backward)
    all-gathers and reduce-scatters in PyTorch's event order: forward root, blocks 0-2; backward (root
    if resharded), block i-1 gathered before block i reduces
- backward_prefetch_multi_forward_reshard_True (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_fully_shard_backward_prefetch (multi_forward)
    two forwards then one backward: the collectives in PyTorch's event order (each module
    reduce-scattered once, after its last post-backward; the second pass re-gathers)
- backward_prefetch_multi_forward_reshard_False (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_fully_shard_backward_prefetch (multi_forward)
    two forwards then one backward: the collectives in PyTorch's event order (each module
    reduce-scattered once, after its last post-backward; the second pass re-gathers)
- backward_prefetch_unused_in_backward (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_fully_shard_backward_prefetch (unused_in_backward)
    a linear then two heads, backward through one head (set_is_last_backward(False), retain_graph) then
    the other: the mistargeted prefetch of the unused head, then no second all-gather of it
- set_modules_to_forward_prefetch_1 (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_set_modules_to_forward_prefetch
    each block prefetches the next 1 in forward: their all-gathers precede the block's own computation;
    backward keeps the default order
- set_modules_to_forward_prefetch_2 (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_set_modules_to_forward_prefetch
    each block prefetches the next 2 in forward: their all-gathers precede the block's own computation;
    backward keeps the default order
- set_modules_to_backward_prefetch_1 (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_set_modules_to_backward_prefetch
    each block prefetches the previous 1 in backward: all-gathers and reduce-scatters in PyTorch's event
    order
- set_modules_to_backward_prefetch_2 (N=2) <- test_fully_shard_comm.py::TestFullyShardPrefetch.test_set_modules_to_backward_prefetch
    each block prefetches the previous 2 in backward: all-gathers and reduce-scatters in PyTorch's event
    order
- reshard_after_forward_int_groups (N=4) <- derived from test_fully_shard_comm.py::TestFullyShardCommunication.test_fully_shard_communication_count (reshard_after_forward=2 at N=4)
    reshard_after_forward=2 on 4 ranks (blocks and root): forward all-gathers over 4 ranks, backward
    re-gathers every module over groups of 2 (hpZ), reduce-scatters over all 4
"""

import itertools

import pytest
import torch
from torch import nn

from fsdp2_scenarios import CommSpy, DoubleLinear, Outcomes, Scenarios, Transformer, comm_counts, comm_names, tokens

SC = Scenarios()
SRC = "test_fully_shard_comm.py::"
COMM = SRC + "TestFullyShardCommunication."
PREFETCH = SRC + "TestFullyShardPrefetch."


def _transformer(s, n_layers=3, **shard_kw):
    """A Transformer whose blocks have distinct feed-forward widths (so each block's all-gather has
    its own size), a fully_shard per block and on the root; (model, {module: name})."""
    torch.manual_seed(42)
    model = Transformer(n_layers=n_layers, hidden=[40 + 8 * i for i in range(n_layers)])
    for layer in model.layers:
        s.fully_shard(layer, **shard_kw)
    s.fully_shard(model, **shard_kw)
    names = {m: n for n, m in model.named_modules()}
    return model, names


def _counts(block):
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm_mode:
        out = block()
    return out, comm_counts(comm_mode)


def communication_count(s, reshard_after_forward):
    model, _ = _transformer(s, reshard_after_forward=reshard_after_forward)
    num_blocks = len(model.layers)
    torch.manual_seed(42 + s.rank)
    inp = tokens(model, 2)
    loss, fwd = _counts(lambda: model(inp))
    s.check.equal(fwd["kinds"], 1, "forward: collective kinds")
    s.check.equal(fwd["all_gather"], num_blocks + 1, "forward all-gathers")
    _, bwd = _counts(lambda: loss.sum().backward())
    raf = reshard_after_forward
    if raf is None:  # the root does not reshard after forward
        s.check.equal(bwd["kinds"], 2, "backward: collective kinds")
        s.check.equal(bwd["all_gather"], num_blocks, "backward all-gathers")
    elif raf:
        s.check.equal(bwd["kinds"], 2, "backward: collective kinds")
        s.check.equal(bwd["all_gather"], num_blocks + 1, "backward all-gathers")
    else:
        s.check.equal(bwd["kinds"], 1, "backward: collective kinds (no all-gather)")
    s.check.equal(bwd["reduce_scatter"], num_blocks + 1, "backward reduce-scatters")


for raf in (True, False, 2, None):
    SC.add(f"communication_count_reshard_{raf}", 2, COMM + "test_fully_shard_communication_count",
           "one all-gather per FSDP module in forward; in backward one per resharded module (None: not the root, "
           "False: none) and one reduce-scatter per module (CommDebugMode)", communication_count,
           reshard_after_forward=raf)


@SC.register("manual_reshard_with_reshard_after_forward_false", 2,
             COMM + "test_manual_reshard_with_reshard_after_forward_false",
             "reshard_after_forward=False, then reshard() on every FSDP module before backward: backward "
             "all-gathers each module again and reduce-scatters each once")
def manual_reshard(s):
    model, _ = _transformer(s, reshard_after_forward=False)
    num_fsdp = sum(isinstance(m, s.FSDPModule) for m in model.modules())
    torch.manual_seed(42 + s.rank)
    inp = tokens(model, 2)
    loss, fwd = _counts(lambda: model(inp))
    s.check.equal((fwd["kinds"], fwd["all_gather"]), (1, num_fsdp), "forward: kinds, all-gathers")
    for module in model.modules():
        if isinstance(module, s.FSDPModule):
            module.reshard()
    _, bwd = _counts(lambda: loss.sum().backward())
    s.check.equal((bwd["kinds"], bwd["all_gather"], bwd["reduce_scatter"]), (2, num_fsdp, num_fsdp),
                  "backward: kinds, all-gathers, reduce-scatters")


def set_reshard_after_forward(s, value, recurse):
    kw = {} if value is None else {"reshard_after_forward": not value}
    model, _ = _transformer(s, **kw)
    num_blocks = len(model.layers)
    num_fsdp = sum(isinstance(m, s.FSDPModule) for m in model.modules())
    if value is not None:
        model.set_reshard_after_forward(value, recurse=recurse)
    torch.manual_seed(42 + s.rank)
    inp = tokens(model, 2)
    loss, fwd = _counts(lambda: model(inp))
    s.check.equal((fwd["kinds"], fwd["all_gather"]), (1, num_fsdp), "forward: kinds, all-gathers")
    _, bwd = _counts(lambda: loss.sum().backward())
    if value is None:
        s.check.equal((bwd["kinds"], bwd["all_gather"]), (2, num_blocks), "backward: kinds, all-gathers")
    elif value:
        s.check.equal((bwd["kinds"], bwd["all_gather"]), (2, num_blocks + 1 if recurse else 1),
                      "backward: kinds, all-gathers")
    elif recurse:
        s.check.equal(bwd["kinds"], 1, "backward: kinds (no all-gather)")
    else:
        s.check.equal((bwd["kinds"], bwd["all_gather"]), (2, num_blocks), "backward: kinds, all-gathers")
    s.check.equal(bwd["reduce_scatter"], num_blocks + 1, "backward reduce-scatters")


for value, recurse in itertools.product((True, False, None), (True, False)):
    if value is None and not recurse:
        continue  # nothing is set: the same as (None, recurse=True)
    SC.add(f"set_reshard_after_forward_{value}_recurse_{recurse}", 2, COMM + "test_set_reshard_after_forward",
           "set_reshard_after_forward at runtime (opposite to the constructor's value; recurse=False: the root "
           "only) gives the all-gather counts of that setting", set_reshard_after_forward, value=value,
           recurse=recurse)


def _events(spy):
    return [(e.kind, e.name) for e in spy.events if e.kind in ("AG", "RS", "MARK")]


def backward_prefetch(s, reshard_after_forward):
    model, names = _transformer(s, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    inp = tokens(model, 2, seed=s.rank)
    with CommSpy(comm_names(s, model, names)) as spy:
        for it in range(2):
            spy.events.clear()
            loss = model(inp)
            expected = [("AG", ""), ("AG", "layers.0"), ("AG", "layers.1"), ("AG", "layers.2")]
            s.check.equal(_events(spy), expected, f"iteration {it}: forward")
            spy.events.clear()
            loss.sum().backward()
            expected = [("AG", "")] if reshard_after_forward is not None else []
            expected += [("AG", "layers.2"), ("AG", "layers.1"), ("RS", "layers.2"), ("AG", "layers.0"),
                         ("RS", "layers.1"), ("RS", "layers.0"), ("RS", "")]
            if reshard_after_forward is False:
                expected = [e for e in expected if e[0] != "AG"]
            s.check.equal(_events(spy), expected, f"iteration {it}: backward (each unshard one module early)")
            optim.step()
            optim.zero_grad(set_to_none=it % 2 == 0)


for raf in (True, False, 2, None):
    SC.add(f"backward_prefetch_reshard_{raf}", 2, PREFETCH + "test_fully_shard_backward_prefetch (forward_backward)",
           "all-gathers and reduce-scatters in PyTorch's event order: forward root, blocks 0-2; backward "
           "(root if resharded), block i-1 gathered before block i reduces", backward_prefetch,
           reshard_after_forward=raf)


def backward_prefetch_multi_forward(s, reshard_after_forward):
    model, names = _transformer(s, reshard_after_forward=reshard_after_forward)
    inp = tokens(model, 2, seed=s.rank)
    with CommSpy(comm_names(s, model, names)) as spy:
        loss1, loss2 = model(inp), model(inp)
        expected = [("AG", ""), ("AG", "layers.0"), ("AG", "layers.1"), ("AG", "layers.2")]
        if reshard_after_forward is not None:
            expected.append(("AG", ""))
        expected += [("AG", "layers.0"), ("AG", "layers.1"), ("AG", "layers.2")]
        if reshard_after_forward is False:
            expected = expected[:-4]
        s.check.equal(_events(spy), expected, "two forwards")
        spy.events.clear()
        (loss1 + loss2).sum().backward()
        # PyTorch's events: the first forward's post-backwards of the blocks, then the second's and the
        # root's; the first ones reduce nothing (the accumulated gradient is reduced once, by the last)
        expected = [("AG", "")] if reshard_after_forward is not None else []
        expected += [("AG", "layers.2"), ("AG", "layers.1"), ("AG", "layers.0")]
        if reshard_after_forward is False:
            expected = []
        expected += [("AG", "layers.2"), ("AG", "layers.1"), ("RS", "layers.2"), ("AG", "layers.0"),
                     ("RS", "layers.1"), ("RS", "layers.0"), ("RS", "")]
        s.check.equal(_events(spy), expected, "one backward through both")


for raf in (True, False):
    SC.add(f"backward_prefetch_multi_forward_reshard_{raf}", 2,
           PREFETCH + "test_fully_shard_backward_prefetch (multi_forward)",
           "two forwards then one backward: the collectives in PyTorch's event order (each module reduce-scattered "
           "once, after its last post-backward; the second pass re-gathers)", backward_prefetch_multi_forward, reshard_after_forward=raf)


@SC.register("backward_prefetch_unused_in_backward", 2,
             PREFETCH + "test_fully_shard_backward_prefetch (unused_in_backward)",
             "a linear then two heads, backward through one head (set_is_last_backward(False), retain_graph) then "
             "the other: the mistargeted prefetch of the unused head, then no second all-gather of it")
def backward_prefetch_unused_in_backward(s):
    dim = 8
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(dim, dim), DoubleLinear(dim, out1=dim + 1, out2=dim + 3))
    for module in (model[0], model[1].lin1, model[1].lin2, model):
        s.fully_shard(module, reshard_after_forward=True)
    names = {m: n for n, m in model.named_modules()}
    inp = torch.randn((4, dim))
    with CommSpy(comm_names(s, model, names)) as spy:
        loss1, loss2 = model(inp)
        s.check.equal(_events(spy), [("AG", "0"), ("AG", "1.lin1"), ("AG", "1.lin2")], "forward (the root has no "
                      "parameters, so no all-gather)")
        spy.events.clear()
        model.set_is_last_backward(False)
        loss2.sum().backward(retain_graph=True)
        s.check.equal(_events(spy), [("AG", "1.lin2"), ("AG", "1.lin1"), ("RS", "1.lin2"), ("AG", "0"), ("RS", "0")],
                      "first backward (1.lin1 prefetched though unused)")
        spy.events.clear()
        model.set_is_last_backward(True)
        loss1.sum().backward()
        s.check.equal(_events(spy), [("AG", "0"), ("RS", "1.lin1"), ("RS", "0")],
                      "second backward (1.lin1 still unsharded from the prefetch)")


def set_modules_to_forward_prefetch(s, num_to_prefetch):
    model, names = _transformer(s, n_layers=4, reshard_after_forward=True)
    inp = tokens(model, 2, seed=s.rank)
    for i, layer in enumerate(model.layers):
        if i < len(model.layers) - num_to_prefetch:
            layer.set_modules_to_forward_prefetch([model.layers[i + j] for j in range(1, num_to_prefetch + 1)])
    with CommSpy(comm_names(s, model, names)) as spy:
        for i, layer in enumerate(model.layers):  # marks where each block's computation starts
            layer.attention.register_forward_pre_hook(lambda m, args, i=i: spy.mark(f"layers.{i}"))
        loss = model(inp)
        log = _events(spy)
        ag = lambda i: ("AG", f"layers.{i}")  # noqa: E731
        fwd = lambda i: ("MARK", f"layers.{i}")  # noqa: E731
        if num_to_prefetch == 1:
            expected = [("AG", ""), ag(0), ag(1), fwd(0), ag(2), fwd(1), ag(3), fwd(2), fwd(3)]
        else:
            expected = [("AG", ""), ag(0), ag(1), ag(2), fwd(0), ag(3), fwd(1), fwd(2), fwd(3)]
        s.check.equal(log, expected, f"forward with {num_to_prefetch} prefetched (block i+1.. gathered before "
                      "block i computes)")
        spy.events.clear()
        loss.sum().backward()
        expected = [("AG", ""), ("AG", "layers.3"), ("AG", "layers.2"), ("RS", "layers.3"), ("AG", "layers.1"),
                    ("RS", "layers.2"), ("AG", "layers.0"), ("RS", "layers.1"), ("RS", "layers.0"), ("RS", "")]
        s.check.equal([e for e in _events(spy) if e[0] != "MARK"], expected, "backward (default prefetching)")


for n in (1, 2):
    SC.add(f"set_modules_to_forward_prefetch_{n}", 2, PREFETCH + "test_set_modules_to_forward_prefetch",
           f"each block prefetches the next {n} in forward: their all-gathers precede the block's own computation; "
           "backward keeps the default order", set_modules_to_forward_prefetch, num_to_prefetch=n)


def set_modules_to_backward_prefetch(s, num_to_prefetch):
    model, names = _transformer(s, n_layers=4, reshard_after_forward=True)
    inp = tokens(model, 2, seed=s.rank)
    for i, layer in enumerate(model.layers):
        if i >= num_to_prefetch:
            layer.set_modules_to_backward_prefetch([model.layers[i - j] for j in range(1, num_to_prefetch + 1)])
    with CommSpy(comm_names(s, model, names)) as spy:
        loss = model(inp)
        expected = [("AG", "")] + [("AG", f"layers.{i}") for i in range(4)]
        s.check.equal(_events(spy), expected, "forward (default)")
        spy.events.clear()
        loss.sum().backward()
        if num_to_prefetch == 1:
            expected = [("AG", ""), ("AG", "layers.3"), ("AG", "layers.2"), ("RS", "layers.3"), ("AG", "layers.1"),
                        ("RS", "layers.2"), ("AG", "layers.0"), ("RS", "layers.1"), ("RS", "layers.0"), ("RS", "")]
        else:
            expected = [("AG", ""), ("AG", "layers.3"), ("AG", "layers.2"), ("AG", "layers.1"), ("RS", "layers.3"),
                        ("AG", "layers.0"), ("RS", "layers.2"), ("RS", "layers.1"), ("RS", "layers.0"), ("RS", "")]
        s.check.equal(_events(spy), expected, f"backward with {num_to_prefetch} prefetched")


for n in (1, 2):
    SC.add(f"set_modules_to_backward_prefetch_{n}", 2, PREFETCH + "test_set_modules_to_backward_prefetch",
           f"each block prefetches the previous {n} in backward: all-gathers and reduce-scatters in PyTorch's "
           "event order", set_modules_to_backward_prefetch, num_to_prefetch=n)


@SC.register("reshard_after_forward_int_groups", 4,
             "derived from " + COMM + "test_fully_shard_communication_count (reshard_after_forward=2 at N=4)",
             "reshard_after_forward=2 on 4 ranks (blocks and root): forward all-gathers over 4 ranks, backward "
             "re-gathers every module over groups of 2 (hpZ), reduce-scatters over all 4")
def reshard_after_forward_int_groups(s):
    model, names = _transformer(s, reshard_after_forward=2)
    inp = tokens(model, 2, seed=s.rank)
    with CommSpy(comm_names(s, model, names)) as spy:
        loss = model(inp)
        s.check.equal([(e.name, e.group_size) for e in spy.of("AG")],
                      [("", 4), ("layers.0", 4), ("layers.1", 4), ("layers.2", 4)], "forward all-gathers: groups")
        spy.events.clear()
        loss.sum().backward()
    backward_ag = [(e.group_size, e.numel) for e in spy.of("AG")]
    s.check.equal([g for g, _ in backward_ag], [2, 2, 2, 2], "backward all-gathers over groups of 2")
    s.check.equal(sorted(e.group_size for e in spy.of("RS")), [4, 4, 4, 4], "reduce-scatters over all 4")


OUT = Outcomes(SC, timeout=240)


def test_the_docstring_table_lists_every_scenario():
    assert SC.missing_from(__doc__) == []


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("system,name,world_size", SC.cases())
def test_scenario(system, name, world_size):
    failures = OUT.failures(system, name, world_size)
    assert failures is None, failures
