"""zerokit.zero3's public contract: what lesson 05's grader and readers use instead of copying.

- `unit_list` and `bucket_plan` are the layout ZeRO3Adam builds (one bucket per unit, the
  last unit first, a tied weight in the root unit);
- `bucket_state` names where a bucket is (UnitState, as FSDP2's ShardedState): SHARDED at
  rest, GATHERING while its all-gather is in flight, GATHERED once installed, SHARDED again
  after free(), on a unit prefetched and never used too;
- one full-size transfer at a time (ZeRO3Adam.finish_transfers, ZeRO3Adam._before_send): on a
  transformer with a unit per block, no reduce-scatter is in flight when a prefetch starts,
  no gather is in flight when a reduce-scatter starts, and the unit being reduced is
  already SHARDED; backward's prefetch overlaps the unit's compute: at most one gather (the next
  unit's) is in flight when a unit's backward begins; with
  *lazy* collectives (test doubles whose output is NaN until wait()
  and whose input is read only at wait()), the numbers are bitwise those of the real ones,
  so none of the earlier waits reads a buffer before its transfer is done.
"""

import pytest
import torch

from conftest import LazyWork, run_ranks
from zerokit.models import build_model, model_batch, model_loss
from zerokit.zero3 import UnitState, ZeRO3Adam, bucket_plan, unit_list

pytestmark = pytest.mark.distributed


def _states(rank, world_size):
    model = build_model("awkward")
    opt = ZeRO3Adam(model, lr=1e-3)
    units = unit_list(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan = bucket_plan(units, trainable)
    layout = ([u for u, _ in plan] == opt.bucket_units
              and all(list(mine) == list(b.params) for (_, mine), b in zip(plan, opt.buckets))
              and plan[-1][0] == 0 and model.embed.weight in plan[-1][1])  # the tied weight: root, sent last
    seen = [opt.bucket_state(0)]
    opt.start_gather(0)
    seen.append(opt.bucket_state(0))
    opt.finish_gather(0)
    seen.append(opt.bucket_state(0))
    opt.free(0)
    seen.append(opt.bucket_state(0))
    opt.start_gather(1)  # a prefetch nobody uses
    opt.free(1)
    seen.append(opt.bucket_state(1))
    x, y = model_batch("awkward", 4, 0)
    model_loss("awkward", model(x), y).backward()
    opt.step()
    at_rest = {opt.bucket_state(bi) for bi in range(len(opt.buckets))}
    return layout, seen, at_rest


@pytest.mark.timeout(60)
def test_the_plan_is_the_layout_and_each_bucket_moves_through_named_states():
    for layout, seen, at_rest in run_ranks(_states, 2):
        assert layout
        assert seen == [UnitState.SHARDED, UnitState.GATHERING, UnitState.GATHERED, UnitState.SHARDED,
                        UnitState.SHARDED]
        assert at_rest == {UnitState.SHARDED}


def _lazy(real, watch):
    """A collective whose output is NaN until wait() and whose input is read only then;
    watch(output, input) sees each asynchronous call as it is issued."""
    def collective(output, input, *args, async_op=False, **kwargs):
        if not async_op:
            return real(output, input, *args, **kwargs)
        watch(output, input)
        output.fill_(float("nan"))
        return LazyWork(lambda: real(output, input, *args, **kwargs))
    return collective


class _Watched(ZeRO3Adam):
    """ZeRO3Adam telling `watch` how many gathers are in flight as a unit's backward begins."""
    watch = None

    def pre_backward(self, u, grad):
        super().pre_backward(u, grad)
        self.watch(("backward", len(self.gathering)))


def _one_transfer_at_a_time(rank, world_size, lazy):
    real_gather, real_reduce = ZeRO3Adam.gather_collective, ZeRO3Adam.reduce_collective
    seen, box = [], {}

    def gathering(output, input):
        opt = box["opt"]
        seen.append(("gather", len(opt._in_flight), len(opt.gathering)))

    def reducing(output, input):
        opt = box["opt"]  # ZeRO-2's send sets _next past the bucket after its reduce-scatter
        seen.append(("reduce", len(opt.gathering), opt.bucket_state(opt._next).value))

    model = build_model("transformer")
    opt = box["opt"] = _Watched(model, lr=1e-2, weight_decay=0.1, units=list(model.blocks))
    opt.watch = seen.append
    if lazy:  # the collectives swapped as lesson 11's qwZ and hybrid sharding swap them
        opt.gather_collective = _lazy(real_gather, gathering)
        opt.reduce_collective = _lazy(real_reduce, reducing)
    losses = []
    for step in range(3):
        x, y = model_batch("transformer", 4, 10 * step + rank)
        loss = model_loss("transformer", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with opt.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    return losses, weights, seen


@pytest.mark.timeout(120)
def test_one_full_size_transfer_at_a_time_and_lazy_collectives_change_no_bit():
    eager = run_ranks(_one_transfer_at_a_time, 2, False)
    lazy = run_ranks(_one_transfer_at_a_time, 2, True)
    for (losses, weights, _), (lazy_losses, lazy_weights, seen) in zip(eager, lazy):
        assert losses == lazy_losses
        assert all(torch.equal(a, b) for a, b in zip(weights, lazy_weights))
        assert all(torch.isfinite(w).all() for w in lazy_weights)
        gathers = [s for s in seen if s[0] == "gather"]
        reduces = [s for s in seen if s[0] == "reduce"]
        assert len(reduces) == 3 * 3 and len(gathers) >= 3 * 2 * 2  # two blocks and the root, each step
        # a gather starts with no reduce-scatter and no other gather in flight
        assert all(rs == 0 and ag == 0 for _, rs, ag in gathers), gathers
        # a reduce-scatter starts with no gather in flight, its unit's weights already freed
        assert all(g == 0 and state == "sharded" for _, g, state in reduces), reduces
        # a unit's backward computes with at most one gather in flight, the next unit's prefetch, and
        # some do (the prefetch overlaps the unit's compute, on gloo as on NCCL)
        backwards = [s for s in seen if s[0] == "backward"]
        assert len(backwards) == 3 * 3 and all(g <= 1 for _, g in backwards), backwards
        assert sum(g for _, g in backwards) == 3 * 2, backwards  # the root's and the last block's backward
