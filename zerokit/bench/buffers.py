"""What ZeRO-2 and ZeRO-3 hold beyond the ZeRO paper's table, derived from their structure.

The demo prints these buffers beside what zerokit.memory.MemoryProbe measured, and
tests/test_memory.py checks the probe against them. They are computed from the optimizer's
buckets, units and the order its units ran in, so they read those internals: `opt.buckets`
(each bucket's param_numel, numels, shard_numel, padded_numel), under ZeRO-3 `opt.bucket_units`,
`opt.world_size`, `opt.max_in_flight`, `opt.units` and `opt.forward_order`.
"""

from zerokit.stages import get_stage

FP32 = 4  # bytes per element: the demo trains in fp32


def buffer_bytes(stage, opt, model=None):
    """What a stage holds at each category's peak beyond the paper's table, from its structure.

    Returns {category: (bytes, the moment of the peak in words)}. Derived from the buckets,
    the units and the order they run in, not from a measurement, so measured / (theory +
    buffers) checks an understanding of what is alive when:

    - ZeRO-2, gradients (`gradient_peak`): buckets fill and are sent in order during
      backward, and up to `max_in_flight` reduce-scatters stay in flight, each holding its
      bucket's full-size flat copy (the input) beside the reduced shard (the output).
    - ZeRO-3, parameters (`gathered_peak`): besides every unit's shard, the root unit stays
      gathered from forward to the end of backward, and while one unit computes the next
      (in forward order, or the previous one in backward) is being gathered (prefetch).
    - ZeRO-3, gradients: as ZeRO-2's, with one bucket per unit, except that a new all-gather
      first receives every transfer in flight (ZeRO3Adam.finish_transfers): each
      unit's backward hook prefetches the next (all but the last, whose next is the root,
      gathered already), so its gradients fill with none of them left; and the root unit's
      gradients waiting, counted whole, until it is sent last, right after (in the same
      hook as) the first unit: its gradients arrive during backward, the final norm's early
      and the position embedding's just before the token embedding's (which runs first in
      forward). Counting it whole is an upper bound by what has not arrived yet.
    The "buffer" is the peak minus the paper's figure; every shard and flat copy counted
    includes its padding (the end's, and the gaps that align each parameter: zerokit.flat).
    These are the moments the probe can see, between hooks: inside one `send` a bucket's
    .grad and its new flat copy coexist for an instant, next to a third transfer not yet
    awaited, which only the allocator's peak would show.
    """
    # the sharded categories that have a buffer to see: data parallel and ZeRO-1 hold nothing
    # beyond the table (the bucket is the gradient), ZeRO-2 its gradients, ZeRO-3 its parameters too
    probes = [(category, PEAKS[category]) for category in get_stage(stage).shards if category in PEAKS]
    if not probes:
        return {}
    sharded = FP32 * sum(b.param_numel for b in opt.buckets) / opt.world_size  # the paper's 4 Ψ / N
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    out = {}
    for category, peak_of in probes:
        peak, where = peak_of(opt, names)
        out[category] = (peak - sharded, where)
    return out


def _unit_name(opt, u, names):
    return names.get(id(opt.units[u])) or ("the root" if u == 0 else f"unit {u}")


def gradient_peak(opt, names=None):
    """Peak gradient bytes of a ZeRO-2/3 backward, and when, from the buckets alone.

    Gradients are assumed to arrive bucket by bucket, in bucket order (make_buckets lays
    buckets out in reverse parameter order, ZeRO-3 in reverse unit order, for that reason).
    Two moments per bucket i: just before its last gradient arrives (the shards of the
    buckets sent before, the flat copies of those still in flight, and bucket i's gradients
    but one: all but its smallest parameter, an upper bound; nothing for a bucket of one
    parameter), and just after it is sent (its .grad freed, its flat copy and output shard in
    flight, the oldest transfer beyond max_in_flight awaited). ZeRO-3 with prefetch: before
    a unit's gradients arrive, its backward hook has received every transfer in flight, but
    for the last unit (taken as the last bucket that is not the root's).
    """
    buckets = opt.buckets
    units = getattr(opt, "bucket_units", [None] * len(buckets))  # ZeRO-3: the unit of each bucket
    held = [u == 0 for u in units]  # ZeRO-3's root unit (see above)
    label = [f"bucket {i}" if u is None else _unit_name(opt, u, names or {}) for i, u in enumerate(units)]
    drains = bool(units) and units[0] is not None and getattr(opt, "prefetch", False)  # ZeRO-3: start_gather drains first
    last_unit = max((i for i, is_held in enumerate(held) if not is_held), default=None)
    shards, flight, moments = 0, [], []
    for i, b in enumerate(buckets):
        waiting = FP32 * sum(h.param_numel for h, is_held in zip(buckets, held) if is_held and h is not b)
        if drains and not held[i] and i != last_unit:
            flight = []
        if not held[i]:
            filling = FP32 * (b.param_numel - min(b.numels))  # all but its last gradient, at most
            moments.append((shards + sum(flight) + filling + waiting, f"{label[i]}: all but its last gradient"))
        shards += FP32 * b.shard_numel
        flight = (flight + [FP32 * b.padded_numel])[-opt.max_in_flight:]
        if i + 1 < len(buckets) and held[i + 1]:
            continue  # the root goes in the same hook: no moment in between for the probe to see
        sent = ", ".join(label[k] for k in range(i - len(flight) + 1, i + 1))
        moments.append((shards + sum(flight) + waiting, f"{label[i]} sent; flat copies of {sent} in flight"))
    return max(moments, key=lambda m: m[0])


def gathered_peak(opt, names=None):
    """Peak parameter bytes of a ZeRO-3 step, and when: every shard, the root unit gathered,
    and the largest pair of units next to each other in forward order (one computing, the
    other being prefetched; backward visits the same pairs in reverse)."""
    size = {u: FP32 * sum(b.padded_numel for b, v in zip(opt.buckets, opt.bucket_units) if v == u)
            for u in range(len(opt.units))}
    shards = FP32 * sum(b.shard_numel for b in opt.buckets)
    order = [u for u in opt.forward_order if u != 0]  # the forward order of the last step
    pairs = [(order[0],)] + list(zip(order, order[1:]))
    pair = max(pairs, key=lambda us: sum(size[u] for u in us))
    label = " + ".join(_unit_name(opt, u, names or {}) for u in pair)
    return shards + size[0] + sum(size[u] for u in pair), f"root unit + {label} gathered"


PEAKS = {"gradients": gradient_peak, "parameters": gathered_peak}  # a sharded category's probe
