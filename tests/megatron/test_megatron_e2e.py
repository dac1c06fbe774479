"""Real megatron-core GPTModels at TP=2 x PP=2 (4 gloo processes on CPU) against our adapters.

One world (forked ranks) runs every case; the tests below assert on its results.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).parent))

from mcore_workers import Case, session  # noqa: E402

from ranks import launch_forked  # noqa: E402
from nemo_tlt.model.config import LMConfig, RopeScaling  # noqa: E402
from nemo_tlt.model.lm import DecoderLM  # noqa: E402
from nemo_tlt.weights.layout import ParallelLayout  # noqa: E402
from nemo_tlt.weights.megatron_layout import canonical_to_megatron  # noqa: E402
from nemo_tlt.weights.rollout import canonical_to_rollout  # noqa: E402

VOCAB = 100  # not a multiple of 128 * tp: exercises Megatron's vocab padding
CASES = [
    Case("llama_gqa", LMConfig(family="llama", vocab_size=VOCAB, num_heads=8, num_kv_heads=4),
         ParallelLayout(tp=2, pp=2), rollout_tps=(1, 2, 4)),
    # Qwen2: q/k/v biases, tied embeddings, uneven pipeline stages (1 + 2 layers).
    Case("qwen2_tied_uneven", LMConfig(family="qwen2", vocab_size=VOCAB, num_layers=3, tie_word_embeddings=True,
                                       rope_theta=1_000_000.0),
         ParallelLayout(tp=2, pp=2, num_layers_in_first_stage=1), rollout_tps=(1, 2)),
    # Llama-3.1 rope scaling (factor 32, as Llama-3.2's) over a sequence longer than
    # original_max_position_embeddings (8192: megatron-core fixes it). Unscaled or wrongly
    # scaled frequencies move these logits by 5e-5 to 3e-4 (tolerance 1e-5), mostly far
    # into the sequence. head_dim 16 at theta 5e5 puts half the frequencies in the scaled
    # and interpolated bands; tiny widths keep the 8200^2 attention cheap.
    Case("llama3_scaled_long", LMConfig(family="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_heads=2, num_kv_heads=2, head_dim=16, rope_theta=500_000.0,
                                        max_position_embeddings=8200, rope_scaling=RopeScaling(factor=32.0)),
         ParallelLayout(tp=2, pp=2),
         tokens=torch.randint(0, VOCAB, (1, 8200), generator=torch.Generator().manual_seed(1))),
]
TOKENS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


def _tokens(case: Case) -> torch.Tensor:
    return TOKENS if case.tokens is None else case.tokens


@pytest.fixture(scope="module")
def results():
    return launch_forked(session, 4, CASES, TOKENS, timeout_s=120)[0]


def _decoder(case: Case, canonical: dict) -> DecoderLM:
    model = DecoderLM(case.cfg)
    model.load_state_dict(canonical)
    return model.eval()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_lm_logits_equal_megatron(results, case):
    res = results[case.name]
    mega = res["logits"]
    assert mega.shape == (*_tokens(case).shape, ParallelLayout(tp=2).padded_vocab_size(VOCAB))
    with torch.no_grad():
        ref = _decoder(case, res["canonical"])(_tokens(case))
    torch.testing.assert_close(ref, mega[..., :VOCAB], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hf_transformers_logits_equal_megatron(results, case):
    transformers = pytest.importorskip("transformers")
    res = results[case.name]
    hf_cfg = case.cfg.to_hf_config()
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[case.cfg.family]
    conf_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[case.cfg.family]
    model = cls(conf_cls(**{k: v for k, v in hf_cfg.items() if k != "architectures"})).eval()
    state = dict(res["canonical"])
    if case.cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    with torch.no_grad():
        ref = model(_tokens(case)).logits
    torch.testing.assert_close(ref, res["logits"][..., :VOCAB], rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_canonical_back_to_megatron_is_bit_exact(results, case):
    res = results[case.name]
    rebuilt = canonical_to_megatron(res["canonical"], case.cfg, case.layout)
    assert set(rebuilt) == set(res["shards"])
    for coords, shard in res["shards"].items():
        assert set(rebuilt[coords]) == set(shard), coords
        for name, tensor in shard.items():
            mine = rebuilt[coords][name]
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                # Megatron fills vocab padding rows with random init, we write zeros; only real rows matter.
                start = coords[1] * tensor.shape[0]
                real = max(0, min(tensor.shape[0], VOCAB - start))
                assert torch.equal(mine[:real], tensor[:real]), (coords, name)
                assert not mine[real:].any(), (coords, name)
            else:
                assert torch.equal(mine, tensor), (coords, name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hidden_capture_equals_reference_hidden(results, case):
    res = results[case.name]
    assert res["active"] == [False, False, True, True]  # only the last pipeline stage has the final norm
    assert len(res["hidden"]) == 1
    with torch.no_grad():
        ref = _decoder(case, res["canonical"]).hidden(_tokens(case))
    torch.testing.assert_close(res["hidden"][0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layer_capture_equals_reference_layer_outputs_on_the_stage_holding_each(results, case):
    """LayerCapture sees exactly the layers of its stage (global 0-based indices, uneven
    stages included), each equal to that DecoderLM layer's output on every TP rank."""
    model = _decoder(case, results[case.name]["canonical"])
    want: dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_hook(lambda m, a, out, i=i: want.__setitem__(i, out))
               for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model.hidden(_tokens(case))
    for h in handles:
        h.remove()
    offsets = case.layout.stage_layer_offsets(case.cfg.num_layers)
    counts = case.layout.stage_layer_counts(case.cfg.num_layers)
    for (stage, tp_rank), owned, outputs in results[case.name]["layers"]:
        assert owned == tuple(range(offsets[stage], offsets[stage] + counts[stage])), (stage, tp_rank)
        assert sorted(outputs) == list(owned)
        for i, hidden in outputs.items():
            torch.testing.assert_close(hidden, want[i], rtol=1e-5, atol=1e-5, msg=f"{(stage, tp_rank)} layer {i}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_streaming_reshard_bit_exact(results, case):
    res = results[case.name]
    for rtp in case.rollout_tps:
        expected = canonical_to_rollout(res["canonical"], case.cfg, rtp)
        for rank, (streamed, gathered) in enumerate(res["reshard"][rtp]):
            want = expected[rank % rtp]
            assert set(streamed) == set(gathered) == set(want), (rtp, rank)
            for name in want:
                assert torch.equal(streamed[name], gathered[name]), (rtp, rank, name)
                assert torch.equal(streamed[name], want[name]), (rtp, rank, name)
