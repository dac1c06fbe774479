"""Bad input is a ValueError naming the field, raised before any decoding."""
from __future__ import annotations

import pytest

from nemo_tlt.rollout.protocol import Request
from nemo_tlt.speculative.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(make_engine, model_dir):
    return make_engine(model_dir)


def _with(sp: SamplingParams, **fields) -> SamplingParams:
    """`sp` with fields set past its constructor's checks (as a mutated frozen object would be)."""
    for name, value in fields.items():
        object.__setattr__(sp, name, value)
    return sp


@pytest.mark.parametrize("reqs, match", [
    ([Request((3, 4)), Request(())], r"requests\[1\]\.prompt is empty"),
    ([Request((3, 32))], r"requests\[0\]\.prompt .*vocab"),
    ([Request((3, -1, 4))], r"requests\[0\]\.prompt .*vocab"),
    ([Request((3,) * 505)], r"requests\[0\]\.prompt .*max_new_tokens.*max_position_embeddings"),
    ([], "requests"),
    ([(3, 4)], r"requests\[0\]"),
], ids=["empty_prompt", "token_past_vocab", "negative_token", "beyond_context", "no_requests", "not_a_request"])
def test_bad_requests_name_the_field(engine, reqs, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(reqs, SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize("sampling, match", [
    ("greedy", "sampling"),
    (_with(SamplingParams(), temperature=0.0), "temperature"),
    (_with(SamplingParams(), top_p=1.5), "top_p"),
    (_with(SamplingParams(), max_new_tokens=0), "max_new_tokens"),
    (_with(SamplingParams(), max_new_tokens=4.5), "max_new_tokens"),
    (_with(SamplingParams(), top_k=-1), "top_k"),
    (_with(SamplingParams(), mode="beam"), "mode"),
], ids=["not_sampling_params", "temperature", "top_p", "max_new_tokens", "float_max_new_tokens", "top_k", "mode"])
def test_bad_sampling_names_the_field(engine, sampling, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([Request((3, 4))], sampling)


def test_the_context_bound_is_exact(engine):
    """prompt + max_new_tokens == max_position_embeddings fits; one more does not."""
    ctx = engine.model_config.max_position_embeddings
    out = engine.generate([Request((3,) * (ctx - 2))], SamplingParams(max_new_tokens=2, stop_on_eos=False))
    assert len(out.results[0].tokens) == 2
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([Request((3,) * (ctx - 1))], SamplingParams(max_new_tokens=2))
