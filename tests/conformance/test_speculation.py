"""Speculation ran, not only tokens matched: every engine reports accepted lengths per verify
step (`GenerationStats.accept_lengths`; TensorRT-LLM per request, mapped by
`rollout.trtllm_stats`), and with the trained demo EAGLE-3 drafter exported, greedy SD is
plain greedy with more than ``MIN_MEAN_ACCEPT`` (1.5) tokens per verify step on average (an
untrained one measured 1.009: a bare "> 1" would not tell them apart)."""
from __future__ import annotations

import pytest

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.demo.assets import AssetConfig, task_requests
from nemo_tlt.selfcheck.trtllm_check import MIN_MEAN_ACCEPT
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from suite_helpers import requests, tokens

CHAIN = FixedSDPolicy(TreeShape(4, 1, 4))  # TensorRT-LLM drafts a chain (max_draft_len 4 in engines.py)


def _require_accept_stats(make_engine) -> None:
    if not make_engine.spec.accept_stats:
        pytest.skip(f"the {make_engine.spec.name} engine declares no acceptance stats ({make_engine.spec.why})")


def test_acceptance_is_reported_per_verify_step(make_engine, model_dir):
    """While a drafter speculates: one accepted length per row per verify step, each between 1
    and the draft length + 1, together no more than the tokens generated (plus what a row's
    last step accepts past max_new_tokens); plain decoding reports none."""
    _require_accept_stats(make_engine)
    engine = make_engine(model_dir)
    reqs, sp = requests([5, 3, 8], seed=2), SamplingParams(mode="greedy", max_new_tokens=24, stop_on_eos=False)
    plain = engine.generate(reqs, sp)
    assert plain.stats.accept_lengths == []
    engine.load_drafter(make_engine.drafter("eagle3", engine.model_config))
    out = engine.generate(reqs, sp, policy=CHAIN)
    assert tokens(out) == tokens(plain)
    accepted = out.stats.accept_lengths
    assert accepted and all(1 <= n <= 5 for n in accepted), accepted
    assert sum(accepted) <= out.stats.tokens_generated + 4 * len(reqs) and out.stats.mean_accept_len >= 1


def test_trained_eagle3_drafter_speculates(make_engine, trained_eagle3):
    """The demo target with its trained EAGLE-3 drafter exported: greedy SD gives plain greedy's
    tokens with a mean accepted length above MIN_MEAN_ACCEPT per verify step (speculation ran)."""
    _require_accept_stats(make_engine)
    plain = make_engine(trained_eagle3.target_dir)
    sd = make_engine.speculating(trained_eagle3.target_dir, str(trained_eagle3.drafter_dir),
                                 trained_eagle3.capture_layers)
    _, reqs = task_requests(AssetConfig().task, 8, seed=20_000)
    sp = SamplingParams(mode="greedy", max_new_tokens=96)
    base, out = plain.generate(reqs, sp), sd.generate(reqs, sp, policy=CHAIN)
    assert tokens(out) == tokens(base)
    stats = out.stats
    print(f"{make_engine.spec.name}: mean accepted length {stats.mean_accept_len:.3f} per verify step, "
          f"histogram {stats.accept_histogram()}")
    assert stats.mean_accept_len > MIN_MEAN_ACCEPT, f"speculation did not run: {stats.accept_histogram()}"
