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
  $\Psi/k$ more between forward and backward. The same machinery as FSDP2's
  `reshard_after_forward=k`: `zerokit.fully_shard.reshard.ReshardZeRO3Adam`, which
  `ZeROppAdam` below is (one implementation of hpZ, not two).
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

Per rank per step, fp32 weights and gradients, nodes of k ranks, N ranks:

| scheme | inter-node bytes | intra-node bytes | held between forward and backward |
|---|---|---|---|
| ZeRO-3 | $12\Psi$ | 0 | $4\Psi/N$ |
| hpZ | $8\Psi$ | $4\Psi$ | $4\Psi/N + 4\Psi/k$ |
| qwZ | $2(\Psi + 4\Psi/B) + 4\Psi$ | 0 | $4\Psi/N$ |
| qwZ + hpZ | $\Psi + 4\Psi/B + 4\Psi$ | $4\Psi$ | $4\Psi/N + 4\Psi/k$ |
| hybrid sharding | $8\Psi/k$ | $12\Psi$ | $4\Psi/k$ (model states at rest $16\Psi/k$) |
"""

import torch
import torch.distributed as dist

from .collectives import all_gather  # torch's, but direct on gloo
from .ddp import broadcast_parameters
from .fully_shard.reshard import ReshardZeRO3Adam, node_group, node_ranks
from .zero3 import ZeRO3Adam

__all__ = ["quantize_blocks", "dequantize_blocks", "qwz_all_gather", "ZeROppAdam", "HybridShardAdam",
           "node_group", "replica_group"]

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


class _Dequantizing:
    """The work of a quantised all-gather: wait() waits for the values and the scales, then
    dequantises every rank's chunk, with that rank's scales, into the output."""

    def __init__(self, works, output, q_all, scales_all, block, n, dequantize):
        self._works, self._output, self._block, self._n = works, output, block, n
        self._q, self._scales, self._dequantize = q_all, scales_all, dequantize

    def wait(self, *args, **kwargs):
        if self._works is None:
            return True
        for work in self._works:
            work.wait()
        self._works = None
        chunks = self._output.view(-1).chunk(self._n)  # rank r's chunk of the output ...
        for chunk, q, scales in zip(chunks, self._q.chunk(self._n), self._scales.chunk(self._n)):
            self._dequantize(q, scales, self._block, out=chunk)  # ... with rank r's own scales
        self._q = self._scales = None  # the int8 copy and the scales are gone once dequantised
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
    handle = _Dequantizing(works, output, q_all, scales_all, block, n, dequantize)
    return handle if async_op else handle.wait() and None


# ---------------------------------------------------------------------------------------
# ZeRO++: hpZ (reshard.py's machinery) and qwZ on the forward gathers


class ZeROppAdam(ReshardZeRO3Adam):
    """ZeRO3Adam with ZeRO++'s weight-side ideas: hpZ, `reshard_after_forward=k` (the size of a
    node; ReshardZeRO3Adam), and qwZ, `quantize_block=B` (every all-gather of the primary shards
    carries int8 in blocks of B; gathers from the secondary shards stay exact). Without either
    it is ZeRO3Adam. quantizer: (quantize, dequantize) instead of quantize_blocks and
    dequantize_blocks (another format, or a student's)."""

    def __init__(self, module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, units=None,
                 prefetch=True, group=None, precision=None, offload=None, reshard_after_forward=None,
                 quantize_block=None, quantizer=None, foreach=None):
        if quantize_block is not None and (not isinstance(quantize_block, int) or isinstance(quantize_block, bool)
                                           or quantize_block < 1):
            raise ValueError(f"quantize_block must be None or a positive number of elements, not {quantize_block!r}")
        super().__init__(module, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, units=units,
                         prefetch=prefetch, group=group, precision=precision, offload=offload,
                         reshard_after_forward=reshard_after_forward, foreach=foreach)
        self.quantize_block, self.quantizer = quantize_block, quantizer

    def start_gather(self, bi):
        """Bucket bi's gather: from the secondary shards inside the node as hpZ has it (exact), else
        from the shards over all ranks, quantised on the wire (qwZ)."""
        if (self.quantize_block is None or self.secondary[bi] is not None or self.full[bi] is not None
                or bi in self.gathering):
            return super().start_gather(bi)
        for other in list(self.gathering):  # one transfer at a time, as ShardedParameters.start_gather
            self.finish_gather(other)
        while self._in_flight:
            self._receive()
        shard = self.precision.to_half(self.flat_params[bi])
        full = self.gather_buffer(bi, shard)
        work = qwz_all_gather(full, shard, self.quantize_block, group=self.group, async_op=True,
                              quantizer=self.quantizer)
        self.gathering[bi] = (work, full, shard)


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


class HybridShardAdam(ZeRO3Adam):
    r"""ZeRO-3 sharded over the k ranks of each node (`node_size`), replicated across the nodes of
    `group`: after each reduce-scatter inside the node, the gradient shard is averaged over its
    replicas, the ranks that hold the same shard in the other nodes (an all-reduce across nodes).
    Every replica then takes the same Adam step on the same shard. Memory per rank is ZeRO-3's
    at N = k; the traffic across nodes is that all-reduce, $2\Psi/k$ elements."""

    def __init__(self, module, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, units=None,
                 prefetch=True, group=None, node_size=None, precision=None, offload=None, foreach=None):
        if node_size is None:
            raise ValueError("HybridShardAdam needs node_size, the ranks of a node that shard the model")
        self.outer = group  # every rank of the job: nodes x node_size
        node = node_group(node_size, group)
        self.replicas = replica_group(node_size, group)
        self.n_replicas = dist.get_world_size(self.replicas)
        broadcast_parameters(module.parameters(), group)  # every node starts from the same weights
        super().__init__(module, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, units=units,
                         prefetch=prefetch, group=node, precision=precision, offload=offload, foreach=foreach)

    def _receive(self):
        """ZeRO-2's receive, with the gradient shard averaged across the nodes first."""
        work, _bi, out, _flat = self._in_flight[0]
        work.wait()  # the mean over this node's ranks
        if self.n_replicas > 1:
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.replicas)  # gloo has no AVG
            out.div_(self.n_replicas)
        super()._receive()

    def _flag_group(self):
        """Which parameters got a gradient is decided over every rank of every node, not one node."""
        return self.outer
