"""Stop conditions and hidden states: EOS ends a row (kept as its last token),
max_new_tokens ends the rest; returned hidden states are the target's own (its final
ones, or with an EAGLE-3 drafter the layers that drafter captures)."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from suite_helpers import requests, tokens

POLICIES = [None, FixedSDPolicy(TreeShape(3, 2, 5)), FixedSDPolicy(TreeShape(4, 1, 4))]
POLICY_IDS = ["plain", "tree_3_2_5", "chain_4"]


@pytest.fixture(scope="module")
def engine(make_engine, model_dir):
    engine = make_engine(model_dir)
    engine.load_drafter(make_engine.first_drafter(("oracle", "eagle3"), engine.model_config))
    return engine


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_eos_and_length_stop_rows_of_one_batch(make_engine, engine, policy):
    eos = engine.model_config.eos_token_id
    reqs = requests([3, 5, 2, 4] * 4, seed=2)
    sp = SamplingParams(mode=make_engine.sampled_mode(), temperature=1.5, max_new_tokens=30, seed=3)
    out = engine.generate(reqs, sp, policy=policy)
    assert len(out.results) == len(reqs)
    for res in out.results:
        if res.stop_reason == "eos":
            assert res.tokens[-1] == eos and eos not in res.tokens[:-1] and len(res.tokens) <= 30
        else:
            assert res.stop_reason == "length" and len(res.tokens) == 30 and eos not in res.tokens
    eos_lengths = {len(r.tokens) for r in out.results if r.stop_reason == "eos"}
    assert len(eos_lengths) >= 2 and any(r.stop_reason == "length" for r in out.results), eos_lengths
    if sp.mode != "coupled":
        return
    # each row is the one the request gives alone: rows of other lengths do not disturb it
    for i in (0, 5, 10):
        assert tokens(engine.generate([reqs[i]], sp, policy=policy)) == [out.results[i].tokens]


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_without_stop_on_eos_every_row_runs_to_max_new_tokens(make_engine, engine, policy):
    reqs = requests([3, 5, 2, 4] * 4, seed=2)
    sp = SamplingParams(mode=make_engine.sampled_mode(), temperature=1.5, max_new_tokens=30, seed=3, stop_on_eos=False)
    out = engine.generate(reqs, sp, policy=policy)
    assert all(r.stop_reason == "length" and len(r.tokens) == 30 for r in out.results)
    assert any(engine.model_config.eos_token_id in r.tokens for r in out.results), "EOS should be sampled"


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_hidden_states_are_the_targets_own(make_engine, engine, reference, mode, policy):
    make_engine.require(mode=mode, hidden=True)
    reqs = requests([4, 1, 7, 3], seed=6)
    sp = SamplingParams(mode=mode, temperature=1.2, max_new_tokens=20, seed=5)
    out = engine.generate(reqs, sp, policy=policy, return_hidden=True)
    if policy is not None:
        assert out.stats.sd_steps > 0
    for r, res in zip(reqs, out.results):
        seq = torch.tensor([list(r.prompt) + res.tokens])
        with torch.no_grad():
            expected = reference.hidden(seq)[0, :-1]
        assert res.hidden_states.shape == (len(r.prompt) + len(res.tokens) - 1, engine.model_config.hidden_size)
        torch.testing.assert_close(res.hidden_states, expected, atol=1e-4, rtol=1e-4)
    assert all(r.hidden_states is None for r in engine.generate(reqs, sp, policy=policy).results)


def test_plain_greedy_is_the_targets_argmax(engine, reference):
    reqs = requests([4, 1, 7], seed=0)
    out = engine.generate(reqs, SamplingParams(max_new_tokens=12, stop_on_eos=False))
    for r, res in zip(reqs, out.results):
        with torch.no_grad():
            logits = reference(torch.tensor([list(r.prompt) + res.tokens]))[0]
        assert logits[len(r.prompt) - 1: -1].argmax(-1).tolist() == res.tokens


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_with_an_eagle3_drafter_hidden_states_are_the_captured_layers(make_engine, model_dir, reference, policy):
    """With a drafter that declares capture_layers, each row carries the outputs of
    those target layers (concatenated), then the final hidden state, from the
    rollout's own forwards."""
    make_engine.require(mode="coupled", hidden=True)
    engine = make_engine(model_dir)
    engine.load_drafter(make_engine.drafter("eagle3", engine.model_config))
    layers = engine.drafter.capture_layers
    reqs = requests([4, 1, 7, 3], seed=6)
    sp = SamplingParams(mode="coupled", temperature=1.2, max_new_tokens=20, seed=5)
    out = engine.generate(reqs, sp, policy=policy, return_hidden=True)
    if policy is not None:
        assert out.stats.sd_steps > 0
    for r, res in zip(reqs, out.results):
        seq = torch.tensor([list(r.prompt) + res.tokens])
        with torch.no_grad():
            hidden, captured = reference.hidden_capture(seq, layers)
            expected = torch.cat((captured, hidden), -1)[0, :-1]
        assert res.hidden_states.shape == (seq.shape[1] - 1, (len(layers) + 1) * engine.model_config.hidden_size)
        torch.testing.assert_close(res.hidden_states, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_on_finish_sees_each_result_once(make_engine, engine, policy):
    """``on_finish`` gets every request once, with the object ``results`` returns; an engine
    with per-step stats (it retires rows as they finish) calls it in the order rows finish."""
    reqs = requests([3, 5, 2, 4] * 4, seed=2)
    sp = SamplingParams(mode=make_engine.sampled_mode(), temperature=1.5, max_new_tokens=30, seed=3)
    seen: list[tuple[int, object, int]] = []
    out = engine.generate(reqs, sp, policy=policy, on_finish=lambda i, r: seen.append((i, r, len(r.tokens))))
    assert sorted(i for i, _, _ in seen) == list(range(len(reqs)))
    assert all(r is out.results[i] for i, r, _ in seen)
    assert tokens(engine.generate(reqs, sp, policy=policy)) == tokens(out)  # the sink changes nothing
    if policy is None and make_engine.spec.step_stats:  # plain: one token per row per step
        lengths = [n for _, _, n in seen]
        assert lengths == sorted(lengths) and lengths[0] < lengths[-1], lengths
