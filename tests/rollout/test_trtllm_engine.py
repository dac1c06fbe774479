"""Our side of the TensorRT-LLM engine: config, conversion, strict weight streams, the
missing-package error. TensorRT-LLM itself is never imported here: where the engine
object is needed, ``tests/trtllm_standin.py`` (a stand-in module, not TensorRT-LLM) serves
the folder with the torch engine, so the tokens, the draft-length schedule the workers
hold (set by our worker extension) and the refitted weights show in what comes back."""
from __future__ import annotations

import importlib
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.device import Placement
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.integrations.interface_facts import (TRTLLM_EAGLE3_FIELDS, TRTLLM_GENERATE, TRTLLM_LLM_FIELDS,
                                                   TRTLLM_SAMPLING_FIELDS, signature_deviations)
from nemo_tlt.model.hf_io import read_state_dict, save_hf_folder
from nemo_tlt.rollout import trtllm_run
from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.factory import build_rollout_engine, engine_tensor_parallel
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.rollout.trtllm_config import TRTLLM_REQUIREMENT, WORKER_EXTENSION, TRTLLMEngineConfig
from nemo_tlt.rollout.trtllm_run import TrainRunAsks, train_run_refusal, unsupported_settings
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
    with pytest.raises(ImportError, match=r"'tensorrt_llm' package.*pip install nemo-tlt\[trtllm\]"):
        import_tensorrt_llm()
    with pytest.raises(ImportError, match="tensorrt_llm"):
        TRTLLMRolloutEngine(TRTLLMEngineConfig(target_dir="unused"))


def test_the_extra_pins_the_requirement_the_code_follows():
    import tomllib
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["trtllm"] == [TRTLLM_REQUIREMENT]


def test_train_run_refusals_name_each_setting(monkeypatch):
    baseline = TrainRunAsks("rejection", sd_enabled=False, train_on_idle=False, harvest_from="rollout")
    assert unsupported_settings(baseline) == []
    tlt = unsupported_settings(TrainRunAsks("coupled", True, True, "rollout"))
    assert [line.split(":")[0] for line in tlt] == ["grpo.acceptance=coupled",
                                                    "rollout.sd_enabled / drafter.train_on_idle (TLT mode)",
                                                    "drafter.harvest_from=rollout"]
    monkeypatch.setattr(trtllm_run, "tensorrt_llm_installed", lambda: True)
    assert train_run_refusal(baseline) is None
    assert "pip install" not in train_run_refusal(TrainRunAsks("coupled", False, False, "policy"))
    monkeypatch.setattr(trtllm_run, "tensorrt_llm_installed", lambda: False)
    assert "pip install nemo-tlt[trtllm]" in train_run_refusal(baseline)


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
    assert g == {"max_tokens": 7, "end_id": 2, "detokenize": False, "logprobs": 1, "top_k": 1, "temperature": 0.0}
    s = sampling_kwargs(SamplingParams(mode="rejection", temperature=0.7, top_p=0.9, seed=3, stop_on_eos=False),
                        eos_token_id=2, seq_id=5)
    assert s["end_id"] == -1 and s["top_k"] is None and s["top_p"] == 0.9 and s["temperature"] == 0.7
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
    assert cfg.build_schedule() == {16: 3}
    assert TRTLLMEngineConfig(target_dir="t").speculative_kwargs() is None


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
    return TRTLLMRolloutEngine.from_hf_folder(served.folder, drafter_dir=served.drafter_dir, max_draft_len=4,
                                              max_batch_size=8, eagle3_layers_to_capture=(0, 1, 2), **kwargs)


REQS = [Request([3, 4]), Request([5], seq_id=9), Request([7, 8, 9])]


def _tokens(out) -> list[list[int]]:
    return [r.tokens for r in out.results]


def test_engine_returns_what_the_served_model_generates(served):
    """Prompts, sampling and results cross the LLM API intact: the tokens, stop reasons and
    log-probs are the served model's own (the torch engine on the same weights), plain or
    speculating; a sampled rollout follows its seed."""
    engine = _speculating_engine(served)
    assert engine.llm.kwargs["speculative_config"].speculative_model == served.drafter_dir
    assert engine.model_config == tiny_config(num_layers=3)
    sp = SamplingParams(mode="greedy", max_new_tokens=12)
    want = TorchRolloutEngine(served.target).generate(REQS, sp).results
    for policy in (None, FixedSDPolicy(TreeShape(2, 1, 2))):
        got = engine.generate(REQS, sp, policy=policy).results
        assert [r.tokens for r in got] == [w.tokens for w in want]
        assert [r.stop_reason for r in got] == [w.stop_reason for w in want]
        for r, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)
    prompts, params = engine.llm.calls[-1]
    assert prompts == [[3, 4], [5], [7, 8, 9]] and params[0].max_tokens == 12 and params[0].end_id == 2
    sampled = SamplingParams(mode="rejection", temperature=1.5, max_new_tokens=12, stop_on_eos=False)
    one, again = engine.generate(REQS, sampled), engine.generate(REQS, sampled)
    other = engine.generate(REQS, replace(sampled, seed=1))
    assert _tokens(one) == _tokens(again) != _tokens(other)
    assert all(len(t) == 12 for t in _tokens(one)) and not any(r.stop_reason == "eos" for r in one.results)
    for req, r in zip(REQS, one.results):  # drawn at temperature 1.5: the log-probs say so
        seq = torch.tensor([list(req.prompt) + r.tokens])
        with torch.no_grad():
            logits = served.target(seq)[0, len(req.prompt) - 1: -1].float() / 1.5
        want_lp = logits.log_softmax(-1).gather(-1, torch.tensor(r.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), want_lp, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="return_hidden"):
        engine.generate([Request([3])], SamplingParams(max_new_tokens=4), return_hidden=True)


def _drafted_per_iteration(spec) -> float:
    """Draft tokens per decode iteration of the rollout (each request's context iteration drafts none)."""
    return spec.draft_tokens / (spec.iterations - spec.requests)


def test_the_policys_schedule_sets_the_draft_length_and_a_dropped_drafter_stops_it(served):
    """Each policy's draft_len_schedule reaches the workers and decides how many tokens each
    iteration drafts (tokens unchanged: greedy SD is lossless); without a drafter nothing is
    drafted, and a reloaded one drafts again."""
    engine = _speculating_engine(served)
    spec_config = standin.worker(engine).engine.model_engine.spec_config
    reqs, sp = REQS[:2], SamplingParams(mode="greedy", max_new_tokens=10, stop_on_eos=False)
    plain = _tokens(TorchRolloutEngine(served.target).generate(reqs, sp))
    for depth in (2, 4, 2):
        out = engine.generate(reqs, sp, policy=FixedSDPolicy(TreeShape(depth, 1, depth)))
        spec = engine.last_speculation
        assert _tokens(out) == plain and spec.requests == 2 and _drafted_per_iteration(spec) == depth
        assert spec_config.draft_len_schedule == {8: depth}
        assert len(out.stats.accept_lengths) == spec.iterations and sum(out.stats.accept_lengths) == 20
        assert engine.llm.calls[-1][1][0].return_perf_metrics
    sent = [args for method, args in engine.llm.rpcs if method == "set_draft_len_schedule"]
    assert sent == [({8: 2},), ({8: 4},), ({8: 2},)]
    engine.generate(reqs, sp, policy=FixedSDPolicy(TreeShape(2, 1, 2)))
    assert len(engine.llm.rpcs) == 3  # unchanged schedule: not sent again
    out = engine.generate(reqs, sp)  # no policy: speculation off
    assert _tokens(out) == plain and spec_config.draft_len_schedule == {1: 0}
    assert out.stats.accept_lengths == [] and engine.last_speculation is None
    assert not engine.llm.calls[-1][1][0].return_perf_metrics
    engine.load_drafter(None)
    with pytest.raises(ValueError, match="no drafter is loaded"):
        engine.generate(reqs, sp, policy=FixedSDPolicy(TreeShape(2, 1, 2)))
    assert spec_config.draft_len_schedule == {1: 0}
    other = _exported_drafter(tiny_config(num_layers=3), served.tmp / "other", seed=7)
    drafter = standin.worker(engine).engine.model_engine.model.draft_model
    written = read_state_dict(other)
    assert not torch.equal(drafter.state_dict()["fc.weight"], written["fc.weight"])
    engine.load_drafter(other)  # the unverified drafter refit: into the draft module by name
    assert all(torch.equal(drafter.state_dict()[n], t) for n, t in written.items())
    out = engine.generate(reqs, sp, policy=FixedSDPolicy(TreeShape(3, 1, 3)))
    assert _tokens(out) == plain and _drafted_per_iteration(engine.last_speculation) == 3
    with pytest.raises(ValueError, match="not a torch|EAGLE-3 HF folder"):
        engine.load_drafter(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"trained on target layers \[1, 2\]"):
        engine.load_drafter(_exported_drafter(tiny_config(num_layers=3), served.tmp / "two", capture_layers=(1, 2)))


def _perf(llm, prompts, max_tokens=8):
    """What the LLM reports per request for a plain greedy call: (decoding_iter, draft tokens)."""
    params = standin.SamplingParams(max_tokens=max_tokens, end_id=-1, detokenize=False, return_perf_metrics=True)
    return [(o.decoding_iter, o.outputs[0].request_perf_metrics.speculative_decoding.total_draft_tokens)
            for o in llm.generate(prompts, [params] * len(prompts))]


def test_the_worker_extension_installs_the_schedule_by_batch_size(served):
    """``TLTWorkerExtension.set_draft_len_schedule`` (called as the engine calls it, through
    ``_collective_rpc``) decides speculation from the next iteration on, by the running batch
    size: {1: 3} drafts 3 tokens per iteration for one request and none for two; {} none at all."""
    engine = _speculating_engine(served)
    ext = standin.worker(engine)
    assert isinstance(ext, importlib.import_module(standin.WORKER_MODULE).TLTWorkerExtension)
    engine.llm._collective_rpc("set_draft_len_schedule", ({1: 3},))
    assert ext.engine.model_engine.spec_config.draft_len_schedule == {1: 3}
    (iters, drafted), = _perf(engine.llm, [[3, 4]])
    assert iters > 1 and drafted == 3 * (iters - 1)
    assert [d for _, d in _perf(engine.llm, [[3, 4], [5, 6]])] == [0, 0]  # batch 2: above the largest key
    ext.set_draft_len_schedule({2: 2, 1: 4})
    assert list(ext.engine.model_engine.spec_config.draft_len_schedule.items()) == [(1, 4), (2, 2)]
    assert all(drafted == 2 * (iters - 1) for iters, drafted in _perf(engine.llm, [[3, 4], [5, 6]]))
    ext.set_draft_len_schedule({})
    assert _perf(engine.llm, [[3, 4]]) == [(8, 0)]  # one token per iteration, nothing drafted
    plain = TRTLLMRolloutEngine.from_hf_folder(served.folder, max_batch_size=8)
    with pytest.raises(ValueError, match="built without a speculative_config"):
        plain.llm._collective_rpc("set_draft_len_schedule", ({1: 3},))


def test_policy_weights_refit_changes_the_tokens_and_back(served):
    """load_policy_weights reaches the served model (update_weights buckets, then the finalising
    call): other weights give their own model's tokens, the original weights the original tokens;
    a stream refused before its first bucket changes nothing."""
    engine = _speculating_engine(served)
    sp = SamplingParams(mode="greedy", max_new_tokens=12)
    before = _tokens(engine.generate(REQS, sp))
    other = tiny_target(seed=5, num_layers=3)
    want = _tokens(TorchRolloutEngine(other).generate(REQS, sp))
    assert want != before
    engine.load_policy_weights(other.state_dict())
    assert _tokens(engine.generate(REQS, sp)) == want
    refits = [args for method, args in engine.llm.rpcs if method == "update_weights"]
    assert len(refits) == 2 and refits[-1] == (None,)  # one bucket (the tiny model), then the finalising call
    assert standin.worker(engine).engine.prefix_cache_resets == 1
    engine.load_policy_weights(iter(served.target.state_dict().items()))
    assert _tokens(engine.generate(REQS, sp)) == before
    name, tensor = next(iter(served.target.state_dict().items()))
    with pytest.raises(ValueError, match="was given twice"):
        engine.load_policy_weights([(name, other.state_dict()[name]), (name, tensor)])
    assert _tokens(engine.generate(REQS, sp)) == before


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
