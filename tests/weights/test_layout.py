"""ParallelLayout: stage layer counts / offsets (incl. uneven stages) and Megatron vocab padding."""
from __future__ import annotations

import pytest

from nemo_tlt.weights.layout import ParallelLayout


def test_even_stages():
    lay = ParallelLayout(tp=2, pp=2)
    assert lay.stage_layer_counts(4) == [2, 2]
    assert lay.stage_layer_offsets(4) == [0, 2]
    assert lay.global_layer(1, 1, 4) == 3


def test_uneven_stages_follow_megatron_rule():
    assert ParallelLayout(pp=3, num_layers_in_first_stage=1).stage_layer_counts(7) == [1, 3, 3]
    assert ParallelLayout(pp=3, num_layers_in_last_stage=1).stage_layer_counts(5) == [2, 2, 1]
    lay = ParallelLayout(pp=3, num_layers_in_first_stage=2, num_layers_in_last_stage=1)
    assert lay.stage_layer_counts(6) == [2, 3, 1]
    assert lay.stage_layer_offsets(6) == [0, 2, 5]


@pytest.mark.parametrize("vocab,tp,padded", [(100, 1, 128), (100, 2, 256), (256, 2, 256), (257, 2, 512)])
def test_vocab_padding(vocab, tp, padded):
    assert ParallelLayout(tp=tp).padded_vocab_size(vocab) == padded


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="tp"):
        ParallelLayout(tp=0)
    with pytest.raises(ValueError, match="num_layers_in_first_stage"):
        ParallelLayout(pp=1, num_layers_in_first_stage=1)
    with pytest.raises(ValueError, match="cannot be split"):
        ParallelLayout(pp=2).stage_layer_counts(3)
    with pytest.raises(ValueError, match="out of range"):
        ParallelLayout(pp=2).global_layer(0, 2, 4)
