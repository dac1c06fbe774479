"""`TRTLLMRolloutEngine`: the `RolloutEngine` contract over TensorRT-LLM's LLM API.

Written against the TensorRT-LLM source named by ``trtllm_config.TRTLLM_SOURCE``;
NEVER RUN here (no GPU, TensorRT-LLM not installable): it is tested against a stand-in
``tensorrt_llm`` module (``tests/trtllm_standin.py``) that generates with the embedded torch
engine, so the requests, sampling, draft-length schedule and refits it hands over decide
what comes back. ``pytest -m trtllm`` on a GPU node runs the conformance suite on it.

What runs where: TensorRT-LLM's PyTorch backend drafts with EAGLE-3 only, one-model
(the drafter a submodule of the target). The drafter is the EAGLE-3 HF folder in
``TRTLLMEngineConfig.drafter_dir``; TLT's SD policy is mapped to TensorRT-LLM's
per-batch-size draft lengths (``trtllm_schedule``), which decide each iteration inside
TensorRT-LLM: the policy's ``begin_rollout`` is called, its ``choose`` / ``observe`` are not
(no per-step hook exists in the LLM API), so the policy's schedule is fixed by its state
when the LLM is built (``TRTLLMEngineConfig.draft_len_schedule``). TensorRT-LLM captures
its CUDA graphs for that schedule at start-up, so a different schedule, a new drafter
(after idle-time training) or none is a restart (`restart`: the LLM is rebuilt, timed in
``last_restart_s``; TensorRT-LLM's own weight update skips the draft module, and no runtime
drafter load is in its API); ``generate`` refuses a policy whose schedule differs from
the built one, naming the restart.

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

Log-probs (UNTESTED with TensorRT-LLM): TensorRT-LLM refuses log-probs in a request while
speculative decoding is configured (its speculative sampler's ``validate_request``). So:

* without a drafter, each request asks ``logprobs=1`` with ``logprobs_mode`` ``RAW`` for
  ``greedy`` (our definition there: the raw log-softmax) and ``PROCESSED`` for ``rejection``
  (the sampling transform), and the generated token's entry of ``CompletionOutput.logprobs``
  becomes ``RequestResult.logprobs`` (`completion_logprobs`); an EOS that TensorRT-LLM did
  not return (appended here) has log-prob NaN;
* with a drafter, no request asks for them: every ``RequestResult.logprobs`` is NaN and
  ``GenerateOutput.logprobs_from`` is ``"none"``; the exact ones are the policy's own
  forward's, which the RL step computes anyway (the logprob-gap metric skips NaN).

The conformance suite's ``test_logprobs`` checks them on a GPU node.

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
as CUDA IPC handles (each TP rank shards them itself), then finalised. The handles are
made on each worker's GPU as the workers report it (``report_device_id``: a UUID, found
among this process's CUDA devices), so this process must see the workers' GPUs.
"""
from __future__ import annotations

import importlib
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.device import cuda_device_of_uuid
from nemo_tlt.drafter.base import Drafter
from nemo_tlt.drafter.eagle3_hf import exported_capture_layers
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config, read_state_dict
from nemo_tlt.model.lm import canonical_shapes
from nemo_tlt.rollout import validate
from nemo_tlt.rollout.protocol import EngineLimits, FinishSink, GenerateOutput, GenerationStats, PolicyWeights, Request, RequestResult
from nemo_tlt.rollout.trtllm_config import TRTLLM_PACKAGE, TRTLLMEngineConfig, missing_package_message
from nemo_tlt.rollout.trtllm_schedule import draft_len_schedule, same_schedule
from nemo_tlt.rollout.trtllm_stats import SpeculationReport, speculation_report
from nemo_tlt.speculative.sampling import SamplingParams

NOT_REPORTED = float("nan")  # a log-prob TensorRT-LLM did not report
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
    """Keyword arguments of ``tensorrt_llm.SamplingParams`` for one request. ``speculating``:
    no log-probs (TensorRT-LLM refuses them with speculative decoding) and the per-request
    draft counters (``return_perf_metrics``); otherwise the generated token's log-prob, its
    ``logprobs_mode`` given by name (``"RAW"`` for greedy, ``"PROCESSED"`` for sampling: the
    engine maps it to TensorRT-LLM's ``LogprobMode``)."""
    check_sampling(sampling)
    kwargs: dict[str, Any] = {"max_tokens": sampling.max_new_tokens,
                              "end_id": eos_token_id if sampling.stop_on_eos else -1, "detokenize": False}
    if speculating:
        kwargs["return_perf_metrics"] = True  # request_perf_metrics.speculative_decoding (trtllm_stats)
    else:
        kwargs.update(logprobs=1, logprobs_mode="RAW" if sampling.mode == "greedy" else "PROCESSED")
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


def completion_logprobs(token_ids: list[int], logprobs: Any, requested: bool = True) -> list[float]:
    """The generated tokens' log-probs from ``CompletionOutput.logprobs`` (interface_facts:
    one ``{token id: Logprob(logprob, rank)}`` per token; a bare float per token is
    taken too); NaN for each token where they were not ``requested``. A missing entry or a
    count other than the tokens' is a ValueError."""
    if not requested:
        return [NOT_REPORTED] * len(token_ids)
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
                         eos_token_id: int, logprobs: Any, logprobs_requested: bool = True) -> RequestResult:
    """Our result from one TensorRT-LLM completion: EOS kept as the last token with
    stop reason "eos" (TensorRT-LLM's "stop"; the EOS is appended when it is not
    among the returned ids, with log-prob NaN: TensorRT-LLM reported none for it),
    anything else "length". ``logprobs``: the completion's (see `completion_logprobs`)."""
    tokens = [int(t) for t in token_ids]
    lps = completion_logprobs(tokens, logprobs, logprobs_requested)
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

    LIMITS = EngineLimits(
        modes=("greedy", "rejection"), hidden_states=False, step_stats=False, drafter_kinds=("eagle3",),
        drafter_form="eagle3-hf", sd_logprobs=False, why="TensorRT-LLM's limits, docs/trtllm.md",
        reasons=(("modes", "not expressible (TensorRT-LLM samples from a per-request random stream, so SD would "
                           "not reproduce plain decoding's tokens); use greedy or rejection"),
                 ("drafter_modules", "the RL loop loads and retrains torch drafter modules, while TensorRT-LLM "
                                     "drafts with an EAGLE-3 folder fixed at build time and takes no per-step tree "
                                     "choice; run the baseline (rollout.sd_enabled=false drafter.train_on_idle=false) "
                                     "or the NeMo adapters with tlt.trtllm.drafter_dir"),
                 ("hidden_states", "TensorRT-LLM's LLM API returns no hidden states; use "
                                   "drafter.harvest_from=policy")))

    def __init__(self, config: TRTLLMEngineConfig, draft_len_ceiling: int | None = None) -> None:
        """``draft_len_ceiling``: the longest draft a policy may ask for (its lengths are clipped
        to it before they are compared with the built schedule); default ``config.max_draft_len``."""
        if not isinstance(config, TRTLLMEngineConfig):
            raise ValueError(f"TRTLLMRolloutEngine.config must be a TRTLLMEngineConfig, got {type(config).__name__}")
        self._trtllm = import_tensorrt_llm()
        self._model_config = read_config(config.target_dir)
        self._shapes = canonical_shapes(self._model_config)
        self._refits = 0
        self._ceiling = config.max_draft_len if draft_len_ceiling is None else draft_len_ceiling
        self._stashed_schedule: dict[str, Any] = {}  # the schedule settings of the drafter load_drafter(None) dropped
        self.last_speculation: SpeculationReport | None = None  # the last rollout's, while speculating
        self.last_restart_s: float | None = None
        self._start(config)

    def _captured_layers(self, config: TRTLLMEngineConfig) -> tuple[int, ...]:
        """The layers TensorRT-LLM will capture for ``config``'s drafter, checked against it."""
        if config.drafter_dir is None:
            return ()  # no drafter: nothing is captured (any target depth)
        captured = trtllm_capture_layers(config, self._model_config.num_layers)
        check_drafter_layers(config.drafter_dir, captured)
        return captured

    def _start(self, config: TRTLLMEngineConfig) -> None:
        from tensorrt_llm.llmapi import Eagle3DecodingConfig  # lazy: optional package

        self._captured = self._captured_layers(config)
        spec = config.speculative_kwargs()
        self.llm = self._trtllm.LLM(**config.llm_kwargs(),
                                    speculative_config=None if spec is None else Eagle3DecodingConfig(**spec))
        self.config = config
        self._schedule = config.build_schedule()
        self._device_uuids = [str(u) for u in self.llm._collective_rpc("report_device_id")]
        self._unservable: str | None = None

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike, **kwargs: Any) -> "TRTLLMRolloutEngine":
        """An engine serving the HF-format folder ``path`` (weights read from it)."""
        return cls(TRTLLMEngineConfig(target_dir=str(path), **kwargs))

    @property
    def model_config(self) -> LMConfig:
        return self._model_config

    def restart(self, **changes: Any) -> float:
        """Rebuild the LLM with ``changes`` to its `TRTLLMEngineConfig` (``drafter_dir``,
        ``draft_len_schedule``, ``max_draft_len``, ...), checked before the running LLM is shut
        down; returns (and keeps in ``last_restart_s``) the seconds it took. The rebuilt LLM
        serves ``target_dir``'s weights: after a policy refit, ``generate`` refuses until the
        next ``load_policy_weights``. Cost: TensorRT-LLM's start-up (weights read, CUDA graphs
        captured) plus that refit; not measured here (no GPU)."""
        config = replace(self.config, **changes)
        self._captured_layers(config)
        t0 = time.perf_counter()
        self.llm.shutdown()
        try:
            self._start(config)
        except BaseException as err:
            self._unservable = f"the last restart failed ({err}); restart again"
            raise
        if self._refits:
            self._unservable = ("the LLM was restarted and serves target_dir's weights, not the last refit's; "
                                "load the policy's weights")
        self.last_restart_s = time.perf_counter() - t0
        return self.last_restart_s

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
                self._unservable = (f"the last load_policy_weights failed midway ({sent} of {len(self._shapes)} "
                                    f"tensors sent before: {err}); load complete weights")
            raise
        self._unservable = None
        self._refits += 1

    def load_drafter(self, drafter: Drafter | str | os.PathLike | None) -> None:
        """A folder in the EAGLE-3 HF layout, or None (no speculation), through a `restart`
        (always: the folder's contents may have been retrained in place), since TensorRT-LLM's
        weight update skips the draft module and its API has no runtime drafter load. The
        draft-length schedule is kept (after None, the one the dropped drafter had); a dummy
        load becomes ``auto`` (a dummy load never reads the drafter). A torch `Drafter` is
        refused: export it first (``nemo-tlt convert --from drafter --to eagle3-hf``)."""
        if isinstance(drafter, torch.nn.Module):
            raise ValueError("TRTLLMRolloutEngine.load_drafter takes an EAGLE-3 HF folder, not a torch "
                             f"{type(drafter).__name__}: export it with `nemo-tlt convert --from drafter "
                             "--to eagle3-hf` and pass the folder")
        c = self.config
        if drafter is None:
            if c.drafter_dir is not None:
                self._stashed_schedule = {"max_draft_len": c.max_draft_len, "draft_len_schedule": c.draft_len_schedule,
                                          "max_concurrency": c.max_concurrency}
                self.restart(drafter_dir=None, draft_len_schedule=None, max_concurrency=None)
            return
        schedule = self._stashed_schedule if c.drafter_dir is None else {}
        self.restart(drafter_dir=str(drafter), load_format="auto", **schedule)

    def generate(self, requests: list[Request], sampling: SamplingParams, *, policy: SpecPolicy | None = None,
                 return_hidden: bool = False, on_finish: FinishSink | None = None) -> GenerateOutput:
        """See `RolloutEngine.generate` and the module docstring (coupled and
        return_hidden are refused; ``on_finish`` sees every request at the end: the LLM API's
        batch call returns them together)."""
        if self._unservable is not None:
            raise ValueError(f"generate: {self._unservable}")
        validate_requests(requests, sampling, self._model_config)
        if return_hidden:
            raise ValueError("generate: return_hidden is not available from TensorRT-LLM's LLM API; harvest "
                             "drafter data from the policy's forward (drafter.harvest_from=policy)")
        if policy is not None:
            policy.begin_rollout()
        self._check_schedule(policy)
        t0 = time.perf_counter()
        eos = self._model_config.eos_token_id
        speculating = bool(self._schedule)
        params = [self._sampling_params(sampling_kwargs(sampling, eos, r.seq_id if r.seq_id is not None else i,
                                                        speculating))
                  for i, r in enumerate(requests)]
        outputs = self.llm.generate([list(r.prompt) for r in requests], params, use_tqdm=False)
        results = [completion_to_result(o.outputs[0].token_ids, o.outputs[0].finish_reason, sampling, eos,
                                        o.outputs[0].logprobs, logprobs_requested=not speculating) for o in outputs]
        stats = GenerationStats(tokens_generated=sum(len(r.tokens) for r in results))
        stats.wall_s = stats.time_other_s = time.perf_counter() - t0
        self.last_speculation = None
        if speculating:  # plain decoding reports no acceptance, as the torch engine's plain steps
            self.last_speculation, stats.accept_lengths = speculation_report(outputs)
        if on_finish is not None:
            for i, result in enumerate(results):
                on_finish(i, result)
        return GenerateOutput(results, stats, logprobs_from="none" if speculating else "engine")

    def _sampling_params(self, kwargs: dict[str, Any]) -> Any:
        if "logprobs_mode" in kwargs:
            from tensorrt_llm.sampling_params import LogprobMode  # lazy: optional package

            kwargs = {**kwargs, "logprobs_mode": LogprobMode[kwargs["logprobs_mode"]]}
        return self._trtllm.SamplingParams(**kwargs)

    def _check_schedule(self, policy: SpecPolicy | None) -> None:
        """The policy's schedule must be the one the LLM was built with (by batch size)."""
        n = self.config.max_batch_size
        wanted = draft_len_schedule(policy, self._ceiling, n)
        if same_schedule(wanted, self._schedule, n):
            return
        if not self._schedule:
            raise ValueError("generate: the policy asks for speculation but the LLM was built without a drafter "
                             f"(policy schedule {wanted}); restart it with one: engine.load_drafter(folder)")
        raise ValueError(f"generate: the policy's draft_len_schedule {wanted} differs from the one the LLM was built "
                         f"with {self._schedule}; TensorRT-LLM captured its CUDA graphs for that one at start-up: "
                         "rebuild it with engine.restart(**trtllm_schedule.build_settings(policy, "
                         f"{self._ceiling}, {n})), or engine.load_drafter(None) for plain decoding")

    def _ipc_handles(self, bucket: list[tuple[str, torch.Tensor]]) -> dict[str, list[tuple[str, Any]]]:
        """TensorRT-LLM's ``update_weights`` payload: per worker device UUID (as the workers
        report it), (name, CUDA IPC handle) pairs of the tensors copied to that device."""
        from torch.multiprocessing.reductions import reduce_tensor

        return {uuid: [(name, reduce_tensor(self._copy_to_device(t, uuid))) for name, t in bucket]
                for uuid in self._device_uuids}

    def _copy_to_device(self, tensor: torch.Tensor, uuid: str) -> torch.Tensor:
        """``tensor`` on the local CUDA device of the worker GPU ``uuid``."""
        return tensor.to(cuda_device_of_uuid(uuid, "load_policy_weights (a TensorRT-LLM worker's GPU)")).contiguous()
