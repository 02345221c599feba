"""Lesson 11's time model (zerokit/alphabeta.py) against hand-computed α-β times, nccl-tests'
bus-bandwidth convention, and lesson 11's own byte counts; its widget shows the model's numbers."""

import pytest

from zerokit import alphabeta as ab
from zerokit import widgets

GB = 1e9
H100, A100, ONE_NIC = ab.PRESETS.values()
PSI = 7.5e9


def _no_latency(cluster):
    return cluster.with_(base_latency=0.0, nvlink=ab.Link(cluster.nvlink.bandwidth, 0.0),
                         nic=ab.Link(cluster.nic.bandwidth, 0.0))


def test_an_all_gather_inside_a_node_is_the_ring_formula_worked_by_hand():
    # 8 GPUs, 1 GB gathered: 7 steps of 1/8 GB each at 450 GB/s, 8.4 us + 7 x 3.4 us of latency
    cost = ab.collective_time(H100, "all_gather", 1 * GB, "node")
    assert cost.inside == pytest.approx(0.875 / 450)
    assert cost.latency == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert cost.across == 0 and cost.total == pytest.approx(cost.latency + cost.inside)
    # an all-reduce is a reduce-scatter and an all-gather: twice the transfer, 14 steps
    ar = ab.collective_time(H100, "all_reduce", 1 * GB, "node")
    assert ar.inside == pytest.approx(2 * cost.inside) and ar.latency == pytest.approx(8.4e-6 + 14 * 3.4e-6)


def test_a_flat_ring_counts_nccls_steps_across_nodes_at_the_networks_latency():
    # 64 ranks on 8 nodes: 63 steps, of which 7 cross nodes (NCCL's nInterSteps = nNodes - 1)
    cost = ab.collective_time(H100, "reduce_scatter", 1e3, "all")
    assert cost.latency == pytest.approx(8.4e-6 + 56 * 3.4e-6 + 7 * 14e-6)
    across = ab.collective_time(H100, "all_gather", 1e3, "across")  # 8 ranks, one per node: every step crosses
    assert across.latency == pytest.approx(8.4e-6 + 7 * 14e-6)


@pytest.mark.parametrize("cluster, bottleneck", [(H100, 400), (A100, 200), (ONE_NIC, 25)])
def test_a_big_flat_all_reduce_shows_the_bus_bandwidth_nccl_tests_would(cluster, bottleneck):
    """nccl-tests' busbw (algbw x 2(n-1)/n) of a large all-reduce over every rank is the slowest
    link's: NVLink per GPU, or the node's NICs together (8 x 50 GB/s on DGX H100)."""
    assert ab.bus_bandwidth(cluster, "all", 1e12) / GB == pytest.approx(bottleneck, rel=1e-3)
    assert ab.bus_bandwidth(cluster, "node", 1e12) / GB == pytest.approx(cluster.nvlink.bandwidth / GB, rel=1e-3)


def _lesson_count(scheme, cluster):
    """Lesson 11's count of bytes across nodes per GPU: a collective on a group that spans nodes,
    its whole volume (an all-reduce twice), in bf16."""
    rows, _ = ab.scheme_collectives(scheme, PSI, cluster)
    return sum(nbytes * (2 if op == "all_reduce" else 1) for _, op, nbytes, span in rows if span != "node")


@pytest.mark.parametrize("cluster", [H100, A100, ONE_NIC], ids=["rails H100", "rails A100", "one NIC"])
def test_in_time_hybrid_sharding_is_not_twelve_times_faster_across_nodes(cluster):
    """The count: ZeRO-3 45 GB across per GPU, hybrid sharding 3.75 (12x, k x 1.5). The network's
    transfer time: 3 (N-1)/N against 2 (m-1)/m of the same bytes per node, 1.6875x, rails or not."""
    assert _lesson_count("ZeRO-3", cluster) / GB == pytest.approx(45)
    assert _lesson_count("hybrid sharding", cluster) / GB == pytest.approx(3.75)
    c = _no_latency(cluster)
    zero3 = ab.step_time("ZeRO-3", PSI, c)["total"].across
    hsdp = ab.step_time("hybrid sharding", PSI, c)["total"].across
    assert zero3 / hsdp == pytest.approx(3 * 63 / 64 / (2 * 7 / 8))
    # one NIC carries, per step of ZeRO-3 with rails, the flat rings' 3 x (N-1)/N x 2 Psi over 8 NICs
    if cluster.rails:
        assert zero3 * cluster.nic.bandwidth / GB == pytest.approx(3 * 63 / 64 * 15 / 8)


def test_the_flat_schemes_keep_the_counts_ratios_and_zeropp_is_the_papers_fourfold_cut():
    c = _no_latency(ONE_NIC)
    t = {s: ab.step_time(s, PSI, c, block=10**12)["total"].across for s in ab.SCHEMES}  # scales left out
    assert t["ZeRO-3"] / t["hpZ"] == pytest.approx(1.5)  # 3 flat collectives against 2
    assert t["ZeRO-3"] / t["qwZ + hpZ"] == pytest.approx(3 / 1.5)  # int8 forward (half) + bf16 reduce-scatter
    # ZeRO++ with qgZ: 3M -> 0.75M per node, M = 2 Psi (the paper's fourfold), to the (m-1)/m of a
    # group of one GPU per node against the flat ring's (N-1)/N
    assert t["ZeRO-3"] / t["ZeRO++ (qwZ + hpZ + qgZ)"] == pytest.approx(
        3 * 63 / 64 / (63 / 64 * 0.5 + 7 / 8 * 0.25), rel=1e-9)


def test_qwz_puts_int8_and_the_scales_on_the_wire_and_pays_for_its_kernels():
    rows, kernel = ab.scheme_collectives("qwZ", PSI, H100, block=32)
    gathers = [nbytes for what, op, nbytes, _ in rows if op == "all_gather"]
    assert gathers == [pytest.approx(PSI * (1 + 4 / 32))] * 2  # Psi + 4 Psi / B, each gather
    # per gather: the shard quantised (read 2, write 1 per element of Psi/N), the whole gather
    # dequantised (read 1 + 4/B, write 2)
    assert kernel == pytest.approx(2 * (PSI * 3 / 64 + PSI * (1 + 4 / 32) + 2 * PSI))
    assert ab.step_time("qwZ", PSI, H100)["kernels"] == pytest.approx(kernel / H100.hbm)


def test_the_widget_shows_the_models_times_and_redraws():
    shown = widgets.link_time_explorer()
    preset, nics, gbs, nodes, psi, summary, image = shown.widget.children

    def times():
        cells = summary.value.split('data-scheme="')[1:]
        return {c.split('"')[0]: float(c.split('data-seconds="')[1].split('"')[0]) for c in cells}

    assert times() == pytest.approx({s: ab.step_time(s, PSI, H100)["total"].total for s in ab.SCHEMES})
    first = image.value
    nics.value, gbs.value = 1, 25
    assert times() == pytest.approx({s: ab.step_time(s, PSI, H100.with_(nics=1, nic_bandwidth=25 * GB))[
        "total"].total for s in ab.SCHEMES})
    assert image.value != first
    preset.value = list(ab.PRESETS)[2]
    assert (nics.value, gbs.value) == (1, 25)
    assert shown._repr_mimebundle_()["text/html"].startswith('<div><img src="data:image/png;base64,')
