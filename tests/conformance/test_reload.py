"""Weight and drafter reload between generate calls, and strict weight streams."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.model.hf_io import read_config, read_state_dict
from nemo_tlt.rollout.protocol import RolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from suite_helpers import requests, tokens

REQS = requests([3, 6, 2], seed=4)
SHAPE = TreeShape(3, 2, 5)


@pytest.fixture(scope="module")
def repeatable(make_engine) -> SamplingParams:
    """Sampling that repeats its tokens on every call (coupled where the engine runs it)."""
    return make_engine.reproducible(temperature=1.0, max_new_tokens=16, seed=2, stop_on_eos=False)


def test_is_a_rollout_engine_serving_the_folders_model(make_engine, model_dir):
    engine = make_engine(model_dir)
    assert isinstance(engine, RolloutEngine)
    assert engine.model_config == read_config(model_dir)


@pytest.mark.parametrize("form", ["dict", "stream"])
def test_reloaded_weights_generate_what_a_fresh_engine_does(make_engine, model_dir, other_model_dir, form, repeatable):
    engine, fresh_other, fresh_own = make_engine(model_dir), make_engine(other_model_dir), make_engine(model_dir)
    engine.load_drafter(make_engine.first_drafter(("eagle", "eagle3"), engine.model_config))
    own, other = read_state_dict(model_dir), read_state_dict(other_model_dir)
    as_form = (lambda sd: dict(sd)) if form == "dict" else (lambda sd: ((k, v) for k, v in reversed(sd.items())))
    before = tokens(engine.generate(REQS, repeatable))
    assert before == tokens(fresh_own.generate(REQS, repeatable))
    engine.load_policy_weights(as_form(other))
    expected = tokens(fresh_other.generate(REQS, repeatable))
    assert expected != before, "the two models must differ for this test to mean anything"
    assert tokens(engine.generate(REQS, repeatable)) == expected
    assert tokens(engine.generate(REQS, repeatable, policy=FixedSDPolicy(SHAPE))) == expected
    engine.load_policy_weights(as_form(own))
    assert tokens(engine.generate(REQS, repeatable)) == before


def _stream(state, drop=None, add=None, reshape=None):
    for name, tensor in state.items():
        if name == drop:
            continue
        yield name, (tensor[:-1] if name == reshape else tensor)
    if add is not None:
        yield add, torch.zeros(1)


@pytest.mark.parametrize("bad, name", [
    (dict(add="model.layers.9.mlp.up_proj.weight"), "model.layers.9.mlp.up_proj.weight"),
    (dict(reshape="model.layers.1.self_attn.k_proj.weight"), "model.layers.1.self_attn.k_proj.weight"),
    (dict(drop="model.layers.1.post_attention_layernorm.weight"), "model.layers.1.post_attention_layernorm.weight"),
    (dict(drop="lm_head.weight"), "lm_head.weight"),
], ids=["unknown", "wrong_shape", "missing_norm", "missing_head"])
def test_a_bad_stream_is_refused_naming_the_tensor(make_engine, model_dir, other_model_dir, bad, name, repeatable):
    engine = make_engine(model_dir)
    before = tokens(engine.generate(REQS, repeatable))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        engine.load_policy_weights(_stream(read_state_dict(other_model_dir), **bad))
    # a half-written model is never served: generate refuses until a complete load; an
    # engine that sends buckets may have written nothing yet, and then serves the model as it was
    if make_engine.spec.writes_as_it_streams:
        with pytest.raises(ValueError, match="load_policy_weights"):
            engine.generate(REQS, repeatable)
    else:
        try:
            served = tokens(engine.generate(REQS, repeatable))
        except ValueError as err:
            assert "load_policy_weights" in str(err), err
        else:
            assert served == before, "a half-written model was served"
    engine.load_policy_weights(read_state_dict(model_dir))
    assert tokens(engine.generate(REQS, repeatable)) == before


def test_a_stream_refused_before_any_write_leaves_the_model_served(make_engine, model_dir, other_model_dir, repeatable):
    engine = make_engine(model_dir)
    before = tokens(engine.generate(REQS, repeatable))
    with pytest.raises(ValueError, match="nonexistent"):
        engine.load_policy_weights({"nonexistent.weight": torch.zeros(1), **read_state_dict(other_model_dir)})
    assert tokens(engine.generate(REQS, repeatable)) == before
    with pytest.raises(ValueError, match="given twice"):
        engine.load_policy_weights(list(read_state_dict(other_model_dir).items()) * 2)


def test_drafter_reload_changes_speed_not_tokens(make_engine, model_dir):
    engine = make_engine(model_dir)
    sp = SamplingParams(mode="greedy", max_new_tokens=24, stop_on_eos=False)
    base = tokens(engine.generate(REQS, sp))
    kinds = [k for k in ("oracle", "adversarial", "eagle", "eagle3") if k in make_engine.spec.drafter_kinds]
    accepts = {}
    for kind in kinds:
        engine.load_drafter(make_engine.drafter(kind, engine.model_config))
        out = engine.generate(REQS, sp, policy=FixedSDPolicy(SHAPE))
        assert tokens(out) == base, kind
        accepts[kind] = out.stats.mean_accept_len
    if make_engine.spec.step_stats and {"oracle", "adversarial"} <= set(kinds):
        assert accepts["oracle"] > accepts["adversarial"] + 1.0, accepts
    engine.load_drafter(None)
    with pytest.raises(ValueError, match="no drafter"):
        engine.generate(REQS, sp, policy=FixedSDPolicy(SHAPE))
    assert tokens(engine.generate(REQS, sp)) == base
    assert tokens(engine.generate(REQS, sp, policy=FixedSDPolicy(None))) == base
