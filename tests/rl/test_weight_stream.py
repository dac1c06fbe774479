"""The weight-sync stream passes every tensor through unchanged, keeps references on
request, updates the drafter's view, and digests any dtype (bfloat16 included)."""
import pytest
import torch

from nemo_tlt.drafter.target_view import TargetView
from nemo_tlt.rl.weight_stream import WeightStream
from tests.tiny import tiny_target


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
