"""The interfaces our adapters must meet, as read from the real sources (facts, with the
commit each was read at), and the checks that hold an adapter to them.

NeMo-RL, NeMo-Aligner and TensorRT-LLM cannot be imported where nemo-tlt is tested, so
their method signatures, output keys and config-class fields are written down here
(docs/nemo.md and docs/trtllm.md say the same in prose). The tests in
``tests/integrations`` check the adapters against these facts, and the stand-in
TensorRT-LLM module in ``tests/rollout`` refuses any keyword not listed here. When a
package moves, re-read its source, update the facts and the commit, and let the tests
show which adapter code must follow.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

NEMO_RL_SOURCE = "NVIDIA-NeMo/RL@7ea279abfbeb698b092856d0dab61e7cf39bc909"
NEMO_ALIGNER_SOURCE = "NVIDIA/NeMo-Aligner@af2b3bd96ad78190f6ebfb552b9e599e313ce027"
TRTLLM_LLM_ARGS_SOURCE = "NVIDIA/TensorRT-LLM@0004396720054fd8e205cbf616f21f0b57c6b412"
TRTLLM_SAMPLING_SOURCE = "NVIDIA/TensorRT-LLM@000a01de66f0eab4ab05640711f0253f50f5209c"
TRTLLM_LLM_SOURCE = "NVIDIA/TensorRT-LLM@00966934ce32e0603a33f8c922525cf3678afab4"
TRTLLM_RLHF_SOURCE = "NVIDIA/TensorRT-LLM@04762f3b82e2410c84ccdfd7901844831147668a"
TRTLLM_RESULT_SOURCE = "NVIDIA/TensorRT-LLM@005bc848893f575ec14b45d6b13139360d67c790"
TRTLLM_SPEC_STATS_SOURCE = "NVIDIA/TensorRT-LLM@a678b91aafbeff265cd0b764abb59d7def624ac2"  # executor/result.py
# The release pinned (rollout/trtllm_config.py) is v1.3.0rc29 = c76f4a8; its tree could not be read
# here (the repository's snapshot is too large to fetch, and the stored-file index holds none of the
# rc24-rc29 commits), so each fact below names the stored copy it was read in.
TRTLLM_SPEC_SAMPLER_SOURCE = "NVIDIA/TensorRT-LLM@006567a7b85d72e256e4863bf65ae843ba8d3a7b"
TRTLLM_MODEL_LOADER_SOURCE = "NVIDIA/TensorRT-LLM@b51992a331532b80cb943098d3b1891762feb5f5"
TRTLLM_ASYNC_LLM_SOURCE = "NVIDIA/TensorRT-LLM@62e51e522c151e9ec8631eae540c32cbeb925362"

POSITIONAL = "POSITIONAL_OR_KEYWORD"
KEYWORD_ONLY = "KEYWORD_ONLY"
VAR_POSITIONAL = "VAR_POSITIONAL"
VAR_KEYWORD = "VAR_KEYWORD"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # a parameter without a default


@dataclass(frozen=True)
class Param:
    name: str
    kind: str = POSITIONAL
    default: Any = REQUIRED
    annotation: str = ""  # the real source's annotation, as written there (documentation)


@dataclass(frozen=True)
class Method:
    """A method the real package calls (``params`` after ``self``). ``abstract``: the real
    base class declares it abstract; ``called``: the real caller calls it, so an adapter
    standing in for the real class must have it."""

    name: str
    params: tuple[Param, ...]
    returns: str
    abstract: bool = False
    called: bool = True


@dataclass(frozen=True)
class TensorKey:
    """One key of a dict of tensors. ``dtype``: a torch dtype, or ``"like:<key>"`` (the
    dtype of that input key). ``shape``: symbols (``B`` batch, ``S`` padded output length,
    ``T`` padded input length) or ints."""

    name: str
    dtype: Any
    shape: tuple[Any, ...]
    required: bool = True


@dataclass(frozen=True)
class Interface:
    name: str
    source: str  # repository@commit:path
    methods: tuple[Method, ...]
    inputs: tuple[TensorKey, ...] = ()
    outputs: tuple[TensorKey, ...] = ()

    def method(self, name: str) -> Method:
        return next(m for m in self.methods if m.name == name)


# ---- NeMo-RL: nemo_rl/models/generation/interfaces.py --------------------------------------------
_ARGS = (Param("args", VAR_POSITIONAL, annotation="Any"), Param("kwargs", VAR_KEYWORD, annotation="Any"))

NEMO_RL_GENERATION = Interface(
    name="GenerationInterface",
    source=f"{NEMO_RL_SOURCE}:nemo_rl/models/generation/interfaces.py",
    methods=(
        Method("init_collective", (Param("ip", annotation="str"), Param("port", annotation="int"),
                                   Param("world_size", annotation="int"),
                                   Param("train_world_size", KEYWORD_ONLY, annotation="int")),
               "list[ray.ObjectRef]", abstract=True),
        Method("generate", (Param("data", annotation='BatchedDataDict["GenerationDatumSpec"]'),
                            Param("greedy", annotation="bool")),
               'BatchedDataDict["GenerationOutputSpec"]', abstract=True),
        Method("prepare_for_generation", _ARGS, "bool", abstract=True),
        Method("finish_generation", _ARGS, "bool", abstract=True),
        Method("shutdown", (), "bool", abstract=True),
        Method("prepare_refit_info", (Param("state_dict_info", annotation="dict[str, Any]"),), "None"),
        Method("update_weights_from_collective", (), "list[ray.ObjectRef]"),
        # base raises NotImplementedError; GRPO's refit_policy_generation calls it in colocated mode
        # (the default), after the policy's stream_weights_via_ipc_zmq
        Method("update_weights_via_ipc_zmq", (), "list[ray.ObjectRef]"),
    ),
    # GenerationDatumSpec (stop_strings: NotRequired[list[str]])
    inputs=(TensorKey("input_ids", torch.long, ("B", "T")), TensorKey("input_lengths", torch.long, ("B",))),
    # GenerationOutputSpec; dtypes as NeMo-RL's own backends make them (sglang_generation.py,
    # megatron_worker.py at the same commit): output_ids in the input's dtype, logprobs float32
    # right-padded with zeros over the prompt and after the response
    outputs=(TensorKey("output_ids", "like:input_ids", ("B", "S")),
             TensorKey("generation_lengths", torch.long, ("B",)),
             TensorKey("unpadded_sequence_lengths", torch.long, ("B",)),
             TensorKey("logprobs", torch.float32, ("B", "S")),
             TensorKey("truncated", torch.bool, ("B",), required=False)),
)
NEMO_RL_DATUM_OPTIONAL = ("stop_strings",)

# ---- NeMo-Aligner: nemo_aligner/utils/trt_llm.py (GPTGenerateTRTLLM) as called by ----------------
# nemo_aligner/models/nlp/gpt/megatron_gpt_ppo_actor.py (and megatron_gpt_reinforce_actor.py):
# refit(self.model) in prepare_for_inference, generate((prompt_tokens, prompt_lengths)) in
# infer, free() in finish_inference.
NEMO_ALIGNER_GENERATE = Interface(
    name="GPTGenerateTRTLLM",
    source=f"{NEMO_ALIGNER_SOURCE}:nemo_aligner/utils/trt_llm.py",
    methods=(
        Method("refit", (Param("model"),), "None"),
        Method("generate", (Param("inputs", annotation="tuple[torch.Tensor, torch.Tensor]"),), "dict"),
        Method("free", (), "None"),
    ),
    inputs=(TensorKey("prompt_tokens", torch.long, ("B", "T")), TensorKey("prompt_lengths", torch.long, ("B",))),
    # response_tokens: prompt + response, cut to max(response_lengths), pads mapped to EOS
    outputs=(TensorKey("response_tokens", torch.long, ("B", "S")),
             TensorKey("response_lengths", torch.long, ("B",))),
)
# GPTGenerateTRTLLM.__init__'s keywords, as the actors pass them (our backend is built from the
# config instead: read_aligner_config)
NEMO_ALIGNER_GENERATE_INIT = (
    "model_cfg", "end_strings", "tokenizer", "sample_temperature", "sample_top_k", "sample_top_p",
    "repetition_penalty", "max_generation_length", "max_input_len", "generation_batch_size", "use_greedy",
    "trt_model_type", "seed", "unload_engine_train", "reshard_model", "trt_model_dir")

# ---- TensorRT-LLM ------------------------------------------------------------------------------------
# tensorrt_llm/llmapi/llm_args.py: DecodingBaseConfig -> EagleDecodingConfig -> Eagle3DecodingConfig
# (pydantic StrictBaseModel: an unknown field is an error; speculative_model_dir is an alias)
TRTLLM_EAGLE3_FIELDS = frozenset({
    # DecodingBaseConfig
    "max_draft_len", "max_total_draft_tokens", "speculative_model", "speculative_model_dir", "max_concurrency",
    "draft_len_schedule", "load_format", "acceptance_rate_window_size", "acceptance_rate_threshold",
    "use_rejection_sampling", "allow_advanced_sampling", "advanced_sampling_mode", "enable_penalty",
    # EagleDecodingConfig
    "decoding_type", "eagle_choices", "greedy_sampling", "posterior_threshold", "use_dynamic_tree",
    "dynamic_tree_max_topK", "num_eagle_layers", "max_non_leaves_per_layer", "eagle3_one_model",
    "eagle3_layers_to_capture", "eagle3_model_arch",
    # Eagle3DecodingConfig
    "sa_config",
})
# tensorrt_llm/sampling_params.py: SamplingParams (a dataclass; init fields)
TRTLLM_SAMPLING_FIELDS = frozenset({
    "end_id", "pad_id", "max_tokens", "bad", "bad_token_ids", "stop", "stop_token_ids",
    "include_stop_str_in_output", "embedding_bias", "logits_processor", "apply_batched_logits_processor", "n",
    "best_of", "use_beam_search", "top_k", "top_p", "top_p_min", "top_p_reset_ids", "top_p_decay", "seed",
    "temperature", "min_tokens", "beam_search_diversity_rate", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "length_penalty", "early_stopping", "no_repeat_ngram_size", "min_p", "beam_width_array",
    "logprobs", "logprobs_mode", "prompt_logprobs", "return_context_logits", "return_generation_logits",
    "exclude_input_from_output", "return_encoder_output", "return_perf_metrics", "additional_model_outputs",
    "lookahead_config", "guided_decoding", "ignore_eos", "detokenize", "add_special_tokens",
    "truncate_prompt_tokens", "skip_special_tokens", "spaces_between_special_tokens",
})
# tensorrt_llm.LLM(**TorchLlmArgs): the fields our engine passes. NOT re-read here (llm_args.py's
# TorchLlmArgs was not found in the stored text): named by the engine code written against
# TRTLLM_LLM_ARGS_SOURCE; the stand-in LLM refuses anything else.
TRTLLM_LLM_FIELDS = frozenset({
    "model", "tensor_parallel_size", "pipeline_parallel_size", "max_batch_size", "orchestrator_type",
    "ray_worker_extension_cls", "allreduce_strategy", "load_format", "skip_tokenizer_init", "speculative_config",
})
# SamplingParams.logprobs (Optional[int], "number of log probabilities to return per output token")
# is among the fields above; what comes back (tensorrt_llm/executor/result.py at TRTLLM_RESULT_SOURCE):
# CompletionOutput.logprobs: LogprobResults = list[dict[int, Logprob]], one dict per generated token
# (asserted len == len(token_ids) unless cancelled), Logprob(logprob: float, rank: Optional[int]).
# Which logits they are computed from (raw or after temperature / top-k / top-p) is NOT stated there;
# a later TensorRT-LLM test reads "LogprobMode.RAW (the default) computes them from the unprocessed
# logits" (a logprobs_mode field not in the SamplingParams read above): unverified for our pin.
TRTLLM_COMPLETION_FIELDS = frozenset({"token_ids", "finish_reason", "logprobs", "request_perf_metrics"})  # we read
TRTLLM_LOGPROB_FIELDS = frozenset({"logprob", "rank"})
# Per-request speculation (tensorrt_llm/executor/result.py at TRTLLM_SPEC_STATS_SOURCE): GenerationResultBase,
# which RequestOutput extends, sets from each runtime response `decoding_iter` (int: the decode iterations
# the request ran) and `avg_decoded_tokens_per_iter` (Optional[float], "Average decoded tokens per runtime
# iteration"; None until reported); CompletionOutput.request_perf_metrics (tllm.RequestPerfMetrics, set when
# the response carries one). Its `speculative_decoding` counters (`acceptance_rate`,
# `total_accepted_draft_tokens`, `total_draft_tokens`) are filled with SamplingParams(return_perf_metrics=True)
# and TensorRT-LLM's acceptance length is the iteration-weighted mean of avg_decoded_tokens_per_iter (weight
# decoding_iter): read in tensorrt_llm/evaluate/lm_eval.py (`_log_spec_stats`) in a stored copy whose commit
# the search index does not name (NOT at a pinned commit), and in the Triton client's perf-metric names.
TRTLLM_REQUEST_OUTPUT_FIELDS = frozenset({"outputs", "decoding_iter", "avg_decoded_tokens_per_iter"})  # we read
TRTLLM_PERF_METRICS_FIELDS = frozenset({"speculative_decoding"})  # the one we read
TRTLLM_SPEC_METRICS_FIELDS = frozenset({"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"})
# tensorrt_llm/llmapi/llm.py: LLM.generate(inputs, sampling_params=None, use_tqdm=True, ...) returning
# one RequestOutput per prompt (.outputs[0].token_ids, .outputs[0].finish_reason)
TRTLLM_GENERATE = Method("generate", (Param("inputs"), Param("sampling_params", default=None),
                                      Param("use_tqdm", default=True)), "list[RequestOutput]")
# tensorrt_llm/llmapi/rlhf_utils.py: WorkerExtension.update_weights(ipc_handles: Optional[dict] = None):
# {device UUID: [(HF parameter name, CUDA IPC handle)]} loads a partial set (model_loader.reload,
# allow_partial_loading=True); None finalises. The one-model speculative target's load_weights passes
# skip_modules=["draft_model"] (_torch/models/modeling_speculative.py, SpecDecOneEngineForCausalLM, stored
# copy without a commit): a drafter's tensors sent this way are dropped, silently. The Ray GPU worker
# reports its GPU as report_device_id() = get_device_uuid(local index), and
# tensorrt_llm._torch.utils.get_device_uuid(i) = "GPU-" + str(torch.cuda.get_device_properties(i).uuid)
# (stored copies without a commit).
TRTLLM_WORKER_RPCS = {"update_weights": 1, "report_device_id": 0}
# Speculation and log-probs (_torch/speculative/spec_sampler_base.py at TRTLLM_SPEC_SAMPLER_SOURCE,
# SpecSampler.validate_request): a request with logprobs, prompt_logprobs / return_context_logits or
# return_generation_logits is refused at admission: "The following output options are not supported with
# speculative decoding: {...}. Drop these options from the request, or disable speculative decoding."
# (an older copy asserts instead). Log-prob mode: SamplingParams(logprobs_mode=LogprobMode.RAW |
# LogprobMode.PROCESSED), LogprobMode importable from tensorrt_llm.sampling_params (TensorRT-LLM's own
# tests, stored copy without a commit); RAW from the unprocessed logits (a TensorRT-LLM test calls it the
# default; the field's declared default was not read), so the engine always names the mode.
# Load formats (_torch/pyexecutor/model_loader.py at TRTLLM_MODEL_LOADER_SOURCE): AUTO reads the target,
# then the speculative model's checkpoint into the draft module; DUMMY randomises every float tensor,
# the draft module's included (U(-1e-3, 1e-3)), and never reads the speculative model's weights.
# RL settings (_torch/async_llm.py at TRTLLM_ASYNC_LLM_SOURCE): AsyncLLM forces orchestrator_type="ray",
# allreduce_strategy="NCCL" (its comment: for TP > 1) and defaults ray_worker_extension_cls to
# "tensorrt_llm.llmapi.rlhf_utils.WorkerExtension"; TorchLlmArgs.allreduce_strategy (llm_args.py at
# TRTLLM_LLM_ARGS_SOURCE) takes 'AUTO' | 'NCCL' | ... on the plain LLM too.
# draft_len_schedule (llm_args.py): keys >= 1, lengths >= 0, the smallest key's length == max_draft_len,
# none above it; read each iteration; CUDA graphs are captured at start-up per batch size at that batch
# size's scheduled length (model_engine.py, stored copy without a commit): the schedule is fixed per LLM.


# ---- checks ---------------------------------------------------------------------------------------
def signature_deviations(fn: Callable[..., Any], method: Method) -> list[str]:
    """How ``fn`` (a bound method or a function without ``self``) fails to accept every
    call the real caller can make of ``method``: each fact parameter present under the
    same name, kind and position, with a default wherever the fact has one; any extra
    parameter of ``fn`` optional."""
    where = f"{method.name}"
    params = [p for p in inspect.signature(fn).parameters.values()]
    by_name = {p.name: p for p in params}
    problems = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    fact_positional = [p for p in method.params if p.kind == POSITIONAL]
    for i, fact in enumerate(method.params):
        mine = by_name.get(fact.name)
        if fact.kind in (VAR_POSITIONAL, VAR_KEYWORD):
            if not any(p.kind.name == fact.kind for p in params):
                problems.append(f"{where}: takes no {'*' if fact.kind == VAR_POSITIONAL else '**'}{fact.name}")
            continue
        if mine is None:
            problems.append(f"{where}: has no parameter {fact.name!r}")
            continue
        if mine.kind.name != fact.kind:
            problems.append(f"{where}: parameter {fact.name!r} is {mine.kind.name}, the interface's is {fact.kind}")
        if fact.kind == POSITIONAL:
            at = fact_positional.index(fact)
            if at >= len(positional) or positional[at].name != fact.name:
                problems.append(f"{where}: parameter {fact.name!r} is not at position {at}")
        if fact.default is not REQUIRED and mine.default is inspect.Parameter.empty:
            problems.append(f"{where}: parameter {fact.name!r} needs the default {fact.default!r}")
        elif fact.default is not REQUIRED and mine.default != fact.default:
            problems.append(f"{where}: parameter {fact.name!r} defaults to {mine.default!r}, "
                            f"the interface's to {fact.default!r}")
    names = {p.name for p in method.params}
    for p in params:
        if p.name not in names and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
                and p.default is inspect.Parameter.empty:
            problems.append(f"{where}: extra parameter {p.name!r} has no default (the caller never passes it)")
    return problems


def interface_deviations(obj: Any, interface: Interface) -> list[str]:
    """Every method the real caller calls (or the real base declares abstract) that ``obj``
    lacks or whose signature does not accept the real calls."""
    problems = []
    for method in interface.methods:
        if not (method.abstract or method.called):
            continue
        fn = getattr(obj, method.name, None)
        if not callable(fn):
            problems.append(f"{interface.name}.{method.name}: missing")
            continue
        problems += [f"{interface.name}.{p}" for p in signature_deviations(fn, method)]
    return problems


def output_deviations(out: Mapping[str, Any], keys: tuple[TensorKey, ...], sizes: Mapping[str, int],
                      inputs: Mapping[str, torch.Tensor] | None = None) -> list[str]:
    """Every key of ``keys`` missing from ``out`` (when required), not a tensor, or of
    another dtype or shape; ``sizes`` gives the symbols' values (e.g. B, S)."""
    problems = []
    for key in keys:
        if key.name not in out:
            if key.required:
                problems.append(f"output key {key.name!r} is missing")
            continue
        value = out[key.name]
        if not isinstance(value, torch.Tensor):
            problems.append(f"output key {key.name!r} is a {type(value).__name__}, not a tensor")
            continue
        dtype = key.dtype
        if isinstance(dtype, str) and dtype.startswith("like:"):
            dtype = (inputs or {})[dtype[5:]].dtype
        if value.dtype != dtype:
            problems.append(f"output key {key.name!r} has dtype {value.dtype}, the interface's is {dtype}")
        shape = tuple(sizes[s] if isinstance(s, str) else s for s in key.shape)
        if tuple(value.shape) != shape:
            problems.append(f"output key {key.name!r} has shape {tuple(value.shape)}, expected {shape} "
                            f"({', '.join(map(str, key.shape))})")
    return problems


def refuse_unknown(kind: str, given: Mapping[str, Any], fields: frozenset[str]) -> None:
    """A TypeError naming the keywords ``kind`` does not have (as the real class raises)."""
    unknown = sorted(set(given) - fields)
    if unknown:
        raise TypeError(f"{kind} has no field(s) {unknown} (interface_facts)")
