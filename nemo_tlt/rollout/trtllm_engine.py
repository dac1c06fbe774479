"""`TRTLLMRolloutEngine`: the `RolloutEngine` contract over TensorRT-LLM's LLM API.

Written against the TensorRT-LLM source named by ``trtllm_config.TRTLLM_SOURCE``;
NEVER RUN here (no GPU, TensorRT-LLM not installable): it is tested against a stand-in
``tensorrt_llm`` module (``tests/trtllm_standin.py``) that generates with the embedded torch
engine, so the requests, sampling, draft-length schedule and refits it hands over decide
what comes back. ``pytest -m trtllm`` on a GPU node runs the conformance suite on it.

What runs where: TensorRT-LLM's PyTorch backend drafts with EAGLE-3 only, one-model
(the drafter a submodule of the target). The drafter is the EAGLE-3 HF folder in
``TRTLLMEngineConfig.drafter_dir``; TLT's SD policy is mapped between rollouts to
TensorRT-LLM's per-batch-size draft lengths (``trtllm_schedule``), which decide
each iteration inside TensorRT-LLM: the policy's ``begin_rollout`` is called, its
``choose`` / ``observe`` are not (no per-step hook exists in the LLM API).

Lossless guarantee (the part of the contract this engine keeps):

* ``greedy``: SD output is token-identical to plain greedy (TensorRT-LLM accepts a
  draft token only if it is the target's argmax).
* ``rejection``: the target's sampling distribution. Without
  ``use_rejection_sampling`` (TensorRT-LLM's prototype flag) non-greedy batches
  verify by exact match: each position's token is the target's own sample, a draft
  token is kept only when equal to it, so the output is the target's distribution
  at a lower acceptance; with the flag, rejection sampling (also the target's
  distribution, higher acceptance; prototype). TensorRT-LLM's top-p boundary rule may
  differ from ``speculative.sampling.process_logits``. Not checked statistically here.
* ``coupled``: NOT expressible: TensorRT-LLM draws from a per-request random stream
  that advances per step, not noise keyed by (seed, sequence, position), so SD and
  plain decoding would not give the same tokens. Refused with a ValueError.

Log-probs (UNTESTED with TensorRT-LLM): each request asks ``SamplingParams(logprobs=1)``
and the generated token's entry of ``CompletionOutput.logprobs`` becomes
``RequestResult.logprobs`` (`completion_logprobs`). Which logits TensorRT-LLM computes
them from is not stated in the source read (interface_facts): if raw (a later
TensorRT-LLM's documented default), they are our ``greedy`` definition (the raw
log-softmax) but not the processed transform of ``rejection`` at a temperature other
than 1 or with top-k / top-p; if processed, greedy (top_k=1) reports 0. An EOS that
TensorRT-LLM did not return (appended here) has log-prob NaN. The conformance suite's
``test_logprobs`` checks them on a GPU node.

Stats: ``tokens_generated`` and ``wall_s`` (= ``time_other_s``) are measured;
``accept_lengths`` come from TensorRT-LLM's per-request acceptance while a drafter
speculates (``trtllm_stats``: their mean is TensorRT-LLM's acceptance length, the
per-step split is evened out); ``last_speculation`` keeps the rollout's report (draft
tokens accepted / drafted too). The LLM API reports no per-step split, so forwards,
SD/plain steps and the time split stay 0 and ``trace`` stays empty (see
``UNAVAILABLE_STATS``). ``return_hidden`` is refused: the LLM API
returns no final hidden states (harvest drafter data from the policy instead:
``drafter.harvest_from=policy``).

Policy weights: canonical (HF-named) full tensors, checked strictly like the torch
engine, are sent in buckets through TensorRT-LLM's ``WorkerExtension.update_weights``
as CUDA IPC handles (each TP rank shards them itself), then finalised. Drafter
refit at runtime is UNVERIFIED (no documented API; see `load_drafter`).
"""
from __future__ import annotations

import importlib
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.drafter.base import Drafter
from nemo_tlt.drafter.eagle3_hf import exported_capture_layers
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config, read_state_dict
from nemo_tlt.model.lm import canonical_shapes
from nemo_tlt.rollout import validate
from nemo_tlt.rollout.protocol import FinishSink, GenerateOutput, GenerationStats, PolicyWeights, Request, RequestResult
from nemo_tlt.rollout.trtllm_config import TRTLLM_PACKAGE, TRTLLMEngineConfig, missing_package_message
from nemo_tlt.rollout.trtllm_schedule import draft_len_schedule
from nemo_tlt.rollout.trtllm_stats import SpeculationReport, speculation_report
from nemo_tlt.speculative.sampling import SamplingParams

UNAVAILABLE_STATS = ("target_forwards", "prefill_forwards", "drafter_forwards", "plain_steps", "sd_steps",
                     "time_draft_s", "time_verify_s", "time_plain_s", "prefill_s", "trace")


def import_tensorrt_llm() -> ModuleType:
    """The ``tensorrt_llm`` module, or an ImportError naming the package and the extra to install."""
    try:
        return importlib.import_module(TRTLLM_PACKAGE)
    except ImportError as err:
        raise ImportError(f"{missing_package_message('TRTLLMRolloutEngine')} ({err})") from err


# ---- pure conversion ---------------------------------------------------------------------------
def check_sampling(sampling: SamplingParams) -> None:
    """The contract's sampling checks, and the modes this engine runs losslessly
    (coupled is refused: see the module docstring)."""
    validate.check_sampling(sampling)
    _refuse_coupled(sampling)


def _refuse_coupled(sampling: SamplingParams) -> None:
    validate.refuse_coupled(sampling, "TensorRT-LLM", "a per-request random stream")


def request_seed(seed: int, seq_id: int) -> int:
    """The per-request seed handed to TensorRT-LLM: one stream per (run seed, sequence)."""
    return (seed * 1_000_003 + seq_id) % 2**63


def sampling_kwargs(sampling: SamplingParams, eos_token_id: int, seq_id: int,
                    speculating: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``tensorrt_llm.SamplingParams`` for one request;
    ``speculating``: ask for the per-request draft counters (``return_perf_metrics``)."""
    check_sampling(sampling)
    kwargs: dict[str, Any] = {"max_tokens": sampling.max_new_tokens,
                              "end_id": eos_token_id if sampling.stop_on_eos else -1, "detokenize": False,
                              "logprobs": 1}  # the generated token's own log-prob (see completion_logprobs)
    if speculating:
        kwargs["return_perf_metrics"] = True  # request_perf_metrics.speculative_decoding (trtllm_stats)
    if sampling.mode == "greedy":
        kwargs.update(top_k=1, temperature=0.0)
    else:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                      top_p=sampling.top_p, seed=request_seed(sampling.seed, seq_id))
    return kwargs


def validate_requests(requests: list[Request], sampling: SamplingParams, cfg: LMConfig) -> None:
    """The contract's input checks (ValueError naming the field), before any decoding."""
    validate.validate_requests(requests, sampling, cfg)
    _refuse_coupled(sampling)


def completion_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The generated tokens' log-probs from ``CompletionOutput.logprobs`` (interface_facts:
    one ``{token id: Logprob(logprob, rank)}`` per token; a bare float per token is
    taken too). A missing entry or a count other than the tokens' is a ValueError."""
    if logprobs is None or len(logprobs) != len(token_ids):
        got = "none" if logprobs is None else len(logprobs)
        raise ValueError(f"TensorRT-LLM returned {got} log-probs for {len(token_ids)} tokens "
                         "(SamplingParams.logprobs=1 asks for one per generated token)")
    out = []
    for i, (tok, entry) in enumerate(zip(token_ids, logprobs)):
        if isinstance(entry, dict):
            if int(tok) not in entry:
                raise ValueError(f"TensorRT-LLM's log-probs of token {i} do not include the token generated "
                                 f"there ({int(tok)}): got ids {sorted(entry)}")
            entry = entry[int(tok)]
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def completion_to_result(token_ids: list[int], finish_reason: str | None, sampling: SamplingParams,
                         eos_token_id: int, logprobs: Any) -> RequestResult:
    """Our result from one TensorRT-LLM completion: EOS kept as the last token with
    stop reason "eos" (TensorRT-LLM's "stop"; the EOS is appended when it is not
    among the returned ids, with log-prob NaN: TensorRT-LLM reported none for it),
    anything else "length". ``logprobs``: the completion's (see `completion_logprobs`)."""
    tokens = [int(t) for t in token_ids]
    lps = completion_logprobs(tokens, logprobs)
    if finish_reason == "stop" and sampling.stop_on_eos:
        if not tokens or tokens[-1] != eos_token_id:
            tokens.append(eos_token_id)
            lps.append(float("nan"))
        n = sampling.max_new_tokens
        return RequestResult(tokens[:n], "eos", logprobs=lps[:n])
    if finish_reason not in ("length", "stop"):
        raise ValueError(f"TensorRT-LLM finished a request with reason {finish_reason!r}; expected 'stop' or "
                         "'length'")
    return RequestResult(tokens, "length", logprobs=lps)


def trtllm_capture_layers(config: TRTLLMEngineConfig, num_layers: int) -> tuple[int, ...]:
    """The target layers TensorRT-LLM captures for the drafter, in the order it hands
    them over (ascending: it sorts them): the configured ``eagle3_layers_to_capture``,
    or its default: {1, L//2-1, L-4}, the last layer of a 1-layer target, refused for
    targets of 2 to 5 layers."""
    layers = config.eagle3_layers_to_capture
    if layers is None and num_layers == 1:
        layers = (0,)
    elif layers is None:
        if num_layers <= 5:
            raise ValueError(f"TRTLLMEngineConfig.eagle3_layers_to_capture is unset and the target has {num_layers} "
                             "layers: TensorRT-LLM's default {1, L//2-1, L-4} needs more than 5; set the layers "
                             "the drafter was trained on")
        layers = (1, num_layers // 2 - 1, num_layers - 4)
    bad = [i for i in layers if i >= num_layers]
    if bad:
        raise ValueError(f"TRTLLMEngineConfig.eagle3_layers_to_capture={list(layers)} names layers {bad}; the "
                         f"target has {num_layers} (0-based)")
    return tuple(sorted(set(layers)))


def check_drafter_layers(folder: str | os.PathLike, captured: tuple[int, ...]) -> None:
    """The EAGLE-3 HF folder's drafter reads exactly the layers TensorRT-LLM hands over,
    in its order (``captured``: ascending, distinct); otherwise its fused input is other
    layers' states, in another order or of another width, and it drafts garbage:
    ValueError naming both."""
    path = Path(folder) / "config.json"
    layers = list(exported_capture_layers(folder))
    if len(set(layers)) != len(layers):
        raise ValueError(f"{path}: the drafter captures layers {layers} with repeats; TensorRT-LLM captures a set "
                         "of distinct layers (eagle3_layers_to_capture), so it cannot serve this drafter")
    if sorted(layers) != list(captured):
        raise ValueError(f"{path}: the drafter was trained on target layers {sorted(layers)}, TensorRT-LLM would "
                         f"capture {list(captured)}; set TRTLLMEngineConfig.eagle3_layers_to_capture to "
                         f"{sorted(layers)}")
    if layers != sorted(layers):
        raise ValueError(f"{path}: the drafter reads target layers in the order {layers}; TensorRT-LLM hands them "
                         f"over ascending ({sorted(layers)}): train the drafter with capture_layers in ascending "
                         "order")


def weight_buckets(weights: PolicyWeights, shapes: Mapping[str, tuple[int, ...]],
                   bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream checked strictly (unknown name, repeat, wrong shape: ValueError naming
    the tensor as it arrives; a missing name when the stream ends) and cut into buckets
    of about ``bucket_bytes``."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    seen: set[str] = set()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for i, item in enumerate(pairs):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"load_policy_weights: item {i} of the stream must be a (name, tensor) pair")
        name, tensor = item
        if name not in shapes:
            raise ValueError(f"load_policy_weights: unknown tensor {name!r}: not a canonical name of this model")
        if name in seen:
            raise ValueError(f"load_policy_weights: tensor {name!r} was given twice")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"load_policy_weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {shapes[name]}")
        seen.add(name)
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    missing = [name for name in shapes if name not in seen]
    if missing:
        raise ValueError(f"load_policy_weights: tensor {missing[0]!r} was not given ({len(missing)} of "
                         f"{len(shapes)} canonical tensors missing)")
    if bucket:
        yield bucket


# ---- the engine ----------------------------------------------------------------------------------
class TRTLLMRolloutEngine:
    """Implements `RolloutEngine` through TensorRT-LLM's LLM API (see the module docstring)."""

    def __init__(self, config: TRTLLMEngineConfig) -> None:
        if not isinstance(config, TRTLLMEngineConfig):
            raise ValueError(f"TRTLLMRolloutEngine.config must be a TRTLLMEngineConfig, got {type(config).__name__}")
        trtllm = import_tensorrt_llm()
        self.config = config
        self._model_config = read_config(config.target_dir)
        self._captured: tuple[int, ...] = ()  # no drafter: nothing is captured (any target depth)
        if config.drafter_dir is not None:
            self._captured = trtllm_capture_layers(config, self._model_config.num_layers)
            check_drafter_layers(config.drafter_dir, self._captured)
        self._shapes = canonical_shapes(self._model_config)
        from tensorrt_llm.llmapi import Eagle3DecodingConfig  # lazy: optional package

        spec = config.speculative_kwargs()
        speculative_config = None if spec is None else Eagle3DecodingConfig(**spec)
        self.llm = trtllm.LLM(**config.llm_kwargs(), speculative_config=speculative_config)
        self._trtllm = trtllm
        self._schedule = config.build_schedule()
        self._drafter_loaded = config.drafter_dir is not None
        self._failed_load: str | None = None
        self.last_speculation: SpeculationReport | None = None  # the last rollout's, while speculating

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike, **kwargs: Any) -> "TRTLLMRolloutEngine":
        """An engine serving the HF-format folder ``path`` (weights read from it)."""
        return cls(TRTLLMEngineConfig(target_dir=str(path), **kwargs))

    @property
    def model_config(self) -> LMConfig:
        return self._model_config

    def load_policy_weights(self, weights: PolicyWeights) -> None:
        """See `RolloutEngine.load_policy_weights`: buckets sent as CUDA IPC handles to
        every worker's device, then ``update_weights(None)`` finalises. A failure after
        a bucket was sent leaves the model unservable until a complete load."""
        sent = 0
        try:
            for bucket in weight_buckets(weights, self._shapes, self.config.weight_bucket_mb << 20):
                self.llm._collective_rpc("update_weights", (self._ipc_handles(bucket),))
                sent += len(bucket)
            self.llm._collective_rpc("update_weights", (None,))
        except BaseException as err:  # re-raised: only the model's state is recorded
            if sent:
                self._failed_load = f"{sent} of {len(self._shapes)} tensors sent before: {err}"
            raise
        self._failed_load = None

    def load_drafter(self, drafter: Drafter | str | os.PathLike | None) -> None:
        """None: speculation off from the next rollout. A folder in the EAGLE-3 HF layout:
        its tensors are sent through ``update_weights`` under ``drafter_weight_prefix``
        (UNVERIFIED: TensorRT-LLM documents no runtime drafter update; the one-model
        draft module's parameter names and the loader's handling of them are assumed).
        A torch `Drafter` is refused: export it first (``nemo-tlt convert --from drafter
        --to eagle3-hf``)."""
        if drafter is None:
            self._drafter_loaded = False
            return
        if isinstance(drafter, torch.nn.Module):
            raise ValueError("TRTLLMRolloutEngine.load_drafter takes an EAGLE-3 HF folder, not a torch "
                             f"{type(drafter).__name__}: export it with `nemo-tlt convert --from drafter "
                             "--to eagle3-hf` and pass the folder")
        if self.config.drafter_dir is None:
            raise ValueError("TRTLLMRolloutEngine.load_drafter: the LLM was built without a drafter "
                             "(TRTLLMEngineConfig.drafter_dir is null); TensorRT-LLM cannot add one at runtime")
        folder = Path(drafter)
        check_drafter_layers(folder, self._captured)
        tensors = read_state_dict(folder)
        prefix = self.config.drafter_weight_prefix
        self.llm._collective_rpc("update_weights", (self._ipc_handles([(prefix + n, t) for n, t in tensors.items()]),))
        self.llm._collective_rpc("update_weights", (None,))
        self._drafter_loaded = True

    def generate(self, requests: list[Request], sampling: SamplingParams, *, policy: SpecPolicy | None = None,
                 return_hidden: bool = False, on_finish: FinishSink | None = None) -> GenerateOutput:
        """See `RolloutEngine.generate` and the module docstring (coupled and
        return_hidden are refused; ``on_finish`` sees every request at the end: the LLM API's
        batch call returns them together)."""
        if self._failed_load is not None:
            raise ValueError(f"generate: the last load_policy_weights failed midway ({self._failed_load}); "
                             "load complete weights first")
        validate_requests(requests, sampling, self._model_config)
        if return_hidden:
            raise ValueError("generate: return_hidden is not available from TensorRT-LLM's LLM API; harvest "
                             "drafter data from the policy's forward (drafter.harvest_from=policy)")
        if policy is not None:
            policy.begin_rollout()
        self._install_schedule(policy)
        t0 = time.perf_counter()
        eos = self._model_config.eos_token_id
        speculating = self._drafter_loaded and bool(self._schedule)
        params = [self._trtllm.SamplingParams(**sampling_kwargs(sampling, eos, r.seq_id if r.seq_id is not None else i,
                                                                speculating))
                  for i, r in enumerate(requests)]
        outputs = self.llm.generate([list(r.prompt) for r in requests], params, use_tqdm=False)
        results = [completion_to_result(o.outputs[0].token_ids, o.outputs[0].finish_reason, sampling, eos,
                                        o.outputs[0].logprobs) for o in outputs]
        stats = GenerationStats(tokens_generated=sum(len(r.tokens) for r in results))
        stats.wall_s = stats.time_other_s = time.perf_counter() - t0
        self.last_speculation = None
        if speculating:  # plain decoding reports no acceptance, as the torch engine's plain steps
            self.last_speculation, stats.accept_lengths = speculation_report(outputs)
        if on_finish is not None:
            for i, result in enumerate(results):
                on_finish(i, result)
        return GenerateOutput(results, stats)

    def _install_schedule(self, policy: SpecPolicy | None) -> None:
        """The policy's draft_len_schedule, sent to the workers when it changed."""
        if not self._drafter_loaded:
            if policy is not None and draft_len_schedule(policy, self.config.max_draft_len,
                                                         self.config.max_batch_size):
                raise ValueError("generate: the policy asks for speculation but no drafter is loaded")
            wanted: dict[int, int] = {}
        else:
            wanted = draft_len_schedule(policy, self.config.max_draft_len, self.config.max_batch_size)
        if wanted == self._schedule:
            return
        if not self.config.runtime_schedule:
            raise ValueError(f"generate: the policy's draft_len_schedule {wanted} differs from the one the LLM was "
                             f"built with {self._schedule} and TRTLLMEngineConfig.runtime_schedule is false")
        self.llm._collective_rpc("set_draft_len_schedule", (wanted,))
        self._schedule = wanted

    def _ipc_handles(self, bucket: list[tuple[str, torch.Tensor]]) -> dict[str, list[tuple[str, Any]]]:
        """TensorRT-LLM's ``update_weights`` payload: per worker device UUID, (name, CUDA IPC
        handle) pairs of the tensors copied to that device (workers of this node: TP ranks)."""
        from torch.multiprocessing.reductions import reduce_tensor
        from tensorrt_llm._torch.utils import get_device_uuid  # the UUID form the workers look up

        handles: dict[str, list[tuple[str, Any]]] = {}
        for device in range(self.config.tensor_parallel_size):
            on_device = [(name, t.to(f"cuda:{device}").contiguous()) for name, t in bucket]
            handles[get_device_uuid(device)] = [(name, reduce_tensor(t)) for name, t in on_device]
        return handles

