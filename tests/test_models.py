"""The zoo's fixture models create the situations their docstrings promise."""

import pytest
import torch

from zerokit.flat import FlatBucket
from zerokit.models import build_model, model_batch, model_loss, num_parameters
from zerokit.zero3 import assign_units, default_units


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sparse_embed_gives_some_rank_a_whole_segment_of_zero_gradient(world_size):
    model = build_model("sparse-embed")
    x, y = model_batch("sparse-embed", 8, seed=3)
    model_loss("sparse-embed", model(x), y).backward()
    params = list(model.parameters())
    assert all(p.grad is not None for p in params)
    zero_segments = 0
    for rank in range(world_size):
        bucket = FlatBucket(params, world_size, rank)
        for s in bucket.segments:
            grad = params[s.index].grad.reshape(-1)[s.param_lo:s.param_hi]
            zero_segments += bool(grad.numel()) and not grad.any()
    assert zero_segments >= 1
    assert num_parameters(model) % world_size != 0


def test_awkward_units_return_a_tuple_and_a_dict_and_the_root_owns_the_tied_weight():
    model = build_model("awkward")
    x, _ = model_batch("awkward", 4, seed=0)
    assert isinstance(model.attn(model.embed(x)), tuple)
    assert isinstance(model.mix(model.embed(x)), dict)
    units = [model] + [m for m in default_units(model) if m is not model]
    owner = assign_units(units)
    assert owner[model.embed.weight] == 0  # the root unit
    assert model.head.weight is model.embed.weight
    assert torch.isfinite(model(x)).all()
