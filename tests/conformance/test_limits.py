"""What an engine declares it cannot do (engines.py) it refuses by name: the suite
skips those cases, and this file checks the refusals instead of trusting them."""
from __future__ import annotations

import pytest

from engines import MODES
from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from suite_helpers import DRAFTERS, make_drafter, requests


@pytest.fixture
def engine(make_engine, model_dir):
    if not make_engine.spec.limits_phrases():
        pytest.skip(f"the {make_engine.spec.name} engine declares no limits")
    return make_engine(model_dir)


def test_an_undeclared_mode_is_refused_by_name(make_engine, engine):
    refused = [m for m in MODES if m not in make_engine.spec.modes]
    if not refused:
        pytest.skip("runs every sampling mode")
    for mode in refused:
        with pytest.raises(ValueError, match=mode):
            engine.generate(requests([3, 5]), SamplingParams(mode=mode, max_new_tokens=4))


def test_return_hidden_is_refused_where_not_declared(make_engine, engine):
    if make_engine.spec.hidden_states:
        pytest.skip("returns hidden states")
    with pytest.raises(ValueError, match="return_hidden"):
        engine.generate(requests([3, 5]), SamplingParams(max_new_tokens=4), return_hidden=True)


def test_without_step_stats_none_are_made_up(make_engine, engine):
    """An engine that declares no per-step stats reports zeros, not estimates."""
    if make_engine.spec.step_stats:
        pytest.skip("reports per-step stats")
    out = engine.generate(requests([3, 5]), SamplingParams(max_new_tokens=4, stop_on_eos=False))
    stats = out.stats
    assert stats.tokens_generated == 8
    assert (stats.target_forwards, stats.sd_steps, stats.plain_steps, stats.trace) == (0, 0, 0, [])


def test_a_drafter_module_is_refused_where_folders_are_loaded(make_engine, engine):
    if make_engine.spec.drafter_form == "module":
        pytest.skip("loads drafter modules")
    if make_engine.spec.eagle3_modules:  # an EAGLE-3 module is its export; any other kind is refused
        with pytest.raises(ValueError, match="EAGLE-3"):
            engine.load_drafter(make_drafter("eagle", engine.model_config))
        return
    with pytest.raises(ValueError, match=make_engine.spec.drafter_form):
        engine.load_drafter(make_drafter("eagle3", engine.model_config))


def test_rejection_top_k_while_speculating_is_refused_where_not_declared(make_engine, engine):
    if make_engine.spec.sd_top_k:
        pytest.skip("samples with top-k while speculating")
    engine.load_drafter(make_engine.first_drafter(DRAFTERS, engine.model_config))
    sp = SamplingParams(mode="rejection", temperature=0.8, top_k=5, max_new_tokens=4)
    with pytest.raises(ValueError, match="top_k"):
        engine.generate(requests([3, 5]), sp, policy=FixedSDPolicy(TreeShape(4, 1, 4)))
    with pytest.raises(ValueError, match="top_k"):  # the engine can speculate: plain decoding too (engines.py)
        engine.generate(requests([3, 5]), sp)
