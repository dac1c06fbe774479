"""A stand-in ``tensorrt_llm`` module for tests (NOT TensorRT-LLM): it generates from the request.

`install(monkeypatch)` puts it where ``import tensorrt_llm`` finds it. Its ``LLM`` serves the
HF folder named by ``model`` with the embedded torch engine and, with a ``speculative_config``,
drafts with the EAGLE-3 folder named by ``speculative_model``, so what our
``TRTLLMRolloutEngine`` hands over decides what comes back: the prompts, the sampling, the
draft-length schedule, the refitted weights. What it follows of upstream (the commits are
in ``nemo_tlt.integrations.interface_facts`` and docs/trtllm.md):

* keyword arguments, sampling fields and config fields are held to interface_facts (an
  unknown one is a TypeError, as the real pydantic / dataclass classes raise);
* ``SamplingParams._greedy_decoding`` (sampling_params.py at ``TRTLLM_SAMPLING_SOURCE``): greedy
  when ``top_k`` is None or 1 and ``top_p`` is None or 0.0 (the temperature plays no part);
  ``max_tokens`` defaults to 32, ``temperature`` None is 1.0;
* ``max_concurrency=n`` is the schedule ``{n: max_draft_len}`` and excludes ``draft_len_schedule``;
  at build time the smallest key maps to ``max_draft_len`` and no length exceeds it; each
  iteration drafts a chain of the length the schedule gives the running batch size (the
  smallest key >= it; none: 0, plain decoding), read from ``engine.model_engine.spec_config``
  where our worker extension writes it; no schedule at all: ``max_draft_len`` always;
* ``orchestrator_type='ray'`` workers are built from ``ray_worker_extension_cls`` (imported by
  path, as TensorRT-LLM's Ray workers do: TensorRT-LLM's own rlhf ``WorkerExtension`` here) mixed
  into a worker whose ``engine`` holds ``model_engine.{model, spec_config, model_loader}`` and
  which reports its GPU's UUID (``report_device_id``; the worker's device is
  ``LLM.worker_device``, 0 unless a test moves it); ``_collective_rpc(method, args)`` calls the
  method on each worker; ``WorkerExtension.update_weights`` (rlhf_utils.py at
  ``TRTLLM_RLHF_SOURCE``) takes the payload keyed by the worker's UUID (another key: "Device
  UUID ... not found"), loads a partial set of named tensors per call, skipping the draft
  module's (``load_weights(skip_modules=["draft_model"])`` upstream: silently), and ``None``
  finalises (post-load hooks, prefix-cache reset); ``shutdown`` ends the LLM (``LLM.built``
  lists every LLM made, restarts included);
* ``load_format='dummy'`` randomises the whole one-model, the drafter included, whose folder's
  weights are never read (its config is);
* a request asking for log-probs (``logprobs`` or ``prompt_logprobs``) while a speculative config
  is set fails with upstream's message (``SpecSampler.validate_request``); ``logprobs_mode``
  ``RAW`` reports the raw log-softmax (temperature 1, no top-k / top-p), ``PROCESSED`` the
  sampling transform's (0 for greedy: top-k 1 leaves one token); RAW is the stand-in's default
  (upstream's default was not read);
* per request: ``decoding_iter`` (here: the context iteration plus the decode iterations),
  ``avg_decoded_tokens_per_iter``, and with ``return_perf_metrics`` the draft tokens accepted
  and drafted; ``CompletionOutput.logprobs`` one ``{token id: Logprob}`` per token with
  ``logprobs>=1``.

Where it is a stand-in, not a copy:

* CUDA IPC handles cannot exist on a CPU: `install` replaces the engine's ``_copy_to_device``
  with `cpu_copy`, so the payload ({device UUID: [(name, (rebuild, args))]}) holds CPU tensors,
  and the worker rebuilds them with ``rebuild(*args)`` (upstream also moves the rebuilt tensor
  to its device).
* generating between an ``update_weights`` bucket and the finalising ``update_weights(None)``
  is refused (upstream serves weights whose post-load processing has not run: undefined).
* sampled (non-greedy) requests of one call draw from one generator seeded by all their
  seeds (upstream: one stream per request), and one call's requests must share every other
  sampling field; fields it cannot emulate (stop words, beams, penalties, ...) are refused
  when set.
* log-probs carry rank 1 for greedy and None otherwise (only the generated token's entry);
  PROCESSED ones are the torch engine's (``RequestResult.logprobs``), RAW ones a full forward's.
* token ids end with the EOS where the request stopped on it (whether TensorRT-LLM returns
  it is not recorded); ``load_format='dummy'`` serves zero weights until the first refit
  (upstream: U(-1e-3, 1e-3)), the drafter random ones.
"""
from __future__ import annotations

import enum
import hashlib
import importlib
import importlib.machinery
import sys
import types
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Optional

import torch

from nemo_tlt.drafter.eagle3 import Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import read_eagle3_hf
from nemo_tlt.integrations.interface_facts import (TRTLLM_COMPLETION_FIELDS, TRTLLM_EAGLE3_FIELDS,
                                                   TRTLLM_LLM_FIELDS, TRTLLM_LOGPROB_FIELDS,
                                                   TRTLLM_PERF_METRICS_FIELDS, TRTLLM_REQUEST_OUTPUT_FIELDS,
                                                   TRTLLM_SAMPLING_FIELDS, TRTLLM_SPEC_METRICS_FIELDS,
                                                   refuse_unknown)
from nemo_tlt.model.hf_io import read_config
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams as OurSampling
from nemo_tlt.speculative.tree_shape import TreeShape

DRAFT_PREFIX = "draft_model."  # SpecDecOneEngineForCausalLM.draft_model
SPEC_LOGPROBS_REFUSAL = ("The following output options are not supported with speculative decoding: {}. Drop these "
                         "options from the request, or disable speculative decoding.")


class LogprobMode(enum.Enum):
    """``tensorrt_llm.sampling_params.LogprobMode`` (the members the engine names)."""

    RAW = "raw"
    PROCESSED = "processed"


# ---- configuration classes -----------------------------------------------------------------------
class Eagle3DecodingConfig:
    """``tensorrt_llm.llmapi.Eagle3DecodingConfig``: fields as attributes, unset ones None."""

    def __init__(self, **kwargs: Any) -> None:
        refuse_unknown("Eagle3DecodingConfig", kwargs, TRTLLM_EAGLE3_FIELDS)
        for name in TRTLLM_EAGLE3_FIELDS:
            setattr(self, name, kwargs.get(name))
        self.given = dict(kwargs)
        if self.speculative_model is None:
            self.speculative_model = self.speculative_model_dir  # the alias
        if self.max_draft_len is None or self.speculative_model is None:
            raise ValueError("Eagle3DecodingConfig needs max_draft_len and speculative_model")
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            raise ValueError("Eagle3DecodingConfig: max_concurrency and draft_len_schedule are mutually exclusive")
        if self.max_concurrency is not None:
            self.draft_len_schedule = {self.max_concurrency: self.max_draft_len}
        if self.draft_len_schedule is not None:
            schedule = dict(sorted(self.draft_len_schedule.items()))
            if schedule[min(schedule)] != self.max_draft_len or max(schedule.values()) > self.max_draft_len:
                raise ValueError(f"draft_len_schedule {schedule}: the smallest key must map to max_draft_len "
                                 f"({self.max_draft_len}) and no length may exceed it")
            self.draft_len_schedule = schedule


class SamplingParams:
    """``tensorrt_llm.SamplingParams``: the fields of interface_facts, upstream's defaults for
    those the stand-in reads; a field it cannot emulate, set, is refused."""

    DEFAULTS = {"end_id": None, "max_tokens": 32, "top_k": None, "top_p": None, "temperature": None, "seed": None,
                "logprobs": None, "logprobs_mode": LogprobMode.RAW, "prompt_logprobs": None,
                "return_perf_metrics": False, "detokenize": True, "ignore_eos": False, "n": 1,
                "best_of": None, "use_beam_search": False, "exclude_input_from_output": True}

    def __init__(self, **kwargs: Any) -> None:
        refuse_unknown("SamplingParams", kwargs, TRTLLM_SAMPLING_FIELDS)
        ignored = sorted(k for k, v in kwargs.items() if k not in self.DEFAULTS and v is not None)
        if ignored:
            raise NotImplementedError(f"the stand-in SamplingParams does not emulate {ignored}")
        for name, default in self.DEFAULTS.items():
            setattr(self, name, kwargs.get(name, default))
        self.given = dict(kwargs)
        if self.n != 1 or self.best_of not in (None, 1) or self.use_beam_search:
            raise NotImplementedError("the stand-in returns one sequence per request (n=1, no beams)")
        if not self.exclude_input_from_output:
            raise NotImplementedError("the stand-in returns generated tokens only")

    @property
    def _greedy_decoding(self) -> bool:
        return (not self.use_beam_search and (self.top_k is None or self.top_k == 1)
                and (self.top_p is None or self.top_p == 0.0))

    def without_seed(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.DEFAULTS if k != "seed"}


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int]


# ---- the executor behind the workers ---------------------------------------------------------------
class _Iterations:
    """A `SpecPolicy` that decides each iteration as TensorRT-LLM's executor does (the
    schedule's draft length at the running batch size, a chain), and counts per request
    what TensorRT-LLM reports: iterations and draft tokens while it ran."""

    def __init__(self, spec_config: Eagle3DecodingConfig | None) -> None:
        self.spec_config = spec_config
        self.iterations = 1  # the context iteration gives each request its first token
        self.drafted = 0
        self.per_request: dict[int, tuple[int, int]] = {}

    def draft_len(self, running: int) -> int:
        spec = self.spec_config
        if spec is None:
            return 0
        if spec.draft_len_schedule is None:
            return spec.max_draft_len
        keys = [k for k in sorted(spec.draft_len_schedule) if k >= running]
        length = spec.draft_len_schedule[keys[0]] if keys else 0
        if length > spec.max_draft_len:  # the draft buffers are sized by max_draft_len
            raise ValueError(f"draft_len_schedule gives {length} at batch size {running}, above max_draft_len "
                             f"{spec.max_draft_len}")
        return length

    def begin_rollout(self) -> None:
        pass

    def choose(self, num_running: int) -> TreeShape | None:
        n = self.draft_len(num_running)
        return TreeShape(n, 1, n) if n else None

    def observe(self, num_running: int, shape: TreeShape | None, tokens_generated: int, elapsed_s: float) -> None:
        self.iterations += 1
        self.drafted += shape.depth if shape is not None else 0

    def finished(self, index: int, result: Any) -> None:
        self.per_request[index] = (self.iterations, self.drafted)


class _ModelLoader:
    def reload(self, model: "_OneModel", weights: dict[str, torch.Tensor], allow_partial_loading: bool = False):
        params = model.named_tensors()
        for name, tensor in weights.items():
            if name not in params:
                raise KeyError(f"stand-in model_loader: no parameter {name!r}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"stand-in model_loader: {name!r} has shape {tuple(tensor.shape)}, the model "
                                 f"{tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(tensor)
        if not allow_partial_loading and set(weights) != set(params):
            raise ValueError("stand-in model_loader: a partial load without allow_partial_loading")


class _OneModel(torch.nn.Module):
    """The one-model target: its parameters under their HF names, the drafter's under
    ``draft_model.``."""

    def __init__(self, target: DecoderLM, drafter: Eagle3Drafter | None) -> None:
        super().__init__()
        self.target, self.draft_model = target, drafter

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out = dict(self.target.state_dict())
        if self.draft_model is not None:
            out.update({DRAFT_PREFIX + n: t for n, t in self.draft_model.state_dict().items()})
        return out


class _Executor:
    """What a worker's ``engine`` holds: ``model_engine.{model, spec_config, model_loader}``,
    ``reset_prefix_cache``, and the generation loop (the torch engine)."""

    def __init__(self, model_dir: str, load_format: str, spec_config: Eagle3DecodingConfig | None) -> None:
        cfg = read_config(model_dir)
        if load_format == "dummy":
            target = DecoderLM(cfg)
            with torch.no_grad():
                for p in target.parameters():
                    p.zero_()
            self.torch = TorchRolloutEngine(target)
        else:
            self.torch = TorchRolloutEngine.from_hf_folder(model_dir)
        drafter = None
        if spec_config is not None:
            drafter = _eagle3_for(spec_config, cfg.num_layers)
            if load_format == "dummy":  # randomised with the target; the folder's weights are never read
                generator = torch.Generator().manual_seed(0)
                with torch.no_grad():
                    for p in drafter.parameters():
                        p.copy_(torch.rand(p.shape, generator=generator) * 2e-3 - 1e-3)
            self.torch.load_drafter(drafter)
        self.model_engine = SimpleNamespace(model=_OneModel(self.torch.target, drafter), spec_config=spec_config,
                                            model_loader=_ModelLoader())
        self.prefix_cache_resets = 0

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[SimpleNamespace]:
        if hasattr(self.model_engine.model, "first_pre_reload_weights"):
            raise RuntimeError("stand-in: generate while a weight update is open (update_weights(None) not called)")
        if self.model_engine.spec_config is not None:
            asked = sorted({name for p in params for name in ("logprobs", "prompt_logprobs") if getattr(p, name)})
            if asked:
                raise ValueError(SPEC_LOGPROBS_REFUSAL.format(asked))
        sampling = _our_sampling(params, self.torch.model_config.eos_token_id)
        iterations = _Iterations(self.model_engine.spec_config)
        out = self.torch.generate([Request(p, seq_id=i) for i, p in enumerate(prompts)], sampling,
                                  policy=iterations, on_finish=iterations.finished)
        return [_request_output(res, params[i], sampling, *iterations.per_request[i],
                                raw=lambda tokens, prompt=prompts[i]: self.raw_logprobs(prompt, tokens))
                for i, res in enumerate(out.results)]

    def raw_logprobs(self, prompt: list[int], tokens: list[int]) -> list[float]:
        """``LogprobMode.RAW``: the raw log-softmax of the target's logits at each token."""
        target = self.torch.target
        ids = torch.tensor([list(prompt) + list(tokens)], dtype=torch.long)
        with torch.no_grad():
            logits = target.logits(target.hidden(ids))[0, len(prompt) - 1: -1].float()
        picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])
        return picked[:, 0].tolist()


def _eagle3_for(spec: Eagle3DecodingConfig, num_layers: int) -> Eagle3Drafter:
    """The drafter folder, fed the layers TensorRT-LLM captures (ascending): a drafter
    trained on others reads other layers' states, as it would there."""
    drafter = read_eagle3_hf(spec.speculative_model, num_layers)
    layers = spec.eagle3_layers_to_capture
    if layers is None:
        if num_layers == 1:
            layers = {0}
        elif num_layers > 5:
            layers = {1, num_layers // 2 - 1, num_layers - 4}
        else:
            raise ValueError(f"stand-in: TensorRT-LLM's default capture for a {num_layers}-layer target is not "
                             "recorded; set eagle3_layers_to_capture")
    captured = tuple(sorted(layers))
    if captured == drafter.capture_layers:
        return drafter
    if len(captured) != len(drafter.capture_layers):  # fc's input width is fixed by the checkpoint
        raise ValueError(f"stand-in: the drafter fuses {len(drafter.capture_layers)} layers, "
                         f"eagle3_layers_to_capture names {len(captured)}")
    fed = Eagle3Drafter(replace(drafter.config, capture_layers=captured))
    fed.load_state_dict(drafter.state_dict())
    return fed.eval()


def _our_sampling(params: list[SamplingParams], eos: int) -> OurSampling:
    first = params[0]
    if any(p.without_seed() != first.without_seed() for p in params):
        raise NotImplementedError("stand-in: one generate call's requests must share their sampling fields "
                                  "(the seed aside)")
    if first.detokenize:
        raise NotImplementedError("stand-in: no tokenizer (detokenize=True)")
    if first.end_id not in (None, -1, eos):
        raise NotImplementedError(f"stand-in: end_id {first.end_id} is not the model's EOS {eos}")
    stop = first.end_id != -1 and not first.ignore_eos
    if first._greedy_decoding:
        return OurSampling(mode="greedy", max_new_tokens=first.max_tokens, stop_on_eos=stop)
    seeds = [0 if p.seed is None else p.seed for p in params]
    seed = int(hashlib.sha256(repr(seeds).encode()).hexdigest()[:15], 16)
    return OurSampling(mode="rejection", temperature=1.0 if first.temperature is None else first.temperature,
                       top_k=first.top_k or 0, top_p=1.0 if first.top_p is None else first.top_p,
                       max_new_tokens=first.max_tokens, seed=seed, stop_on_eos=stop)


def _request_output(result: Any, params: SamplingParams, sampling: OurSampling, iterations: int,
                    drafted: int, raw: Any) -> SimpleNamespace:
    tokens = list(result.tokens)
    accepted = max(0, len(tokens) - iterations)  # beyond the target's own token per iteration
    perf = None
    if params.return_perf_metrics:
        spec = SimpleNamespace(acceptance_rate=accepted / drafted if drafted else 0.0,
                               total_accepted_draft_tokens=accepted, total_draft_tokens=drafted)
        refuse_unknown("SpeculativeDecodingMetrics", vars(spec), TRTLLM_SPEC_METRICS_FIELDS)
        perf = SimpleNamespace(speculative_decoding=spec)
        refuse_unknown("RequestPerfMetrics", vars(perf), TRTLLM_PERF_METRICS_FIELDS)
    logprobs = None
    if params.logprobs:
        rank = 1 if sampling.mode == "greedy" else None
        if params.logprobs_mode != LogprobMode.PROCESSED:
            values = raw(tokens)
        elif sampling.mode == "greedy":  # processed by top-k 1: the one token left has probability 1
            values = [0.0] * len(tokens)
        else:
            values = result.logprobs
        logprobs = [{t: Logprob(lp, rank)} for t, lp in zip(tokens, values)]
    completion = SimpleNamespace(token_ids=tokens, finish_reason="stop" if result.stop_reason == "eos" else "length",
                                 logprobs=logprobs, request_perf_metrics=perf)
    out = SimpleNamespace(outputs=[completion], decoding_iter=iterations,
                          avg_decoded_tokens_per_iter=len(tokens) / iterations)
    # what it returns carries only fields the facts record (those our engine reads)
    refuse_unknown("CompletionOutput", vars(completion), TRTLLM_COMPLETION_FIELDS)
    refuse_unknown("Logprob", vars(Logprob(0.0, None)), TRTLLM_LOGPROB_FIELDS)
    refuse_unknown("RequestOutput", vars(out), TRTLLM_REQUEST_OUTPUT_FIELDS)
    return out


# ---- workers, the extension base, the LLM --------------------------------------------------------
def get_device_uuid(device: int) -> str:
    return f"GPU-stand-in-{device}"


class WorkerExtension:
    """``tensorrt_llm.llmapi.rlhf_utils.WorkerExtension`` (see the module docstring)."""

    def update_weights(self, ipc_handles: Optional[dict] = None) -> None:
        model = self.engine.model_engine.model
        if not hasattr(model, "first_pre_reload_weights"):
            model.first_pre_reload_weights = True
        if ipc_handles is not None:
            uuid = get_device_uuid(self.device_id)
            if uuid not in ipc_handles:
                raise ValueError(f"Device UUID {uuid} not found in ipc_handles")
            weights = {name: func(*args) for name, (func, args) in ipc_handles[uuid]
                       if not name.startswith(DRAFT_PREFIX)}  # load_weights(skip_modules=["draft_model"])
            self.engine.model_engine.model_loader.reload(model, weights, allow_partial_loading=True)
        else:
            self.engine.reset_prefix_cache()
            delattr(model, "first_pre_reload_weights")

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()


class _Worker:
    def __init__(self, engine: _Executor, device_id: int) -> None:
        self.engine, self.device_id = engine, device_id

    def report_device_id(self) -> str:
        return get_device_uuid(self.device_id)


class LLM:
    """``tensorrt_llm.LLM`` on one rank; ``kwargs``, ``rpcs`` and ``calls`` record what it was handed."""

    worker_device = 0  # the GPU its one worker runs on (a test may move it)
    built: list["LLM"] = []  # every LLM made, in order (restarts included)

    def __init__(self, **kwargs: Any) -> None:
        refuse_unknown("LLM", kwargs, TRTLLM_LLM_FIELDS)
        self.kwargs, self.rpcs, self.calls = kwargs, [], []
        if kwargs.get("tensor_parallel_size", 1) != 1 or kwargs.get("pipeline_parallel_size", 1) != 1:
            raise NotImplementedError("the stand-in LLM runs one rank")
        if not kwargs.get("skip_tokenizer_init"):
            raise NotImplementedError("the stand-in LLM has no tokenizer (skip_tokenizer_init=True)")
        self.max_batch_size = kwargs.get("max_batch_size", 2048)
        spec = kwargs.get("speculative_config")
        if spec is not None and not isinstance(spec, Eagle3DecodingConfig):
            raise TypeError(f"speculative_config must be an Eagle3DecodingConfig here, got {type(spec).__name__}")
        engine = _Executor(kwargs["model"], kwargs.get("load_format", "auto"), spec)
        bases: tuple[type, ...] = (_Worker,)
        if kwargs.get("orchestrator_type") == "ray" and kwargs.get("ray_worker_extension_cls"):
            module, _, name = kwargs["ray_worker_extension_cls"].rpartition(".")
            bases = (getattr(importlib.import_module(module), name), _Worker)
        self.workers = [type("RayGPUWorker", bases, {})(engine, self.worker_device)]
        self.running = True
        LLM.built.append(self)

    def shutdown(self) -> None:
        self.running = False

    def _collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None) -> list:
        if not self.running:
            raise RuntimeError("stand-in: the LLM was shut down")
        self.rpcs.append((method, args))
        calls = [getattr(w, method, None) for w in self.workers]
        if method.startswith("_") or not all(callable(c) for c in calls):
            raise AttributeError(f"no worker method {method!r}")
        return [c(*args, **(kwargs or {})) for c in calls]

    def generate(self, inputs, sampling_params=None, use_tqdm=True):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()]
        params = params * len(inputs) if len(params) == 1 else params
        if len(params) != len(inputs) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("one SamplingParams per prompt (or one for all)")
        if not self.running:
            raise RuntimeError("stand-in: the LLM was shut down")
        self.calls.append((inputs, params))
        engine, out = self.workers[0].engine, []
        for start in range(0, len(inputs), self.max_batch_size):  # at most max_batch_size in flight
            stop = start + self.max_batch_size
            out += engine.generate([list(p) for p in inputs[start:stop]], params[start:stop])
        return out


# ---- installing it -----------------------------------------------------------------------------------
def cpu_copy(self, tensor: torch.Tensor, uuid: str) -> torch.Tensor:
    """`TRTLLMRolloutEngine._copy_to_device` on the CPU (a CUDA IPC handle cannot exist here)."""
    return tensor.detach().clone().contiguous()


def install(monkeypatch) -> types.ModuleType:
    """Make ``import tensorrt_llm`` (and the submodules our code imports) find the stand-in, and
    the engine's IPC handles CPU ones."""
    from nemo_tlt.rollout.trtllm_engine import TRTLLMRolloutEngine

    mod = types.ModuleType("tensorrt_llm")
    mod.__path__ = []  # a package, as the real one (found by importlib.util.find_spec too)
    mod.__spec__ = importlib.machinery.ModuleSpec("tensorrt_llm", None, is_package=True)
    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.Eagle3DecodingConfig = Eagle3DecodingConfig
    rlhf_utils = types.ModuleType("tensorrt_llm.llmapi.rlhf_utils")
    rlhf_utils.WorkerExtension = WorkerExtension
    sampling_params = types.ModuleType("tensorrt_llm.sampling_params")
    sampling_params.LogprobMode, sampling_params.SamplingParams = LogprobMode, SamplingParams
    torch_utils = types.ModuleType("tensorrt_llm._torch.utils")
    torch_utils.get_device_uuid = get_device_uuid
    mod.llmapi, llmapi.rlhf_utils = llmapi, rlhf_utils
    for m in (mod, llmapi, rlhf_utils, sampling_params, torch_utils, types.ModuleType("tensorrt_llm._torch")):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(TRTLLMRolloutEngine, "_copy_to_device", cpu_copy)
    monkeypatch.setattr(LLM, "built", [])
    return mod


def worker(engine) -> Any:
    """The (one) worker of a `TRTLLMRolloutEngine` served by the stand-in."""
    return engine.llm.workers[0]
