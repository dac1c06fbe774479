"""Our side of the TensorRT-LLM engine: config, conversion, strict weight streams, the
missing-package error. TensorRT-LLM itself is never imported here: where the engine
object is needed, ``FakeTensorRTLLM`` (a stand-in module defined below, not TensorRT-LLM)
records what our code hands to the LLM API."""
from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.device import Placement
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
from nemo_tlt.integrations.interface_facts import (TRTLLM_COMPLETION_FIELDS, TRTLLM_EAGLE3_FIELDS,
                                                   TRTLLM_LOGPROB_FIELDS, TRTLLM_GENERATE, TRTLLM_LLM_FIELDS,
                                                   TRTLLM_PERF_METRICS_FIELDS, TRTLLM_REQUEST_OUTPUT_FIELDS,
                                                   TRTLLM_SAMPLING_FIELDS, TRTLLM_SPEC_METRICS_FIELDS,
                                                   TRTLLM_WORKER_RPCS, refuse_unknown, signature_deviations)
from nemo_tlt.model.hf_io import save_hf_folder
from nemo_tlt.rollout import trtllm_run
from nemo_tlt.rollout.config import RolloutConfig
from nemo_tlt.rollout.factory import build_rollout_engine, engine_tensor_parallel
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.trtllm_config import TRTLLM_REQUIREMENT, WORKER_EXTENSION, TRTLLMEngineConfig
from nemo_tlt.rollout.trtllm_run import TrainRunAsks, train_run_refusal, unsupported_settings
from nemo_tlt.rollout.trtllm_stats import speculation_report
from nemo_tlt.rollout.trtllm_engine import (TRTLLMRolloutEngine, canonical_shapes, check_drafter_layers,
                                            completion_to_result, import_tensorrt_llm, sampling_kwargs,
                                            trtllm_capture_layers, weight_buckets)
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
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
    fake_tensorrt_llm(monkeypatch)
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


def _exported_drafter(cfg, folder, capture_layers=None) -> str:
    drafter = Eagle3Drafter(Eagle3Config.from_target(cfg, capture_layers), generator=torch.Generator().manual_seed(0))
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


# ---- a stand-in module (NOT TensorRT-LLM) to check what our engine hands to the LLM API ----------
# Strict per interface_facts: a keyword, RPC or generate argument TensorRT-LLM's own class does not
# have is refused, so drift in our engine (or in the facts) shows here.
RPCS = {**TRTLLM_WORKER_RPCS, "set_draft_len_schedule": 1}  # WorkerExtension's, plus our extension's


class FakeLLM:
    def __init__(self, **kwargs):
        refuse_unknown("LLM", kwargs, TRTLLM_LLM_FIELDS)
        self.kwargs, self.rpcs, self.calls = kwargs, [], []

    def _collective_rpc(self, method, args):
        if method not in RPCS or len(args) != RPCS[method]:
            raise TypeError(f"no worker method {method}{args!r}")
        self.rpcs.append((method, args))

    # what each request reports about speculation: (avg_decoded_tokens_per_iter, decoding_iter) and, with
    # return_perf_metrics, speculative_decoding's (accepted, drafted) draft tokens
    SPECULATION = (1.5, 2, 1, 4)

    def generate(self, inputs, sampling_params=None, use_tqdm=True):
        self.calls.append((inputs, sampling_params))
        assert all(p.get("logprobs") == 1 for p in sampling_params)  # one log-prob per generated token
        avg, iters, accepted, drafted = self.SPECULATION
        results = []
        for params in sampling_params:
            perf = None
            if params.get("return_perf_metrics"):
                spec = SimpleNamespace(acceptance_rate=accepted / drafted, total_accepted_draft_tokens=accepted,
                                       total_draft_tokens=drafted)
                refuse_unknown("SpeculativeDecodingMetrics", vars(spec), TRTLLM_SPEC_METRICS_FIELDS)
                perf = SimpleNamespace(speculative_decoding=spec)
                refuse_unknown("RequestPerfMetrics", vars(perf), TRTLLM_PERF_METRICS_FIELDS)
            out = SimpleNamespace(token_ids=[5, 6], finish_reason="stop", logprobs=trtllm_logprobs([5, 6]),
                                  request_perf_metrics=perf)
            refuse_unknown("CompletionOutput", vars(out), TRTLLM_COMPLETION_FIELDS)
            refuse_unknown("Logprob", vars(out.logprobs[0][5]), TRTLLM_LOGPROB_FIELDS)
            result = SimpleNamespace(outputs=[out], decoding_iter=iters, avg_decoded_tokens_per_iter=avg)
            refuse_unknown("RequestOutput", vars(result), TRTLLM_REQUEST_OUTPUT_FIELDS)
            results.append(result)
        return results


def fake_sampling_params(**kw):
    refuse_unknown("SamplingParams", kw, TRTLLM_SAMPLING_FIELDS)
    return kw


def fake_eagle3(**kw):
    refuse_unknown("Eagle3DecodingConfig", kw, TRTLLM_EAGLE3_FIELDS)
    return ("Eagle3DecodingConfig", kw)


def fake_tensorrt_llm(monkeypatch):
    mod = types.ModuleType("tensorrt_llm")
    mod.LLM = FakeLLM
    mod.SamplingParams = fake_sampling_params
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.Eagle3DecodingConfig = fake_eagle3
    mod.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", mod)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)


def test_the_stand_ins_are_strict_and_match_the_facts():
    assert signature_deviations(FakeLLM.generate.__get__(object()), TRTLLM_GENERATE) == []
    with pytest.raises(TypeError, match="speculative_model_path"):
        fake_eagle3(max_draft_len=4, speculative_model_path="d")
    with pytest.raises(TypeError, match="max_new_tokens"):
        fake_sampling_params(max_new_tokens=4)
    with pytest.raises(TypeError, match="tokenizer_dir"):
        FakeLLM(model="m", tokenizer_dir="t")
    everything = TRTLLMEngineConfig(target_dir="t", drafter_dir="d", use_dynamic_tree=True, dynamic_tree_max_topk=4,
                                    max_concurrency=8, eagle3_layers_to_capture=(1, 2, 3))
    assert set(everything.speculative_kwargs()) <= TRTLLM_EAGLE3_FIELDS
    assert set(everything.llm_kwargs()) | {"speculative_config"} <= TRTLLM_LLM_FIELDS
    for sp in (SamplingParams(mode="greedy"), SamplingParams(mode="rejection", top_k=5, stop_on_eos=False)):
        assert set(sampling_kwargs(sp, 2, 0)) <= TRTLLM_SAMPLING_FIELDS


def test_engine_conversion_and_schedule_updates_against_a_fake_module(monkeypatch, tmp_path):
    fake_tensorrt_llm(monkeypatch)
    folder = save_hf_folder(tiny_target(num_layers=3), tmp_path / "t")
    drafter_dir = _exported_drafter(tiny_config(num_layers=3), tmp_path / "d")
    engine = TRTLLMRolloutEngine.from_hf_folder(folder, drafter_dir=drafter_dir, max_draft_len=4, max_batch_size=8,
                                                eagle3_layers_to_capture=(0, 1, 2))
    assert engine.llm.kwargs["speculative_config"][1]["speculative_model"] == drafter_dir
    assert engine.model_config == tiny_config(num_layers=3)
    out = engine.generate([Request([3, 4]), Request([5], seq_id=9)], SamplingParams(max_new_tokens=4),
                          policy=FixedSDPolicy(TreeShape(2, 1, 2)))
    assert [r.tokens for r in out.results] == [[5, 6, 2], [5, 6, 2]]
    assert [r.logprobs[:2] for r in out.results] == [[-0.5, -1.5]] * 2  # EOS appended: NaN
    assert out.stats.tokens_generated == 6
    # per-request acceptance (1.5 tokens per iteration over 2 iterations, 1 of 4 drafts accepted per request)
    assert out.stats.accept_lengths == [2, 1, 2, 1] and out.stats.mean_accept_len == 1.5
    spec = engine.last_speculation
    assert (spec.requests, spec.iterations, spec.accepted_draft_tokens, spec.draft_tokens) == (2, 4, 2, 8)
    prompts, params = engine.llm.calls[-1]
    assert prompts == [[3, 4], [5]] and params[0]["max_tokens"] == 4 and params[0]["return_perf_metrics"]
    assert engine.llm.rpcs == [("set_draft_len_schedule", ({8: 2},))]
    engine.generate([Request([3])], SamplingParams(max_new_tokens=4), policy=FixedSDPolicy(TreeShape(2, 1, 2)))
    assert len(engine.llm.rpcs) == 1  # unchanged schedule: not sent again
    plain = engine.generate([Request([3])], SamplingParams(max_new_tokens=4))
    assert engine.llm.rpcs[-1] == ("set_draft_len_schedule", ({},))
    # speculation off: no acceptance reported (as the torch engine's plain steps), no perf metrics asked
    assert plain.stats.accept_lengths == [] and engine.last_speculation is None
    assert "return_perf_metrics" not in engine.llm.calls[-1][1][0]
    with pytest.raises(ValueError, match="return_hidden"):
        engine.generate([Request([3])], SamplingParams(max_new_tokens=4), return_hidden=True)
    with pytest.raises(ValueError, match="not a torch|EAGLE-3 HF folder"):
        engine.load_drafter(torch.nn.Linear(1, 1))
    other_layers = _exported_drafter(tiny_config(num_layers=3), tmp_path / "other", capture_layers=(1, 2))
    with pytest.raises(ValueError, match=r"trained on target layers \[1, 2\]"):
        engine.load_drafter(other_layers)


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
