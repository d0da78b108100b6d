"""``PoolingParams``: vLLM's fields, validated at construction (ValueError naming the field)."""

from __future__ import annotations

import pytest

from kvflow.pooling_params import PoolingParams


def test_defaults_and_names():
    assert PoolingParams().l2_normalize is True
    assert PoolingParams(normalize=False).l2_normalize is False
    assert PoolingParams(use_activation=False).l2_normalize is False  # vLLM 0.32's name
    assert PoolingParams(pooling_type="MEAN").pooling_type == "mean"  # vLLM's upper-case names
    assert PoolingParams(pooling_type="mean").needs_every_position
    assert not PoolingParams(pooling_type="last").needs_every_position
    assert PoolingParams().resolved("mean").pooling_type == "mean"
    assert PoolingParams(pooling_type="last").resolved("mean").pooling_type == "last"
    assert PoolingParams(task="embed", normalize=True, use_activation=True).l2_normalize


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"pooling_type": "cls"}, "pooling_type"),
        ({"pooling_type": 3}, "pooling_type"),
        ({"normalize": "yes"}, "normalize"),
        ({"use_activation": 1}, "use_activation"),
        ({"normalize": True, "use_activation": False}, "normalize"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"task": "classify"}, "task"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        PoolingParams(**kwargs)
