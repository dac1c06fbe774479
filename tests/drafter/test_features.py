"""The drafter feature layout: captured layers in capture order, then the final state."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.drafter.features import feature_width, join_features, split_features


def test_layout_round_trip_and_forms():
    final = torch.full((2, 3, 4), 9.0)
    layers = [torch.full((2, 3, 4), float(i)) for i in (5, 1, 5)]  # capture order, a repeat allowed
    joined = join_features(final, layers)
    assert joined.shape == (2, 3, feature_width(4, (5, 1, 5))) == (2, 3, 16)
    assert joined[0, 0].tolist() == [5.0] * 4 + [1.0] * 4 + [5.0] * 4 + [9.0] * 4
    assert torch.equal(join_features(final, torch.cat(layers, -1)), joined)
    captured, back = split_features(joined, 3)
    assert torch.equal(captured, torch.cat(layers, -1)) and torch.equal(back, final)
    assert join_features(final, None) is final and join_features(final, []) is final
    assert feature_width(4, None) == 4


def test_split_refuses_a_width_of_another_layout():
    with pytest.raises(ValueError, match="10 wide, not a multiple of 4"):
        split_features(torch.zeros(2, 10), 3)
