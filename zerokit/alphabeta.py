r"""Time, not bytes: the α-β model of collectives on nodes of GPUs (lesson 11).

A collective over $p$ ranks on a ring takes $p - 1$ steps; each step costs a latency $\alpha$
and moves $1/p$ of the data at the link's bandwidth $\beta$ (bytes per second, one direction):

$$T = t_0 + (p - 1)\,\alpha + \frac{p - 1}{p}\,\frac{n}{\beta}$$

for an all-gather of $n$ bytes of output or a reduce-scatter of $n$ bytes of input ($t_0$:
NCCL's fixed cost of a collective); an all-reduce is both, twice that. Two kinds of links:
NVLink inside a node (every GPU its own $\beta_\text{in}$), network cards (NICs) between nodes,
`nics` of them per node at $\beta_\text{nic}$ each. Three kinds of groups:

- **a node** (the $k$ GPUs of one node): NVLink only.
- **across** (one GPU per node, $m$ nodes; the $k$ such groups of a job run at once): every
  step crosses nodes, and the $k$ GPUs of a node share its NICs, $\beta = \beta_\text{nic}
  \min(1, \text{nics}/k)$ per GPU. With *rails* (one NIC per GPU, as DGX A100 and H100 have)
  each GPU has a NIC of its own.
- **all** ($N = mk$ ranks, ZeRO-3's flat group): NCCL runs the ring as several channels, each a
  ring of its own on a slice of the data, and lays them out so that their crossings between
  nodes use every NIC of the node. So a node's $k$ GPUs push $\frac{N-1}{N}n$ each through
  NVLink while its NICs together carry $\frac{N-1}{N}n$: $T_\beta = \frac{N-1}{N}\, n\,
  \max(1/\beta_\text{in},\ 1/(\text{nics}\cdot\beta_\text{nic}))$, every step at the network's
  latency.

That is where lesson 11's count and time part ways. The count puts a flat collective's whole
volume on each GPU's link between nodes, and a cross-node group's share ($1/k$ of the model)
on it too: hybrid sharding then moves $k \times 1.5$ fewer bytes than ZeRO-3. In time, the flat
ring's crossings spread over the node's NICs, and the cross-node groups of a node share them:
the gap is about 1.5 with rails or without. Between flat collectives (ZeRO-3, hpZ, qwZ) the
count's ratios hold.

The quantisation's own time: a kernel that quantises or dequantises reads and writes the
device's memory at its bandwidth (HBM), and that time sits on the step's critical path beside
the bytes it saves on the wire (`quantize_time`).

The figures (`PRESETS`), per GPU and per direction:

| | NVLink $\beta_\text{in}$ | NICs per node x $\beta_\text{nic}$ | HBM | bf16 dense |
|---|---|---|---|---|
| DGX H100 | 450 GB/s | 8 x 50 GB/s (rails) | 3.35 TB/s | 989 TFLOP/s |
| DGX A100 | 300 GB/s | 8 x 25 GB/s (rails) | 2.0 TB/s | 312 TFLOP/s |
| A100 nodes, one NIC each | 300 GB/s | 1 x 25 GB/s | 2.0 TB/s | 312 TFLOP/s |

Their sources: NVLink 4 is 18 links of 25 GB/s each way (the H100 datasheet's 900 GB/s counts
both ways), NVLink 3 twelve (A100: 600 GB/s both ways); NDR InfiniBand is 400 Gb/s = 50 GB/s
(ConnectX-7), HDR 200 Gb/s = 25 GB/s (ConnectX-6); DGX H100 and DGX A100 give each of their 8
GPUs a compute NIC of its own (their user guides); HBM and bf16 peaks are the SXM datasheets'.

Latencies are NCCL's own tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol,
what NCCL picks for large messages): $t_0$ = 8.4 µs per collective, then 3.4 µs for each step
of the ring inside a node and 14 µs for each step that crosses nodes ($m - 1$ of an all-gather's
$p - 1$ steps; all of them on a group of one GPU per node).
"""

from dataclasses import dataclass, replace

__all__ = ["Link", "Cluster", "Cost", "PRESETS", "SCHEMES", "collective_time", "quantize_time", "scheme_collectives",
           "step_time", "compute_time", "bus_bandwidth"]

GB = 1e9
BASE_LATENCY = 8.4e-6  # NCCL tuning.cc: baseLat, ring, Simple
NVLINK_STEP = 3.4e-6  # NCCL tuning.cc: hwLat[NVLINK], ring, Simple
NET_STEP = 14.0e-6  # NCCL tuning.cc: hwLat[NET], ring, Simple


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes per second, one direction) and latency (seconds per ring step)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """m nodes of k GPUs: NVLink per GPU inside a node, `nics` network cards per node between them,
    HBM for the quantisation kernels, bf16 FLOP/s for compute."""

    nodes: int
    gpus_per_node: int
    nvlink: Link
    nic: Link
    nics: int
    hbm: float
    flops: float
    base_latency: float = BASE_LATENCY

    @property
    def world_size(self):
        return self.nodes * self.gpus_per_node

    @property
    def rails(self):
        """One NIC per GPU (or more): each GPU talks to the other nodes over a card of its own."""
        return self.nics >= self.gpus_per_node

    def with_(self, **changes):
        """A copy with some fields changed (nic_bandwidth=..., nics=..., nodes=...)."""
        if "nic_bandwidth" in changes:
            changes["nic"] = Link(changes.pop("nic_bandwidth"), self.nic.latency)
        return replace(self, **changes)


PRESETS = {
    "DGX H100: NVLink 4, 8 x NDR 400 Gb/s (rails)":
        Cluster(8, 8, Link(450 * GB, NVLINK_STEP), Link(50 * GB, NET_STEP), nics=8, hbm=3350 * GB, flops=989e12),
    "DGX A100: NVLink 3, 8 x HDR 200 Gb/s (rails)":
        Cluster(8, 8, Link(300 * GB, NVLINK_STEP), Link(25 * GB, NET_STEP), nics=8, hbm=2000 * GB, flops=312e12),
    "A100 nodes, one HDR 200 Gb/s NIC per node":
        Cluster(8, 8, Link(300 * GB, NVLINK_STEP), Link(25 * GB, NET_STEP), nics=1, hbm=2000 * GB, flops=312e12),
}


@dataclass(frozen=True)
class Cost:
    """One collective (or a sum of them): seconds of latency, of NVLink transfer, of network
    transfer, and in all (a flat ring's NVLink and network terms overlap: the slower counts)."""

    latency: float = 0.0
    inside: float = 0.0
    across: float = 0.0
    total: float = 0.0

    def __add__(self, other):
        return Cost(self.latency + other.latency, self.inside + other.inside, self.across + other.across,
                    self.total + other.total)

    def times(self, count):
        return Cost(self.latency * count, self.inside * count, self.across * count, self.total * count)


_OPS = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 1}
SPANS = ("node", "across", "all")


def collective_time(cluster, op, nbytes, span):
    """One collective of `nbytes` (an all-gather's output, a reduce-scatter's input, an
    all-reduce's tensor, what an all-to-all's rank holds) on a group that is one node, one GPU
    per node, or all ranks: a Cost in seconds."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, not {op!r}")
    if span not in SPANS:
        raise ValueError(f"span must be one of {SPANS}, not {span!r}")
    k, m = cluster.gpus_per_node, cluster.nodes
    p = {"node": k, "across": m, "all": k * m}[span]
    if p == 1 or nbytes == 0:
        return Cost()
    passes = _OPS[op]  # an all-reduce is a reduce-scatter and an all-gather
    share = (p - 1) / p * nbytes * passes
    # NCCL's latency of a ring: base + the steps inside nodes at NVLink's latency + the steps that
    # cross nodes (m - 1 per pass) at the network's (tuning.cc: nInterSteps)
    nodes = {"node": 1, "across": m, "all": m}[span]
    steps, inter = passes * (p - 1), (passes * (nodes - 1) if nodes > 1 else 0)
    latency = cluster.base_latency + (steps - inter) * cluster.nvlink.latency + inter * cluster.nic.latency
    if span == "node":
        inside, across = share / cluster.nvlink.bandwidth, 0.0
    elif span == "across":
        inside, across = 0.0, share / (cluster.nic.bandwidth * min(1.0, cluster.nics / k))
    else:  # the flat ring: every GPU's share through NVLink, the node's crossings over all its NICs
        inside, across = share / cluster.nvlink.bandwidth, share / (cluster.nics * cluster.nic.bandwidth)
    return Cost(latency, inside, across, latency + max(inside, across))


def bus_bandwidth(cluster, span="all", nbytes=16 * GB):
    """What nccl-tests would print as busbw for an all-reduce of `nbytes` on the model's cluster:
    algbw x 2(p - 1)/p, algbw = nbytes / time (nccl-tests' PERFORMANCE.md)."""
    p = {"node": cluster.gpus_per_node, "across": cluster.nodes, "all": cluster.world_size}[span]
    t = collective_time(cluster, "all_reduce", nbytes, span).total
    return nbytes / t * 2 * (p - 1) / p


def quantize_time(cluster, elements, read_bytes, write_bytes):
    """A memory-bound kernel over `elements`: read_bytes and write_bytes per element at HBM speed."""
    return elements * (read_bytes + write_bytes) / cluster.hbm


def compute_time(cluster, psi, tokens_per_gpu, mfu=0.4):
    """Forward and backward of a step: 6 Ψ FLOPs per token, at `mfu` of the GPU's bf16 peak."""
    return 6 * psi * tokens_per_gpu / (cluster.flops * mfu)


SCHEMES = ("ZeRO-3", "hpZ", "qwZ", "qwZ + hpZ", "hybrid sharding", "ZeRO++ (qwZ + hpZ + qgZ)")


def scheme_collectives(scheme, psi, cluster, element_bytes=2, block=32):
    r"""The collectives of one step of `scheme` for Ψ parameters, weights and gradients of
    `element_bytes` on the wire (bf16: 2), qwZ's int8 in blocks of `block` with an fp32 scale
    each: a list of (what, op, bytes, span), plus the quantisation kernels' HBM bytes.

    ZeRO-3: the forward and backward all-gathers and the reduce-scatter, flat. hpZ: backward's
    gather inside the node (from the secondary shards, in `element_bytes`). qwZ: both gathers in
    int8 (without hpZ, backward quantises the primary shards again, as zerokit's ZeROppAdam).
    Hybrid sharding: all three inside the node, then the all-reduce of the gradient shard, Ψ/k
    elements, across. ZeRO++'s qgZ: the gradients in int4 through two all-to-alls, inside the
    node (every GPU its whole gradient) and across (the node's reduced share, Ψ/k)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, not {scheme!r}")
    e, k, n = element_bytes, cluster.gpus_per_node, cluster.world_size
    int8 = psi * (1 + 4 / block)  # values and scales of a quantised gather
    full = psi * e
    quantised_gather = psi * (e + 1) / n + int8 + psi * e  # quantise the shard, dequantise the whole gather
    rows, kernel = [], 0.0
    if scheme == "hybrid sharding":
        rows = [("forward all-gather", "all_gather", full, "node"), ("backward all-gather", "all_gather", full, "node"),
                ("gradient reduce-scatter", "reduce_scatter", full, "node"),
                ("gradient shard all-reduce", "all_reduce", full / k, "across")]
        return rows, kernel
    quantised = scheme != "ZeRO-3" and scheme != "hpZ"
    hpz = "hpZ" in scheme
    rows.append(("forward all-gather (int8)" if quantised else "forward all-gather", "all_gather",
                 int8 if quantised else full, "all"))
    kernel += quantised_gather if quantised else 0.0
    if hpz:
        rows.append(("backward all-gather (secondary)", "all_gather", full, "node"))
    else:
        rows.append(("backward all-gather (int8)" if quantised else "backward all-gather", "all_gather",
                     int8 if quantised else full, "all"))
        kernel += quantised_gather if quantised else 0.0
    if "qgZ" in scheme:
        int4 = psi * (0.5 + 4 / block)
        rows += [("gradient all-to-all in the node (int4)", "all_to_all", int4, "node"),
                 ("gradient all-to-all across (int4)", "all_to_all", int4 / k, "across")]
        # quantise the gradient (read e, write 1/2), dequantise and sum the node's pieces into fp32
        # (read 1/2, write 4/k), quantise that share again (read 4/k, write 1/2k), dequantise and
        # sum the nodes' pieces (read 1/2k, write 4/N)
        kernel += psi * (e + 0.5 + 0.5 + 4 / k + 4 / k + 0.5 / k + 0.5 / k + 4 / n)
    else:
        rows.append(("gradient reduce-scatter", "reduce_scatter", full, "all"))
    return rows, kernel


def step_time(scheme, psi, cluster, units=32, element_bytes=2, block=32):
    """The communication of one step of `scheme`, no overlap: each pass's collectives cut into
    `units` (one per gathered unit, so the latency counts `units` times), plus the quantisation
    kernels at HBM speed. {"rows": [(what, span, bytes, Cost)], "kernels": seconds, "total": Cost
    with the kernels in its total}."""
    rows, kernel_bytes = scheme_collectives(scheme, psi, cluster, element_bytes, block)
    out, total = [], Cost()
    for what, op, nbytes, span in rows:
        pieces = 2 if "int8" in what else 1  # qwZ's gather is two: the values and the scales
        cost = collective_time(cluster, op, nbytes / units, span).times(units)
        cost = cost + Cost(latency=cost.latency * (pieces - 1), total=cost.latency * (pieces - 1))
        out.append((what, span, nbytes, cost))
        total = total + cost
    kernels = kernel_bytes / cluster.hbm
    return {"rows": out, "kernels": kernels, "total": total + Cost(total=kernels)}

