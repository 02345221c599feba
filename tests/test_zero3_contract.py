"""zerokit.zero3's public contract: what lesson 05's grader and readers use instead of copying.

- `unit_list` and `bucket_plan` are the layout ZeRO3Adam builds (one bucket per unit, the
  last unit first, a tied weight in the root unit);
- `bucket_state` names where a bucket is (UnitState, as FSDP2's ShardedState): SHARDED at
  rest, GATHERING while its all-gather is in flight, GATHERED once installed, SHARDED again
  after _free, on a unit prefetched and never used too.
"""

import pytest
import torch

from conftest import run_ranks
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
    opt._start_gather(0)
    seen.append(opt.bucket_state(0))
    opt._finish_gather(0)
    seen.append(opt.bucket_state(0))
    opt._free(0)
    seen.append(opt.bucket_state(0))
    opt._start_gather(1)  # a prefetch nobody uses
    opt._free(1)
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
