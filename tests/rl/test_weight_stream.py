"""The weight-sync stream passes every tensor through unchanged, keeps references on
request, updates the drafter's view, and digests any dtype (bfloat16 included)."""
import pytest
import torch

from nemo_tlt.drafter.target_view import TargetView
from nemo_tlt.rl.weight_stream import WeightStream
from tiny import tiny_target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_digests_any_dtype_and_tells_replicas_apart(dtype):
    weights = {k: v.to(dtype) for k, v in tiny_target().state_dict().items()}
    a, b = WeightStream(weights.items(), keep=True), WeightStream(weights.items())
    assert [n for n, _ in a] == list(weights) and len(list(b)) == len(weights)
    assert a.hexdigest() == b.hexdigest() and a.kept.keys() == weights.keys() and not b.kept
    changed = dict(weights)
    name = next(iter(changed))
    changed[name] = changed[name].clone()
    changed[name].view(-1)[0] += 1
    c = WeightStream(changed.items())
    list(c)
    assert c.hexdigest() != a.hexdigest()


def test_stream_updates_the_view():
    target = tiny_target()
    view = TargetView(target.config).load(tiny_target(seed=1).state_dict())
    list(WeightStream(target.state_dict().items(), view=view))
    assert torch.equal(view.model.embed_tokens.weight, target.model.embed_tokens.weight)


def test_without_digest_the_stream_hashes_and_copies_nothing(monkeypatch):
    """``digest=False`` (debug.weight_digests off for the step): no tensor is copied to the host
    or hashed, ``hexdigest`` is None; with it, the hashing's seconds are counted."""
    import nemo_tlt.rl.weight_stream as ws

    weights = tiny_target().state_dict()
    calls = []
    monkeypatch.setattr(ws, "_bytes", lambda t: calls.append(t) or b"")
    off = WeightStream(weights.items(), digest=False)
    assert [n for n, _ in off] == list(weights)
    off.add(tiny_target())
    assert calls == [] and off.hexdigest() is None and off.digest_s == 0.0
    on = WeightStream(weights.items())
    list(on)
    assert len(calls) == len(weights) and on.digest_s > 0.0 and on.hexdigest() is not None


def test_digests_every_n_steps_and_at_the_last():
    from nemo_tlt.config import DebugConfig

    assert [s for s in range(10) if DebugConfig(3).digest_at(s, 9)] == [0, 3, 6, 9]
    assert [s for s in range(10) if DebugConfig(1).digest_at(s, 9)] == list(range(10))
    assert not any(DebugConfig().digest_at(s, 9) for s in range(10))  # off by default
    with pytest.raises(ValueError, match="debug.weight_digests"):
        DebugConfig(-1)
