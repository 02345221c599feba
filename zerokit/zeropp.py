r"""ZeRO++ and hybrid sharding: ZeRO-3 when the links between nodes set the pace (lesson 11).

On a cluster the ranks of one node talk over fast links (NVLink, hundreds of GB/s) and the
nodes over slower ones (InfiniBand or Ethernet, tens of GB/s per GPU). ZeRO-3 moves $3\Psi$ per
rank per step, every collective over all N ranks; a collective whose group spans nodes runs at
the pace of its slowest link, so all $3\Psi$ cross nodes. That is the count of ZeRO++ (Wang et
al., 2023) and of `zerokit.CommCounter.node_split`: a collective whose group lies inside one
node is intra-node, one whose group spans nodes is inter-node, its whole volume.

Three ways to take bytes off the slow links, each a small step from zero3 / fully_shard:

- **hpZ** (hierarchical partitioning): after a unit's forward each rank keeps a *secondary*
  shard, its 1/k of the gathered unit, where k is the size of a node, and backward gathers
  the unit from those inside the node. Backward's $\Psi$ leaves the slow links; each rank holds
  $\Psi/k$ more between forward and backward. It is FSDP2's `reshard_after_forward=k`, and
  `ZeROppAdam` below takes FSDP2's other values too (the next table).
- **qwZ** (quantised weights): before the forward all-gather each rank quantises its shard to
  int8 in blocks of B elements, one fp32 scale per block (symmetric: $s = \max|x|/127$,
  $q = \mathrm{round}(x/s)$), and every rank dequantises what it receives ($\hat x = s\,q$,
  within $s/2$ of $x$). The gather moves $\Psi + 4\Psi/B$ bytes instead of $4\Psi$ in fp32
  ($2\Psi$ in bf16). The optimizer's shards (the master weights) are never quantised: each
  forward quantises them afresh, so the error does not build up from step to step.
  Backward computes with the weights forward computed with: with hpZ it gathers the secondary
  shards, copies of forward's dequantised weights, inside the node at full precision (DeepSpeed
  quantises that intra-node gather again; here the fast link is left exact); without hpZ it
  gathers the primary shards quantised again, which gives the same values bit for bit.
- **hybrid sharding** (HSDP, FSDP's HYBRID_SHARD): shard within a node, replicate across nodes.
  ZeRO-3 over the k ranks of a node (all its gathers and reduce-scatters intra-node), then an
  all-reduce of each gradient shard over the N/k ranks that hold the same shard, one per node:
  $2\Psi/k$ across nodes, for ZeRO-3's memory at N = k, $16\Psi/k$ instead of $16\Psi/N$.

ZeRO++'s third idea, qgZ (quantised gradients), is not built here: a reduce-scatter that
quantised along a ring would round every partial sum again at each of its N - 1 hops, so
ZeRO++ replaces it with all-to-all exchanges (one inside the node, one across), each piece
quantised once by its sender and summed in full precision by its receiver (lesson 11's text).

**What a unit keeps between its forward and its backward** (FSDP2's `reshard_after_forward`,
which hpZ generalises). Lesson 05's ZeRO-3 frees every unit after its forward and all-gathers it
again for its backward, except the root, which stays gathered (its backward comes first). That
is one point of a trade between memory and communication; `reshard_after_forward` names the
others. With
$\Psi$ elements, N ranks and P bytes per gathered element (4 in fp32, 2 in 16-bit compute):

| value | held per rank between forward and backward | backward's all-gather | volume a step |
|---|---|---|---|
| `True` | the shard, $P\Psi/N$ | $\Psi$ over all N ranks | $3\Psi$ |
| `False` | the shard and every unit full, $P\Psi(1 + 1/N)$ | none | $2\Psi$ |
| `k` (hpZ) | the shard and a secondary shard, $P\Psi/N + P\Psi/k$ | $\Psi$ inside a node of k ranks | $3\Psi$ |
| `None` | `True` for every unit but the root, `False` for the root | | |

(The shard is fp32, $4\Psi/N$, whatever the compute dtype; the table's P is for what forward
gathered. Each row's memory is at its peak when forward ends, with every unit held.)

`k`, a divisor of N, is ZeRO++'s hpZ (Wang et al., 2023): after a unit's forward each rank
keeps its 1/k of the unit's gathered weights, where the k ranks are those of its "node", k
consecutive ranks of the group (FSDP2 cuts its mesh the same way; torchrun numbers the ranks of
a node consecutively). Backward then all-gathers the unit from those k secondary shards, inside
the node: of the $3\Psi$, the $\Psi$ of backward's gathers never cross the slow links between
nodes; forward's all-gather and the gradients' reduce-scatter still span all N ranks. The
arithmetic is the same as ZeRO-3's (the same weights gathered, the same gradients reduced), so
the numbers are bit for bit ZeRO-3's. `k = N` is `True`, and `k = 1` is `False` (a "secondary
shard" over one rank is the whole unit), as in FSDP2.

`None` is ZeRO3Adam's own behaviour and FSDP2's default. `ZeROppAdam` below is ZeRO3Adam with
three methods changed: what `post_forward` leaves (free, keep, or keep a secondary shard, with
`keep_secondary`), where `start_gather` gathers from (the shards over all N ranks, or the
secondary shards over the node's k) and what `free` drops. Lesson 11's exercise, `MyHpZAdam`,
writes `keep_secondary`, `start_gather` and `free` as they are here, less what is labelled
beyond the exercise (tests/test_reference_reads_as_lesson.py).

Per rank per step, fp32 weights and gradients, nodes of k ranks, N ranks:

| scheme | inter-node bytes | intra-node bytes | held between forward and backward |
|---|---|---|---|
| ZeRO-3 | $12\Psi$ | 0 | $4\Psi/N$ |
| hpZ | $8\Psi$ | $4\Psi$ | $4\Psi/N + 4\Psi/k$ |
| qwZ | $2(\Psi + 4\Psi/B) + 4\Psi$ | 0 | $4\Psi/N$ |
| qwZ + hpZ | $\Psi + 4\Psi/B + 4\Psi$ | $4\Psi$ | $4\Psi/N + 4\Psi/k$ |
| hybrid sharding | $8\Psi/k$ | $12\Psi$ | $4\Psi/k$ (model states at rest $16\Psi/k$) |
"""

from functools import partial

import torch
import torch.distributed as dist
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from .collectives import all_gather, reduce_scatter  # torch's, but direct on gloo
from .comm import group_ranks
from .ddp import broadcast_parameters
from .hooks import in_backward, weak_hook
from .zero3 import ZeRO3Adam, members

__all__ = ["quantize_blocks", "dequantize_blocks", "qwz_all_gather", "ZeROppAdam", "HybridShardAdam",
           "hybrid_reduce_scatter", "node_group", "replica_group", "unit_policies"]

QMAX = 127  # symmetric int8: -127 .. 127 (-128 unused, so that q and -q are both there)


# ---------------------------------------------------------------------------------------
# qwZ: block quantisation, and the all-gather that carries it


def n_blocks(numel, block):
    """Blocks of `block` elements that cover numel elements (the last may be shorter)."""
    return -(-numel // block)


@torch.no_grad()
def quantize_blocks(x, block):
    """x (1-D, floating point) in blocks of `block` elements: (q, scales), q int8 of x's size and
    one fp32 scale per block, max|x| / 127 over the block (0 for a block of zeros, whose q is 0).
    Then |x - scale * q| <= scale / 2 for every element: half a quantisation step."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"a block is a positive number of elements, not {block!r}")
    n = x.numel()
    width = min(block, max(n, 1))  # a block longer than x: one block of all of x
    blocks = x.new_zeros(n_blocks(n, width) * width, dtype=torch.float32)  # the last block padded with zeros
    blocks[:n] = x.reshape(-1)
    blocks = blocks.view(-1, width)
    scales = blocks.abs().amax(dim=1) / QMAX
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # a block of zeros: q = 0
    q = torch.round(blocks / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(-1)[:n], scales


@torch.no_grad()
def dequantize_blocks(q, scales, block, out=None):
    """scale * q, element i with the scale of its block, i // block; into `out` if given (any
    floating dtype, q's size), else a new fp32 tensor."""
    block_of = torch.arange(q.numel(), device=q.device) // block  # element i is in block i // block
    x = q.float() * scales[block_of]
    return x if out is None else out.copy_(x.view_as(out))


class _ThenWork:
    """The work of a collective with a step of its own after it (qwZ's dequantisation, hybrid
    sharding's average across nodes): wait() waits for `works`, then runs `then()`, once."""

    def __init__(self, works, then):
        self._works, self._then = works, then

    def wait(self, *args, **kwargs):
        if self._works is not None:
            for work in self._works:
                work.wait()
            self._works, then, self._then = None, self._then, None  # what `then` holds goes with it
            then()
        return True

    def is_completed(self):
        return self._works is None


def qwz_all_gather(output, shard, block, group=None, async_op=False, quantizer=None):
    """all_gather(output, shard) with the shard quantised to int8 in blocks of `block` on the wire:
    two all-gathers, the values (1 byte per element) and the scales (4 bytes per block of each
    rank's shard), then each rank's chunk dequantised with its own scales. quantizer: a pair
    (quantize, dequantize) with the signatures of quantize_blocks and dequantize_blocks."""
    quantize, dequantize = quantizer or (quantize_blocks, dequantize_blocks)
    n = dist.get_world_size(group)
    if output.numel() != n * shard.numel():
        raise ValueError(f"qwz_all_gather: the output has {output.numel()} elements, not {n} x the shard's "
                         f"{shard.numel()}")
    q, scales = quantize(shard, block)
    q_all = torch.empty(n * q.numel(), dtype=q.dtype, device=q.device)
    scales_all = torch.empty(n * scales.numel(), dtype=scales.dtype, device=scales.device)
    works = [all_gather(q_all, q, group=group, async_op=True),
             all_gather(scales_all, scales, group=group, async_op=True)]

    def dequantize_all():  # every rank's chunk of the output, with that rank's own scales
        for chunk, q_r, scales_r in zip(output.view(-1).chunk(n), q_all.chunk(n), scales_all.chunk(n)):
            dequantize(q_r, scales_r, block, out=chunk)

    handle = _ThenWork(works, dequantize_all)  # the int8 copy and the scales are freed once dequantised
    return handle if async_op else handle.wait() and None


# ---------------------------------------------------------------------------------------
# ZeRO++'s weight side: what a unit keeps after forward (hpZ) and int8 on the wire (qwZ)


_NODE_GROUPS = {}  # (default group, ranks of the group, k) -> this rank's node group


def node_ranks(k, group=None, who="node_group"):
    """The global ranks of `group` (None: the default group), checked to cut into nodes of k
    consecutive ranks: the layout node_group and lesson 11's replica groups share."""
    ranks = group_ranks(group)
    if ranks is None:
        raise ValueError(f"{who}: the group is not one this process made with dist.new_group")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or len(ranks) % k:
        raise ValueError(f"a node size must be an int that divides the group's {len(ranks)} ranks, not {k!r}")
    return ranks


def node_group(k, group=None):
    """This rank's "node": the process group of the k consecutive ranks of `group` (None: the
    default group) that contain it. Made once per (group, k) and kept, as FSDP2 keeps its mesh;
    only the ranks of a node take part in making its group."""
    ranks = node_ranks(k, group)
    key = (dist.group.WORLD, ranks, k)  # the default group's object: a new one after re-initialising
    if key not in _NODE_GROUPS:
        i = ranks.index(dist.get_rank()) // k
        _NODE_GROUPS[key] = dist.new_group(list(ranks[i * k:(i + 1) * k]), use_local_synchronization=True)
    return _NODE_GROUPS[key]


def unit_policies(reshard_after_forward, n_units, world_size):
    """Per unit (unit 0 the root): True (free), False (keep) or an int k (hpZ), from the
    user's value; an int is validated against the group's size and k = 1 or N made a bool."""
    value = reshard_after_forward
    if value is not None and not isinstance(value, (bool, int)):
        raise TypeError(f"reshard_after_forward must be True, False, None or an int (a node's size), not {value!r}")
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1 or world_size % value:
            raise ValueError(f"reshard_after_forward={value}: a node's size must divide the {world_size} ranks "
                             f"of the group (FSDP2's rule too)")
        value = False if value == 1 else True if value == world_size else value
    if value is None:  # FSDP2's default: the root's backward comes first, so it is kept
        return [False] + [True] * (n_units - 1)
    return [value] * n_units


class ZeROppAdam(ZeRO3Adam):
    """ZeRO3Adam with ZeRO++'s weight-side ideas and FSDP2's `reshard_after_forward` (see the
    module's docstring).

    Takes ZeRO3Adam's arguments (lr, betas, eps, weight_decay, units, prefetch, group, precision,
    offload, foreach), and:
    reshard_after_forward: True, False, None (the default: ZeRO3Adam itself) or k, the size of a
        node (hpZ). The ranks of `group` form nodes of k consecutive ranks; zerokit.CommCounter's
        node_split(k) shows backward's all-gathers inside them.
    quantize_block: B, qwZ: every all-gather of the primary shards carries int8 in blocks of B
        (gathers from the secondary shards stay exact). None: fp32 or 16-bit, as ZeRO3Adam's.
    quantizer: (quantize, dequantize) instead of quantize_blocks and dequantize_blocks (another
        format, or a student's). Without either option it is ZeRO3Adam.
    """

    def __init__(self, module, *, reshard_after_forward=None, quantize_block=None, quantizer=None, **options):
        if quantize_block is not None and (not isinstance(quantize_block, int) or isinstance(quantize_block, bool)
                                           or quantize_block < 1):
            raise ValueError(f"quantize_block must be None or a positive number of elements, not {quantize_block!r}")
        super().__init__(module, **options)
        self.set_reshard_after_forward(reshard_after_forward)
        self.secondary = [None] * len(self.buckets)  # bucket -> (its secondary shard, node group), while held
        self._ran = [set() for _ in self.units]  # a group's modules whose forward ran in this forward
        self.quantize_block, self.quantizer = quantize_block, quantizer
        if quantize_block is not None:  # qwZ: ZeRO3Adam's gathers from the shards, in int8 on the wire
            self.gather_collective = partial(qwz_all_gather, block=quantize_block, quantizer=quantizer)

    def set_reshard_after_forward(self, value, units=None):
        """Change the policy (all units, or those indices of self.units) from the next forward on."""
        policies = unit_policies(value, len(self.units), self.world_size)
        if not hasattr(self, "after_forward"):
            self.after_forward = policies
        for u in (range(len(self.units)) if units is None else units):
            self.after_forward[u] = policies[u]
        sizes = {p for p in self.after_forward if not isinstance(p, bool)}
        self.node_groups = {k: node_group(k, self.group) for k in sizes}

    def record_order(self, u, module, args):
        if u == 0 and not in_backward():  # a new forward
            self._ran = [set() for _ in self.units]
        super().record_order(u, module, args)

    def post_forward(self, u, module, args, output):
        """Unit u's forward is done: hook its outputs for the backward gather (ZeRO-3), and leave
        it as its policy says: free (True), full (False), or a secondary shard (k). A group (FSDP2's
        fully_shard([a, b])) is left so once all of its modules' forwards have run."""
        if in_backward() or not torch.is_grad_enabled():  # a recomputation; or no backward to come: free it
            return super().post_forward(u, module, args, output)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:  # as ZeRO3Adam.post_forward
            register_multi_grad_hook(tensors, partial(weak_hook(self.pre_backward), u), mode="any")
        self._ran[u].add(id(module))
        if len(self._ran[u]) < len(members(self.units[u])):
            return  # a group whose other modules are still to run: it stays gathered for them
        policy = self.after_forward[u]
        for bi in self.buckets_of_unit[u]:
            if policy is True:
                self.free(bi)
            elif policy is not False:
                self.keep_secondary(bi, self.node_groups[policy])

    @torch.no_grad()
    def keep_secondary(self, bi, node):
        """Keep this rank's 1/k of bucket bi's gathered buffer (k = the node's size), free the rest."""
        if self.full[bi] is None:  # not gathered (a unit that did not compute): nothing to keep
            return
        k, j = dist.get_world_size(node), dist.get_rank(node)
        piece = self.buckets[bi].padded_numel // k  # N divides the padded size, and k divides N
        secondary = self.full[bi][j * piece:(j + 1) * piece].clone()
        self.free(bi)
        self.secondary[bi] = (secondary, node)

    def start_gather(self, bi):
        """Gather bucket bi from its secondary shards inside the node if it has them, exact, else from
        the shards over all ranks (ZeRO3Adam.start_gather: with qwZ, in int8)."""
        if self.secondary[bi] is None or self.full[bi] is not None or bi in self.gathering:
            return super().start_gather(bi)
        self.finish_transfers()  # beyond the exercise: one transfer at a time, as ZeRO3Adam.start_gather
        (secondary, node), self.secondary[bi] = self.secondary[bi], None  # the gather holds it until done
        full = self.gather_buffer(bi, secondary)
        work = all_gather(full, secondary, group=node, async_op=True)
        self.gathering[bi] = (work, full, secondary)

    def free(self, bi):
        """Bucket bi back to its shard only: its secondary shard goes too."""
        self.secondary[bi] = None
        super().free(bi)

    def memory_categories(self):
        cats = super().memory_categories()
        cats["parameters"] = cats["parameters"] + [s for s, _ in filter(None, self.secondary)]
        return cats


# ---------------------------------------------------------------------------------------
# hybrid sharding: ZeRO-3 inside the node, data parallel across nodes


_REPLICA_GROUPS = {}  # (default group, ranks of the group, k) -> this rank's replica group


def replica_group(k, group=None):
    """The ranks that hold the same shard as this one under hybrid sharding: one per node of k
    consecutive ranks of `group`, each at this rank's place in its node. Made once per (group, k)."""
    ranks = node_ranks(k, group, "replica_group")
    key = (dist.group.WORLD, ranks, k)
    if key not in _REPLICA_GROUPS:
        j = ranks.index(dist.get_rank()) % k
        _REPLICA_GROUPS[key] = dist.new_group(list(ranks[j::k]), use_local_synchronization=True)
    return _REPLICA_GROUPS[key]


def hybrid_reduce_scatter(output, input, replicas, op=dist.ReduceOp.AVG, group=None, async_op=False):
    """reduce_scatter(output, input) over `group` (the node), then the output averaged over
    `replicas`, the ranks holding the same shard in the other nodes: FSDP2's HSDP reduce. The
    all-reduce runs when the work is waited for (async_op=True), as ZeRO-2 receives a bucket."""

    def average_across_nodes():  # the reduce-scatter gave the mean over this node's ranks
        n = dist.get_world_size(replicas)
        if n > 1:
            dist.all_reduce(output, op=dist.ReduceOp.SUM, group=replicas)  # gloo has no AVG
            output.div_(n)

    handle = _ThenWork([reduce_scatter(output, input, op=op, group=group, async_op=True)], average_across_nodes)
    return handle if async_op else handle.wait() and None


class HybridShardAdam(ZeRO3Adam):
    r"""ZeRO-3 sharded over the k ranks of each node (`node_size`), replicated across the nodes of
    `group`: after each reduce-scatter inside the node, the gradient shard is averaged over its
    replicas, the ranks that hold the same shard in the other nodes (an all-reduce across nodes).
    Every replica then takes the same Adam step on the same shard. Memory per rank is ZeRO-3's
    at N = k; the traffic across nodes is that all-reduce, $2\Psi/k$ elements.

    Takes ZeRO3Adam's arguments; `group` is every rank of the job (nodes x node_size)."""

    def __init__(self, module, *, node_size=None, group=None, **options):
        if node_size is None:
            raise ValueError("HybridShardAdam needs node_size, the ranks of a node that shard the model")
        self.outer = group  # every rank of the job: nodes x node_size
        node = node_group(node_size, group)
        self.replicas = replica_group(node_size, group)
        broadcast_parameters(module.parameters(), group)  # every node starts from the same weights
        super().__init__(module, group=node, **options)
        # ZeRO-2's reduce-scatter inside the node, then the mean over the replicas
        self.reduce_collective = partial(hybrid_reduce_scatter, replicas=self.replicas)

    def _flag_group(self):
        """Which parameters got a gradient is decided over every rank of every node, not one node."""
        return self.outer
