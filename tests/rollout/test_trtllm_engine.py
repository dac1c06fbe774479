"""Our side of the TensorRT-LLM engine: config, conversion, strict weight streams, the
missing-package error. TensorRT-LLM itself is never imported here: where the engine
object is needed, ``tests/trtllm_standin.py`` (a stand-in module, not TensorRT-LLM) serves
the folder with the torch engine, so the tokens, the draft-length schedule the workers
hold (set by our worker extension) and the refitted weights show in what comes back."""
from __future__ import annotations

import importlib
import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, FixedSDPolicy, SDPolicyConfig
from nemo_tlt.device import Placement
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.integrations.interface_facts import (TRTLLM_EAGLE3_FIELDS, TRTLLM_GENERATE, TRTLLM_LLM_FIELDS,
                                                   TRTLLM_SAMPLING_FIELDS, signature_deviations)
from nemo_tlt.model.hf_io import read_state_dict, save_hf_folder
from nemo_tlt.rollout import trtllm_run
from nemo_tlt.rollout.config import RolloutConfig, TRTLLMRolloutSettings
from nemo_tlt.rollout.factory import build_rollout_engine, engine_tensor_parallel
from nemo_tlt.rollout.protocol import EngineLimits, Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.rollout.trtllm_config import (TRTLLM_INDEX, TRTLLM_INSTALL, TRTLLM_REQUIREMENT, TRTLLM_SOURCE,
                                            WORKER_EXTENSION, TRTLLMEngineConfig)
from nemo_tlt.rollout.run_limits import unsupported_settings
from nemo_tlt.rollout.trtllm_run import TrainRunAsks, train_run_refusal
from nemo_tlt.rollout.trtllm_schedule import build_settings, settings_for_schedule
from nemo_tlt.rollout.trtllm_stats import speculation_report
from nemo_tlt.rollout.trtllm_engine import (TRTLLMRolloutEngine, canonical_shapes, check_drafter_layers,
                                            completion_to_result, import_tensorrt_llm, sampling_kwargs,
                                            trtllm_capture_layers, weight_buckets)
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
import trtllm_standin as standin
from tiny import tiny_config, tiny_target


def test_missing_package_error_names_it_and_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # makes the import fail like a missing package
    with pytest.raises(ImportError, match=r"'tensorrt_llm' package.*" + re.escape(TRTLLM_INSTALL)):
        import_tensorrt_llm()
    with pytest.raises(ImportError, match="tensorrt_llm"):
        TRTLLMRolloutEngine(TRTLLMEngineConfig(target_dir="unused"))


def test_the_extra_pins_the_release_the_code_follows_and_names_its_index():
    """One release (its facts are that release's), from the index that holds its wheel: PyPI's
    tensorrt_llm is a placeholder that fetches the wheel from NVIDIA's index at install time."""
    import tomllib
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["trtllm"] == [TRTLLM_REQUIREMENT]
    assert re.fullmatch(r"tensorrt_llm==\d+\.\d+\.\d+(rc\d+)?", TRTLLM_REQUIREMENT)
    assert f"--extra-index-url {TRTLLM_INDEX}" in TRTLLM_INSTALL and TRTLLM_INDEX == "https://pypi.nvidia.com/"
    assert re.fullmatch(r"NVIDIA/TensorRT-LLM@[0-9a-f]{40}", TRTLLM_SOURCE)


def test_train_run_refusals_name_each_setting(monkeypatch):
    baseline = TrainRunAsks("rejection", sd_enabled=False, train_on_idle=False, harvest_from="rollout")
    limits = TRTLLMRolloutEngine.LIMITS  # the refusals follow the engine's declared limits
    assert unsupported_settings("trtllm", limits, baseline) == []
    tlt = unsupported_settings("trtllm", limits, TrainRunAsks("coupled", True, True, "rollout"))
    assert [line.split(":")[0] for line in tlt] == [
        "grpo.acceptance=coupled with rollout.engine=trtllm",
        "rollout.sd_enabled / drafter.train_on_idle (TLT mode) with rollout.engine=trtllm",
        "drafter.harvest_from=rollout with rollout.engine=trtllm"]
    assert "per-request random stream" in tlt[0] and "returns no hidden states" in tlt[2]
    # an engine without those limits refuses none of them
    assert unsupported_settings("torch", EngineLimits(), TrainRunAsks("coupled", True, True, "rollout")) == []
    monkeypatch.setattr(trtllm_run, "tensorrt_llm_installed", lambda: True)
    assert train_run_refusal(baseline) is None
    assert "rollout.trtllm.tensor_parallel_size=2 with nemo-tlt train" in train_run_refusal(
        baseline, TRTLLMRolloutSettings(tensor_parallel_size=2))
    assert "pip install" not in train_run_refusal(TrainRunAsks("coupled", False, False, "policy"))
    monkeypatch.setattr(trtllm_run, "tensorrt_llm_installed", lambda: False)
    assert TRTLLM_INSTALL in train_run_refusal(baseline)


def test_factory_builds_the_trtllm_engine_on_cuda_only(monkeypatch, tmp_path):
    standin.install(monkeypatch)
    folder = save_hf_folder(tiny_target(num_layers=3), tmp_path / "t")
    with pytest.raises(ValueError, match="rollout.engine=trtllm runs on CUDA devices only"):
        build_rollout_engine(RolloutConfig(engine="trtllm"), str(folder), Placement.cpu())
    engine = build_rollout_engine(RolloutConfig(engine="trtllm"), str(folder), Placement(torch.device("cuda", 0)))
    assert isinstance(engine, TRTLLMRolloutEngine) and engine.llm.kwargs["speculative_config"] is None
    # the TP `nemo-tlt plan` holds a plan's rollout TP to is the one the engine is built with
    assert engine.llm.kwargs["tensor_parallel_size"] == engine_tensor_parallel(RolloutConfig(engine="trtllm")) == 1


def test_coupled_sampling_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="coupled.*not expressible"):
        sampling_kwargs(SamplingParams(mode="coupled"), 2, 0)


def test_sampling_kwargs_greedy_and_sampled():
    g = sampling_kwargs(SamplingParams(mode="greedy", max_new_tokens=7), eos_token_id=2, seq_id=5)
    assert g == {"max_tokens": 7, "end_id": 2, "detokenize": False, "logprobs": 1, "logprobs_mode": "RAW",
                 "top_k": 1, "temperature": 0.0}
    s = sampling_kwargs(SamplingParams(mode="rejection", temperature=0.7, top_p=0.9, seed=3, stop_on_eos=False),
                        eos_token_id=2, seq_id=5)
    assert s["end_id"] == -1 and s["top_k"] is None and s["top_p"] == 0.9 and s["temperature"] == 0.7
    assert s["logprobs"] == 1 and s["logprobs_mode"] == "PROCESSED"  # the sampling transform's
    spec = sampling_kwargs(SamplingParams(mode="rejection", seed=3), 2, seq_id=5, speculating=True)
    assert "logprobs" not in spec and "logprobs_mode" not in spec and spec["return_perf_metrics"]
    other = sampling_kwargs(SamplingParams(mode="rejection", seed=3), 2, seq_id=6)
    assert s["seed"] != other["seed"]  # one random stream per sequence


def trtllm_logprobs(token_ids, values=None):
    """CompletionOutput.logprobs as interface_facts records it: one {token id: Logprob} per token
    (with logprobs=1: the top token's and, when it is another, the generated token's: here always)."""
    values = values or [-0.5 - i for i in range(len(token_ids))]
    return [{t + 1: SimpleNamespace(logprob=-0.1, rank=1), t: SimpleNamespace(logprob=v, rank=2)}
            for t, v in zip(token_ids, values)]


def test_completion_keeps_eos_as_last_token():
    sp = SamplingParams(max_new_tokens=5)
    r = completion_to_result([7, 8], "stop", sp, 2, trtllm_logprobs([7, 8]))
    assert r.tokens == [7, 8, 2] and r.logprobs[:2] == [-0.5, -1.5] and math.isnan(r.logprobs[2])
    r = completion_to_result([7, 2], "stop", sp, 2, trtllm_logprobs([7, 2]))
    assert (r.tokens, r.logprobs) == ([7, 2], [-0.5, -1.5])
    r = completion_to_result([7, 8, 9, 9, 9], "length", sp, 2, trtllm_logprobs([7, 8, 9, 9, 9]))
    assert (r.tokens, r.stop_reason, r.logprobs) == ([7, 8, 9, 9, 9], "length", [-0.5, -1.5, -2.5, -3.5, -4.5])
    with pytest.raises(ValueError, match="reason 'cancelled'"):
        completion_to_result([7], "cancelled", sp, 2, trtllm_logprobs([7]))


def test_completion_logprobs_are_the_generated_tokens_or_refused():
    sp = SamplingParams(max_new_tokens=5)
    assert completion_to_result([7, 8], "length", sp, 2, [-0.25, -0.75]).logprobs == [-0.25, -0.75]
    with pytest.raises(ValueError, match="returned none log-probs for 2 tokens"):
        completion_to_result([7, 8], "length", sp, 2, None)
    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        completion_to_result([7, 8], "length", sp, 2, trtllm_logprobs([7]))
    with pytest.raises(ValueError, match=r"token 1 do not include the token generated there \(8\)"):
        completion_to_result([7, 8], "length", sp, 2, trtllm_logprobs([7, 5]))


def test_weight_stream_is_strict_and_bucketed():
    model = tiny_target()
    shapes = canonical_shapes(model.config)
    sd = model.state_dict()
    assert shapes == {n: tuple(t.shape) for n, t in sd.items()}
    buckets = list(weight_buckets(iter(sd.items()), shapes, bucket_bytes=8 * 1024))
    assert len(buckets) > 1 and [n for b in buckets for n, _ in b] == list(sd)
    with pytest.raises(ValueError, match="unknown tensor 'nope'"):
        list(weight_buckets([("nope", torch.zeros(1))], shapes, 1 << 20))
    name = next(iter(sd))
    with pytest.raises(ValueError, match=f"{name!r} has shape"):
        list(weight_buckets([(name, torch.zeros(1))], shapes, 1 << 20))
    with pytest.raises(ValueError, match="given twice"):
        list(weight_buckets([(name, sd[name]), (name, sd[name])], shapes, 1 << 20))
    with pytest.raises(ValueError, match="was not given"):
        list(weight_buckets([(name, sd[name])], shapes, 1 << 20))


def test_config_validation_and_llm_kwargs():
    with pytest.raises(ValueError, match="TRTLLMEngineConfig.max_draft_len"):
        TRTLLMEngineConfig(target_dir="t", max_draft_len=0)
    with pytest.raises(ValueError, match="max_concurrency needs a drafter_dir"):
        TRTLLMEngineConfig(target_dir="t", max_concurrency=8)
    with pytest.raises(ValueError, match="eagle3_layers_to_capture must list distinct"):
        TRTLLMEngineConfig(target_dir="t", drafter_dir="d", eagle3_layers_to_capture=(1, 1))
    cfg = TRTLLMEngineConfig(target_dir="t", drafter_dir="d", max_draft_len=3, max_concurrency=16,
                             eagle3_layers_to_capture=(1, 5, 9))
    assert cfg.speculative_kwargs() == {"max_draft_len": 3, "speculative_model": "d", "eagle3_one_model": True,
                                        "use_rejection_sampling": False, "eagle3_layers_to_capture": {1, 5, 9},
                                        "max_concurrency": 16}
    kw = cfg.llm_kwargs()
    assert kw["orchestrator_type"] == "ray" and kw["ray_worker_extension_cls"] == WORKER_EXTENSION
    assert kw["allreduce_strategy"] == "NCCL"  # TensorRT-LLM's AsyncLLM forces it for RL (TP > 1 all-reduce)
    assert cfg.build_schedule() == {16: 3}
    assert TRTLLMEngineConfig(target_dir="t").speculative_kwargs() is None
    scheduled = TRTLLMEngineConfig(target_dir="t", drafter_dir="d", max_draft_len=3, draft_len_schedule={8: 1, 2: 3})
    assert scheduled.draft_len_schedule == {2: 3, 8: 1} == scheduled.speculative_kwargs()["draft_len_schedule"]
    assert scheduled.build_schedule() == {2: 3, 8: 1}
    for bad, why in (({2: 2}, "smallest batch size's length"), ({2: 3, 4: 4}, "no length above"),
                     ({0: 3}, "key"), ({}, "non-empty")):
        with pytest.raises(ValueError, match=why):
            TRTLLMEngineConfig(target_dir="t", drafter_dir="d", max_draft_len=3, draft_len_schedule=bad)
    with pytest.raises(ValueError, match="excludes max_concurrency"):
        TRTLLMEngineConfig(target_dir="t", drafter_dir="d", max_concurrency=4, draft_len_schedule={4: 4})


def _exported_drafter(cfg, folder, capture_layers=None, seed=0) -> str:
    drafter = Eagle3Drafter(Eagle3Config.from_target(cfg, capture_layers), generator=torch.Generator().manual_seed(seed))
    folder.mkdir()
    write_eagle3_hf(drafter, folder)
    return str(folder)


def _with_layer_ids(folder, ids) -> str:
    """An exported folder whose config names other captured layers (HF numbering: ours + 1),
    as a checkpoint trained elsewhere may (our export refuses to write such a drafter)."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    path.write_text(json.dumps(cfg))
    return str(folder)


def test_the_drafter_must_capture_the_layers_trtllm_captures(tmp_path):
    """TensorRT-LLM feeds the drafter the layers of eagle3_layers_to_capture (a set):
    a drafter trained on others, or on a repeated layer, is refused by name."""
    cfg = tiny_config(num_layers=8)
    assert trtllm_capture_layers(TRTLLMEngineConfig(target_dir="t"), 8) == (1, 3, 4)
    assert trtllm_capture_layers(TRTLLMEngineConfig(target_dir="t", eagle3_layers_to_capture=(5, 0, 2)), 8) == (0, 2, 5)
    default = _exported_drafter(cfg, tmp_path / "default")  # our default equals TensorRT-LLM's at L > 5
    check_drafter_layers(default, (1, 3, 4))
    with pytest.raises(ValueError, match=r"trained on target layers \[1, 3, 4\].*capture \[0, 2, 5\]"):
        check_drafter_layers(default, (0, 2, 5))
    repeated = _with_layer_ids(Path(_exported_drafter(cfg, tmp_path / "repeated")), (0, 0, 1))
    with pytest.raises(ValueError, match=r"\[0, 0, 1\] with repeats"):
        check_drafter_layers(repeated, (0, 1))
    with pytest.raises(ValueError, match="not an EAGLE-3 HF config"):
        check_drafter_layers(tmp_path, (0, 1))
    # TensorRT-LLM hands the layers over ascending: a drafter reading them in another order is refused
    unsorted = _with_layer_ids(Path(_exported_drafter(cfg, tmp_path / "unsorted")), (4, 1, 3))
    with pytest.raises(ValueError, match=r"in the order \[4, 1, 3\]"):
        check_drafter_layers(unsorted, (1, 3, 4))


def test_trtllm_default_capture_layers_follow_its_rules():
    """{1, L//2-1, L-4} above 5 layers, the last layer of a 1-layer target, refused between."""
    unset = TRTLLMEngineConfig(target_dir="t")
    assert trtllm_capture_layers(unset, 32) == (1, 15, 28) and trtllm_capture_layers(unset, 1) == (0,)
    with pytest.raises(ValueError, match="eagle3_layers_to_capture is unset and the target has 4 layers"):
        trtllm_capture_layers(unset, 4)
    with pytest.raises(ValueError, match=r"names layers \[9\]"):
        trtllm_capture_layers(TRTLLMEngineConfig(target_dir="t", eagle3_layers_to_capture=(0, 9)), 8)
    with pytest.raises(ValueError, match=r"eagle3_layers_to_capture\[0\]"):
        TRTLLMEngineConfig(target_dir="t", eagle3_layers_to_capture=(-1, 2))


# ---- the engine against tests/trtllm_standin.py: a stand-in module (NOT TensorRT-LLM) that generates ----
# from the request with the torch engine, drafts with the folder by the schedule the workers hold, refits
# through update_weights; strict per interface_facts (a keyword its real class lacks is refused).
def test_the_stand_ins_are_strict_and_match_the_facts():
    assert signature_deviations(standin.LLM.generate.__get__(object()), TRTLLM_GENERATE) == []
    with pytest.raises(TypeError, match="speculative_model_path"):
        standin.Eagle3DecodingConfig(max_draft_len=4, speculative_model_path="d")
    with pytest.raises(TypeError, match="max_new_tokens"):
        standin.SamplingParams(max_new_tokens=4)
    with pytest.raises(TypeError, match="tokenizer_dir"):
        standin.LLM(model="m", tokenizer_dir="t")
    with pytest.raises(ValueError, match="mutually exclusive"):
        standin.Eagle3DecodingConfig(max_draft_len=4, speculative_model="d", max_concurrency=8,
                                     draft_len_schedule={8: 4})
    assert standin.Eagle3DecodingConfig(max_draft_len=3, speculative_model="d",
                                        max_concurrency=8).draft_len_schedule == {8: 3}
    # upstream's greedy rule: top_k None or 1 and top_p None or 0, whatever the temperature
    assert standin.SamplingParams(temperature=0.7)._greedy_decoding
    assert not standin.SamplingParams(top_p=0.9)._greedy_decoding
    everything = TRTLLMEngineConfig(target_dir="t", drafter_dir="d", use_dynamic_tree=True, dynamic_tree_max_topk=4,
                                    max_concurrency=8, eagle3_layers_to_capture=(1, 2, 3))
    assert set(everything.speculative_kwargs()) <= TRTLLM_EAGLE3_FIELDS
    assert set(everything.llm_kwargs()) | {"speculative_config"} <= TRTLLM_LLM_FIELDS
    for sp in (SamplingParams(mode="greedy"), SamplingParams(mode="rejection", top_k=5, stop_on_eos=False)):
        assert set(sampling_kwargs(sp, 2, 0)) <= TRTLLM_SAMPLING_FIELDS


@pytest.fixture
def served(monkeypatch, tmp_path):
    """The stand-in installed; a 3-layer tiny target folder and an exported EAGLE-3 drafter folder."""
    standin.install(monkeypatch)
    target = tiny_target(num_layers=3)
    return SimpleNamespace(target=target, folder=save_hf_folder(target, tmp_path / "t"), tmp=tmp_path,
                           drafter_dir=_exported_drafter(tiny_config(num_layers=3), tmp_path / "d"))


def _speculating_engine(served, **kwargs) -> TRTLLMRolloutEngine:
    kwargs = {"max_draft_len": 4, "max_batch_size": 8, **kwargs}
    return TRTLLMRolloutEngine.from_hf_folder(served.folder, drafter_dir=served.drafter_dir,
                                              eagle3_layers_to_capture=(0, 1, 2), **kwargs)


REQS = [Request([3, 4]), Request([5], seq_id=9), Request([7, 8, 9])]


def _tokens(out) -> list[list[int]]:
    return [r.tokens for r in out.results]


def test_engine_returns_what_the_served_model_generates(served):
    """Prompts, sampling and results cross the LLM API intact: the tokens and stop reasons are
    the served model's own (the torch engine on the same weights), plain or speculating; a
    sampled rollout follows its seed. Log-probs: plain decoding asks TensorRT-LLM for RAW ones
    in greedy (our greedy definition) and PROCESSED ones when sampling (the transform drawn
    from, here temperature 1.5); speculating asks for none (TensorRT-LLM refuses log-probs with
    speculative decoding) and says so: NaN, ``logprobs_from="none"``."""
    plain = TRTLLMRolloutEngine.from_hf_folder(served.folder, max_batch_size=8)
    spec = _speculating_engine(served)
    assert spec.llm.kwargs["speculative_config"].speculative_model == served.drafter_dir
    assert plain.model_config == tiny_config(num_layers=3)
    sp = SamplingParams(mode="greedy", max_new_tokens=12)
    want = TorchRolloutEngine(served.target).generate(REQS, sp).results
    for engine, policy in ((plain, None), (spec, FixedSDPolicy(TreeShape(4, 1, 4)))):
        out = engine.generate(REQS, sp, policy=policy)
        assert [r.tokens for r in out.results] == [w.tokens for w in want]
        assert [r.stop_reason for r in out.results] == [w.stop_reason for w in want]
        if engine is plain:
            assert out.logprobs_from == "engine"
            for r, w in zip(out.results, want):
                torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
        else:
            assert out.logprobs_from == "none" and engine.llm.calls[-1][1][0].logprobs is None
            assert all(len(r.logprobs) == len(r.tokens) and all(math.isnan(x) for x in r.logprobs)
                       for r in out.results)
    prompts, params = plain.llm.calls[-1]
    assert prompts == [[3, 4], [5], [7, 8, 9]] and params[0].max_tokens == 12 and params[0].end_id == 2
    sampled = SamplingParams(mode="rejection", temperature=1.5, max_new_tokens=12, stop_on_eos=False)
    one, again = plain.generate(REQS, sampled), plain.generate(REQS, sampled)
    other = plain.generate(REQS, replace(sampled, seed=1))
    assert _tokens(one) == _tokens(again) != _tokens(other)
    assert all(len(t) == 12 for t in _tokens(one)) and not any(r.stop_reason == "eos" for r in one.results)
    for req, r in zip(REQS, one.results):  # drawn at temperature 1.5: the log-probs say so
        seq = torch.tensor([list(req.prompt) + r.tokens])
        with torch.no_grad():
            logits = served.target(seq)[0, len(req.prompt) - 1: -1].float() / 1.5
        want_lp = logits.log_softmax(-1).gather(-1, torch.tensor(r.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), want_lp, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="return_hidden"):
        plain.generate([Request([3])], SamplingParams(max_new_tokens=4), return_hidden=True)


def test_the_stand_in_refuses_log_probs_with_speculation_as_upstream(served):
    """What the engine must avoid: a request with log-probs on an LLM built with a speculative
    config fails (TensorRT-LLM's ``SpecSampler.validate_request``)."""
    engine = _speculating_engine(served)
    params = standin.SamplingParams(max_tokens=4, end_id=-1, detokenize=False, logprobs=1)
    with pytest.raises(ValueError, match="not supported with speculative decoding: \\['logprobs'\\]"):
        engine.llm.generate([[3, 4]], [params])


def _drafted_per_iteration(spec) -> float:
    """Draft tokens per decode iteration of the rollout (each request's context iteration drafts none)."""
    return spec.draft_tokens / (spec.iterations - spec.requests)


def _perf(llm, prompts, max_tokens=8):
    """What the LLM reports per request for a plain greedy call: (decoding_iter, draft tokens)."""
    params = standin.SamplingParams(max_tokens=max_tokens, end_id=-1, detokenize=False, return_perf_metrics=True)
    return [(o.decoding_iter, o.outputs[0].request_perf_metrics.speculative_decoding.total_draft_tokens)
            for o in llm.generate(prompts, [params] * len(prompts))]


def test_the_schedule_is_the_policys_at_build_and_a_change_is_a_restart(served):
    """The LLM is built with the policy's draft_len_schedule (TensorRT-LLM captures its CUDA
    graphs for it at start-up), which decides each iteration's draft length by the running
    batch size: {1: 3} drafts 3 tokens for one request and none for two. A policy asking for
    another schedule is refused, naming the restart; ``restart`` builds a new LLM (the old one
    shut down) with it; after a policy refit the restarted LLM serves the folder's weights, so
    ``generate`` refuses until the next refit."""
    one = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=1, threshold_off=2), fixed_shape=TreeShape(3, 1, 3))
    settings = build_settings(one, 4, 8)
    assert settings == {"max_draft_len": 3, "draft_len_schedule": {1: 3}, "max_concurrency": None}
    engine = _speculating_engine(served, **settings)
    assert engine.llm.kwargs["speculative_config"].draft_len_schedule == {1: 3}
    (iters, drafted), = _perf(engine.llm, [[3, 4]])
    assert iters > 1 and drafted == 3 * (iters - 1)
    assert [d for _, d in _perf(engine.llm, [[3, 4], [5, 6]])] == [0, 0]  # batch 2: above the largest key
    reqs, sp = REQS[:1], SamplingParams(mode="greedy", max_new_tokens=10, stop_on_eos=False)
    plain = _tokens(TorchRolloutEngine(served.target).generate(reqs, sp))
    assert _tokens(engine.generate(reqs, sp, policy=one)) == plain
    assert _drafted_per_iteration(engine.last_speculation) == 3
    two = FixedSDPolicy(TreeShape(2, 1, 2))
    with pytest.raises(ValueError, match=r"differs from the one the LLM was built with \{1: 3\}.*restart"):
        engine.generate(reqs, sp, policy=two)
    with pytest.raises(ValueError, match="differs"):
        engine.generate(reqs, sp)  # no policy is plain decoding: another schedule too
    first = engine.llm
    assert engine.restart(**build_settings(two, 4, 8)) == engine.last_restart_s >= 0
    assert not first.running and engine.llm is not first and standin.LLM.built[-1] is engine.llm
    assert _tokens(engine.generate(reqs, sp, policy=two)) == plain
    assert _drafted_per_iteration(engine.last_speculation) == 2
    for rising in ({2: 1, 8: 3}, {2: 0, 8: 3}):  # the longest draft must be at the smallest batch sizes
        with pytest.raises(ValueError, match="not expressible"):
            settings_for_schedule(rising)
    with pytest.raises(ValueError, match="never speculates"):
        build_settings(None, 4, 8)
    engine.load_policy_weights(served.target.state_dict())
    engine.restart(**build_settings(one, 4, 8))
    with pytest.raises(ValueError, match="serves target_dir's weights"):
        engine.generate(reqs, sp, policy=one)
    engine.load_policy_weights(served.target.state_dict())
    assert _tokens(engine.generate(reqs, sp, policy=one)) == plain
    engine.load_drafter(None)  # plain decoding: a restart without the drafter
    assert engine.llm.kwargs["speculative_config"] is None
    engine.load_policy_weights(served.target.state_dict())
    with pytest.raises(ValueError, match="built without a drafter"):
        engine.generate(reqs, sp, policy=one)
    out = engine.generate(reqs, sp)
    assert _tokens(out) == plain and engine.last_speculation is None and out.logprobs_from == "engine"
    with pytest.raises(ValueError, match="not a torch|EAGLE-3 HF folder"):
        engine.load_drafter(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"trained on target layers \[1, 2\]"):
        engine.load_drafter(_exported_drafter(tiny_config(num_layers=3), served.tmp / "two", capture_layers=(1, 2)))
    assert engine.llm.running  # a refused drafter leaves the running LLM alone


def test_weights_are_sent_to_the_gpu_each_worker_reports(served, monkeypatch):
    """The IPC payload is keyed by the UUID each worker reports (``report_device_id``), not by
    this process's device numbering: a worker on GPU 2 gets its tensors."""
    monkeypatch.setattr(standin.LLM, "worker_device", 2)
    engine = TRTLLMRolloutEngine.from_hf_folder(served.folder, max_batch_size=8)
    other = tiny_target(seed=5, num_layers=3)
    engine.load_policy_weights(other.state_dict())
    (handles,), = [args for method, args in engine.llm.rpcs if method == "update_weights" and args[0]]
    assert list(handles) == [standin.get_device_uuid(2)]
    sp = SamplingParams(mode="greedy", max_new_tokens=8)
    assert _tokens(engine.generate(REQS, sp)) == _tokens(TorchRolloutEngine(other).generate(REQS, sp))


def test_policy_weights_refit_changes_the_tokens_and_back(served):
    """load_policy_weights reaches the served model (update_weights buckets, then the finalising
    call): other weights give their own model's tokens, the original weights the original tokens;
    a stream refused before its first bucket changes nothing."""
    engine = _speculating_engine(served)
    sp = SamplingParams(mode="greedy", max_new_tokens=12)
    policy = FixedSDPolicy(TreeShape(4, 1, 4))
    before = _tokens(engine.generate(REQS, sp, policy=policy))
    other = tiny_target(seed=5, num_layers=3)
    want = _tokens(TorchRolloutEngine(other).generate(REQS, sp))
    assert want != before
    engine.load_policy_weights(other.state_dict())
    assert _tokens(engine.generate(REQS, sp, policy=policy)) == want
    refits = [args for method, args in engine.llm.rpcs if method == "update_weights"]
    assert len(refits) == 2 and refits[-1] == (None,)  # one bucket (the tiny model), then the finalising call
    assert standin.worker(engine).engine.prefix_cache_resets == 1
    engine.load_policy_weights(iter(served.target.state_dict().items()))
    assert _tokens(engine.generate(REQS, sp, policy=policy)) == before
    name, tensor = next(iter(served.target.state_dict().items()))
    with pytest.raises(ValueError, match="was given twice"):
        engine.load_policy_weights([(name, other.state_dict()[name]), (name, tensor)])
    assert _tokens(engine.generate(REQS, sp, policy=policy)) == before


def _request_output(avg, iters, counters=None):
    perf = None if counters is None else SimpleNamespace(speculative_decoding=SimpleNamespace(
        total_accepted_draft_tokens=counters[0], total_draft_tokens=counters[1]))
    return SimpleNamespace(outputs=[SimpleNamespace(request_perf_metrics=perf)], decoding_iter=iters,
                           avg_decoded_tokens_per_iter=avg)


def test_speculation_report_is_tensorrt_llms_acceptance_length_per_verify_step():
    """accept_lengths: one entry per request per decode iteration, summing to the tokens it
    decoded, so their mean is TensorRT-LLM's iteration-weighted acceptance length."""
    outputs = [_request_output(3.0, 4, (8, 12)), _request_output(1.5, 2, (1, 3)), _request_output(None, 0)]
    report, accept = speculation_report(outputs)
    assert accept == [3, 3, 3, 3, 2, 1]
    assert report.mean_accept_len == sum(accept) / len(accept) == 15 / 6
    assert (report.requests, report.iterations, report.decoded_tokens) == (2, 6, 15)
    assert (report.accepted_draft_tokens, report.draft_tokens, report.draft_acceptance) == (9, 15, 0.6)
    none, empty = speculation_report([_request_output(None, 3)])
    assert empty == [] and none.mean_accept_len == 0.0 and none.draft_acceptance is None
    with pytest.raises(ValueError, match="decoding_iter=0"):
        speculation_report([_request_output(2.0, 0)])
    with pytest.raises(ValueError, match="avg_decoded_tokens_per_iter=0.5"):
        speculation_report([_request_output(0.5, 2)])


@pytest.fixture(scope="module")
def demo_drafters(tmp_path_factory):
    """The shipped demo target, its trained EAGLE-3 drafter exported in the HF layout, and an
    untrained one of the same shape (TensorRT-LLM's default capture for 16 layers, {1, 7, 12},
    is the trained drafter's)."""
    from nemo_tlt.demo.assets import AssetConfig, task_requests
    from nemo_tlt.demo.shipped_assets import SHIPPED_DIR, shipped_eagle3_drafter
    from nemo_tlt.drafter.io import load_drafter
    from nemo_tlt.model.hf_io import load_hf_folder

    tmp = tmp_path_factory.mktemp("demo")
    target_dir = SHIPPED_DIR / "target"
    trained = load_drafter(shipped_eagle3_drafter(), load_hf_folder(target_dir))
    untrained = Eagle3Drafter(trained.config, generator=torch.Generator().manual_seed(0))
    _, reqs = task_requests(AssetConfig().task, 6, seed=20_000)
    folders = {}
    for name, drafter in (("trained", trained), ("untrained", untrained)):
        (tmp / name).mkdir()
        write_eagle3_hf(drafter, tmp / name)
        folders[name] = str(tmp / name)
    return SimpleNamespace(target_dir=target_dir, requests=reqs, **folders)


def _acceptance(engine, demo, policy) -> tuple[list[list[int]], float]:
    out = engine.generate(demo.requests, SamplingParams(mode="greedy", max_new_tokens=48), policy=policy)
    return _tokens(out), engine.last_speculation.draft_acceptance


def test_a_drafter_refit_restarts_with_the_new_folder_and_acceptance_shows_it(demo_drafters, monkeypatch):
    """The drafter after idle-time training reaches TensorRT-LLM's draft module: load_drafter
    rebuilds the LLM from the new folder (TensorRT-LLM's weight update skips ``draft_model``), so
    the per-request acceptance after the refit is the new drafter's: an engine built with an
    untrained drafter accepts few drafts, the same engine after load_drafter(trained) as many
    as one built with the trained drafter; tokens stay the target's greedy ones throughout."""
    standin.install(monkeypatch)
    policy = FixedSDPolicy(TreeShape(4, 1, 4))
    fresh = TRTLLMRolloutEngine.from_hf_folder(demo_drafters.target_dir, drafter_dir=demo_drafters.trained,
                                               max_batch_size=8)
    want_tokens, want_acceptance = _acceptance(fresh, demo_drafters, policy)
    engine = TRTLLMRolloutEngine.from_hf_folder(demo_drafters.target_dir, drafter_dir=demo_drafters.untrained,
                                                max_batch_size=8)
    tokens, before = _acceptance(engine, demo_drafters, policy)
    assert tokens == want_tokens and before < 0.05 < 0.3 < want_acceptance
    engine.load_drafter(demo_drafters.trained)
    assert engine.llm.kwargs["speculative_config"].speculative_model == demo_drafters.trained
    assert _acceptance(engine, demo_drafters, policy) == (want_tokens, want_acceptance)


def test_the_nemo_adapters_load_the_drafters_weights(demo_drafters, monkeypatch):
    """The NeMo adapters build TensorRT-LLM with the policy's schedule and, with a drafter, read
    its weights (``load_format='auto'``; a dummy load randomises the drafter and never reads the
    folder): after the trainer's refit the acceptance is the trained drafter's. Without a drafter
    (or a policy that never speculates) the dummy load stays: weights from the first refit."""
    from nemo_tlt.adaptive.config import SpecDecodingConfig
    from nemo_tlt.integrations.nemo_aligner import TLTBlock, TRTLLMBlock, build_engine
    from nemo_tlt.model.hf_io import read_state_dict

    standin.install(monkeypatch)
    policy = FixedSDPolicy(TreeShape(4, 1, 4))
    tlt = TLTBlock(backend="trtllm", target_dir=str(demo_drafters.target_dir),
                   trtllm=TRTLLMBlock(drafter_dir=demo_drafters.trained, max_batch_size=8))
    engine = build_engine(tlt, policy)
    assert engine.config.load_format == "auto" and engine.config.draft_len_schedule == {8: 4}
    engine.load_policy_weights(read_state_dict(demo_drafters.target_dir))  # the trainer's refit
    fresh = TRTLLMRolloutEngine.from_hf_folder(demo_drafters.target_dir, drafter_dir=demo_drafters.trained,
                                               max_batch_size=8)
    assert _acceptance(engine, demo_drafters, policy) == _acceptance(fresh, demo_drafters, policy)
    plain = build_engine(tlt, FixedSDPolicy(None))
    assert plain.config.load_format == "dummy" and plain.config.drafter_dir is None
    with pytest.raises(ValueError, match="dummy.*drafter"):
        TRTLLMEngineConfig(target_dir="t", drafter_dir="d", load_format="dummy")


def test_one_engine_factory_builds_tensorrt_llm_for_the_adapters_and_the_loop(demo_drafters, monkeypatch):
    """The NeMo adapters build TensorRT-LLM through the loop's engine factory (the engine
    registry's ``trtllm`` entry), handing it ``tlt.trtllm`` and the SD policy; the factory builds
    the same schedule from ``rollout.trtllm`` for any caller, keeps a folder's weights without the
    dummy load, and refuses a torch drafter module."""
    from nemo_tlt.integrations.nemo_aligner import TLTBlock, TRTLLMBlock, build_engine
    from nemo_tlt.rollout import factory
    from nemo_tlt.rollout.config import ENGINES

    standin.install(monkeypatch)
    calls = []

    def recording(config, model_dir, placement, **kwargs):
        calls.append((config.trtllm, kwargs["policy"], placement.device.type))
        return factory.trtllm_engine(config, model_dir, placement, **kwargs)

    monkeypatch.setitem(ENGINES._entries, "trtllm", recording)
    policy = FixedSDPolicy(TreeShape(4, 1, 4))
    block = TRTLLMBlock(drafter_dir=demo_drafters.trained, max_batch_size=8)
    adapter = build_engine(TLTBlock(backend="trtllm", target_dir=str(demo_drafters.target_dir), trtllm=block), policy)
    assert calls == [(block, policy, "cuda")]
    settings = TRTLLMRolloutSettings(drafter_dir=demo_drafters.trained, max_batch_size=8)
    loop = build_rollout_engine(RolloutConfig(engine="trtllm", trtllm=settings), str(demo_drafters.target_dir),
                                Placement(torch.device("cuda", 0)), policy=policy)
    assert loop.config.draft_len_schedule == adapter.config.draft_len_schedule == {8: 4}
    assert loop.config.load_format == "auto" and adapter.config.load_format == "auto"
    tp2 = RolloutConfig(engine="trtllm", trtllm=TRTLLMRolloutSettings(tensor_parallel_size=2))
    assert engine_tensor_parallel(tp2) == 2  # TensorRT-LLM's own workers (the stand-in runs one)
    assert build_rollout_engine(RolloutConfig(engine="trtllm", trtllm=TRTLLMRolloutSettings(dummy_load=True)),
                                str(demo_drafters.target_dir), Placement(torch.device("cuda", 0))
                                ).config.load_format == "dummy"
    with pytest.raises(ValueError, match="rollout.trtllm.drafter_dir"):
        build_rollout_engine(RolloutConfig(engine="trtllm"), str(demo_drafters.target_dir),
                             Placement(torch.device("cuda", 0)), drafter=object())
    with pytest.raises(ValueError, match="TRTLLMRolloutSettings.max_draft_len must be >= 1, got 0"):
        TRTLLMRolloutSettings(max_draft_len=0)


def test_a_worker_gpu_is_found_by_its_uuid_among_this_processs_devices(monkeypatch):
    """The IPC copy goes to the local CUDA device whose UUID ("GPU-" + the device properties'
    uuid, TensorRT-LLM's get_device_uuid form) the worker reported; a GPU not visible here is
    refused by name (devices simulated: no CUDA on this machine)."""
    from nemo_tlt.device import cuda_device_of_uuid

    uuids = ["1111-aaaa", "2222-bbbb", "3333-cccc"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    assert cuda_device_of_uuid("GPU-2222-bbbb", "w") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"w: GPU GPU-9999 is not one of this process's CUDA devices"):
        cuda_device_of_uuid("GPU-9999", "w")
    with pytest.raises(ValueError, match="not one of"):
        cuda_device_of_uuid("2222-bbbb", "w")  # NVML's form carries the prefix
