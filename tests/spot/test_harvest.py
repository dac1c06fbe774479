"""Tests for nemo_tlt.spot.harvest: validation, byte bound, recency window and weights."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig

H = 8


def _seq(length: int, seed: int = 0, hidden_size: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (length,), generator=g), torch.randn(length, hidden_size, generator=g)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="hidden_size"):
        HarvestConfig(hidden_size=0)
    with pytest.raises(ValueError, match="min_length"):
        HarvestConfig(hidden_size=4, min_length=1)
    with pytest.raises(ValueError, match="recency_decay"):
        HarvestConfig(hidden_size=4, recency_decay=0.0)
    with pytest.raises(ValueError, match="hidden_dtype"):
        HarvestConfig(hidden_size=4, hidden_dtype="int8")
    with pytest.raises(ValueError, match="topk"):
        HarvestConfig(hidden_size=4, topk=-1)


def test_add_stores_compact_private_copy():
    buf = HarvestBuffer(HarvestConfig(hidden_size=H, hidden_dtype="float16"))
    big_tokens, big_hidden = _seq(20)
    sample = buf.add(big_tokens[:5].to(torch.int32), big_hidden[:4], step=0)
    assert sample.token_ids.dtype == torch.int64 and sample.hidden.dtype == torch.float16
    assert torch.equal(sample.token_ids, big_tokens[:5])
    torch.testing.assert_close(sample.hidden.float(), big_hidden[:4], atol=1e-2, rtol=1e-2)
    # A private copy: it does not alias (and so does not keep alive) the caller's tensor.
    assert sample.hidden.untyped_storage().nbytes() == 4 * H * 2
    big_hidden.zero_()
    assert sample.hidden.abs().sum() > 0
    st = buf.state
    assert (st.samples, st.tokens, st.bytes) == (1, 5, 5 * 8 + 4 * H * 2)
    # The drafter's training view: L tokens, L - 1 features (hidden[t] predicts token t+1).
    ds = sample.to_drafter_sample()
    assert ds.tokens.shape == (5,) and ds.hidden.shape == (4, H) and ds.num_pairs == 3


def test_add_with_one_row_per_token_drops_the_last_row():
    buf = HarvestBuffer(HarvestConfig(hidden_size=H, hidden_dtype="float32"))
    tokens, hidden = _seq(6)
    sample = buf.add(tokens, hidden, step=0)
    assert torch.equal(sample.hidden, hidden[:5])


@pytest.mark.parametrize(
    "tokens, hidden, match",
    [
        (torch.zeros(4, dtype=torch.long), torch.zeros(4, H + 1), "hidden size 9"),
        (torch.zeros(4, dtype=torch.long), torch.zeros(2, H), "2 positions but token_ids has 4 tokens"),
        (torch.zeros(4, dtype=torch.long), torch.zeros(5, H), "expected 3 .* or 4"),
        (torch.zeros(4, 1, dtype=torch.long), torch.zeros(4, H), "1-D"),
        (torch.zeros(4), torch.zeros(4, H), "integer"),
        (torch.zeros(2, dtype=torch.long), torch.zeros(1, H), "min_length"),
        (torch.zeros(4, dtype=torch.long), torch.zeros(4, H, dtype=torch.long), "floating 2-D"),
    ],
)
def test_add_refuses_bad_shapes(tokens, hidden, match):
    buf = HarvestBuffer(HarvestConfig(hidden_size=H))
    with pytest.raises(ValueError, match=match):
        buf.add(tokens, hidden, step=0)
    assert len(buf) == 0


def test_topk_validation_and_storage():
    buf = HarvestBuffer(HarvestConfig(hidden_size=H, topk=3))
    tokens, hidden = _seq(6)
    with pytest.raises(ValueError, match="requires both"):
        buf.add(tokens, hidden, step=0)
    with pytest.raises(ValueError, match=r"topk_values must have shape \(6, 3\)"):
        buf.add(tokens, hidden, step=0, topk_values=torch.zeros(6, 2), topk_indices=torch.zeros(6, 3, dtype=torch.long))
    s = buf.add(tokens, hidden, step=0, topk_values=torch.randn(6, 3), topk_indices=torch.arange(18).view(6, 3))
    assert s.topk_indices.dtype == torch.int64 and s.topk_values.dtype == torch.bfloat16
    assert torch.equal(s.topk_indices, torch.arange(15).view(5, 3))  # trimmed like hidden
    plain = HarvestBuffer(HarvestConfig(hidden_size=H))
    with pytest.raises(ValueError, match="topk=0"):
        plain.add(tokens, hidden, step=0, topk_values=torch.zeros(6, 3),
                  topk_indices=torch.zeros(6, 3, dtype=torch.long))


def test_byte_bound_evicts_oldest_first():
    per_sample = 4 * 8 + 3 * H * 2
    buf = HarvestBuffer(HarvestConfig(hidden_size=H, max_bytes=3 * per_sample))
    for i in range(5):
        tokens, hidden = _seq(4, seed=i)
        tokens[0] = i  # tag
        buf.add(tokens, hidden, step=0)
        assert buf.state.bytes <= 3 * per_sample
    assert [int(s.token_ids[0]) for s in buf.samples()] == [2, 3, 4]
    assert buf.state.evicted_for_space == 2
    with pytest.raises(ValueError, match="max_bytes"):
        buf.add(*_seq(40), step=0)


def test_step_window_and_advance_drops_stale():
    buf = HarvestBuffer(HarvestConfig(hidden_size=H, keep_steps=2), start_step=10)
    buf.add(*_seq(3), step=10)
    with pytest.raises(ValueError, match="advance_step"):
        buf.add(*_seq(3), step=11)
    buf.advance_step()
    buf.add(*_seq(4), step=11)
    buf.add(*_seq(5), step=10)  # the step before is still live
    with pytest.raises(ValueError, match="live window"):
        buf.add(*_seq(3), step=9)
    assert buf.advance_step() == 2  # both step-10 samples are now 2 steps old
    assert [s.step for s in buf.samples()] == [11]
    assert buf.state.tokens == 4 and buf.state.bytes == 4 * 8 + 3 * H * 2 and buf.state.dropped_stale == 2
    with pytest.raises(ValueError, match="new_step"):
        buf.advance_step(5)


def test_recency_weighted_sampling_is_seeded_and_weighted():
    buf = HarvestBuffer(HarvestConfig(hidden_size=H, recency_decay=0.25))
    old_tokens, hidden = _seq(3)
    old_tokens[0] = -1
    buf.add(old_tokens, hidden, step=0)
    buf.advance_step()
    new_tokens, hidden = _seq(3)
    new_tokens[0] = 1
    buf.add(new_tokens, hidden, step=1)
    assert buf.sampling_weights().tolist() == [0.25, 1.0]
    draws = buf.sample_batch(4000, torch.Generator().manual_seed(0))
    frac_old = sum(int(s.token_ids[0]) == -1 for s in draws) / len(draws)
    assert abs(frac_old - 0.2) < 0.03  # 0.25 / 1.25
    a = [int(s.token_ids[0]) for s in buf.sample_batch(50, torch.Generator().manual_seed(7))]
    b = [int(s.token_ids[0]) for s in buf.sample_batch(50, torch.Generator().manual_seed(7))]
    assert a == b
    # Without replacement while the buffer is large enough: no duplicates.
    pair = buf.sample_batch(2, torch.Generator().manual_seed(3))
    assert {int(s.token_ids[0]) for s in pair} == {-1, 1}


def test_sample_batch_errors():
    buf = HarvestBuffer(HarvestConfig(hidden_size=H))
    with pytest.raises(ValueError, match="empty"):
        buf.sample_batch(1, torch.Generator())
    buf.add(*_seq(3), step=0)
    with pytest.raises(ValueError, match="positive int"):
        buf.sample_batch(0, torch.Generator())
