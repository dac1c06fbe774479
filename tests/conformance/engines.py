"""The engines the suite runs, and what each declares it cannot do.

An `EngineSpec` builds an engine for an HF-format folder and lists its limits: the
sampling modes it runs, whether it returns hidden states and per-step stats, the
drafter kinds it loads and in which form. `EngineUnderTest` (the `make_engine`
fixture) hands the tests engines, drafters in the engine's form and the skips
for what an engine declares it cannot do; `test_limits.py` checks that each
declared limit is refused by name rather than silently run.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from nemo_tlt.drafter.eagle3 import default_capture_layers
from nemo_tlt.drafter.eagle3_hf import read_eagle3_hf, write_eagle3_hf
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config
from nemo_tlt.rollout.protocol import SAMPLING_MODES, EngineLimits, GenerateOutput, GenerationStats, RolloutEngine
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.rollout.trtllm_config import TRTLLMEngineConfig
from nemo_tlt.rollout.trtllm_engine import (TRTLLMRolloutEngine, check_drafter_layers, trtllm_capture_layers,
                                            validate_requests)
from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine
from nemo_tlt.rollout.trtllm_stats import speculation_report
from nemo_tlt.speculative.sampling import SamplingParams
from suite_helpers import DRAFTERS, make_drafter

MODES = SAMPLING_MODES


@dataclass(frozen=True)
class EngineSpec:
    """``open(model_dir, under_test)`` serves the folder, with no drafter loaded. ``limits``:
    what the engine declares it cannot do, read from its class (``LIMITS``,
    ``nemo_tlt.rollout.protocol.EngineLimits``: modes, hidden states, per-step stats, drafter
    kinds and form, rejection top-k while it can speculate, log-probs with a drafter loaded);
    the suite skips what it declares and checks each declared limit is refused by name.
    ``writes_as_it_streams``: a weight stream refused midway has already written tensors (so
    `generate` must refuse); False for an engine that sends buckets (a stream refused inside
    the first wrote nothing). ``model_shape``: tiny-model fields the engine needs (overrides of
    ``tests/tiny.tiny_config``). ``logprobs_atol``: how far the reported log-probs may be from
    plain decoding's and from a full fp32 forward of the reference (1e-5: fp32 rounding).
    ``accept_stats``: it reports accepted lengths per verify step
    (``GenerationStats.accept_lengths``) while a drafter speculates, so a test can see that
    speculation ran. ``build_with_eagle3(model_dir, drafter_dir, capture_layers)``: an engine of
    the folder speculating with that exported EAGLE-3 drafter (TensorRT-LLM takes it only at
    build time)."""

    name: str
    open: Callable[[Path, "EngineUnderTest"], RolloutEngine]
    limits: EngineLimits = EngineLimits()
    writes_as_it_streams: bool = True
    model_shape: dict[str, Any] = field(default_factory=dict)
    logprobs_atol: float = 1e-5
    accept_stats: bool = True
    build_with_eagle3: Callable[[Path, str, tuple[int, ...]], RolloutEngine] | None = None

    # the declared limits, as the tests read them
    modes = property(lambda self: self.limits.modes)
    hidden_states = property(lambda self: self.limits.hidden_states)
    step_stats = property(lambda self: self.limits.step_stats)
    drafter_kinds = property(lambda self: self.limits.drafter_kinds)
    drafter_form = property(lambda self: self.limits.drafter_form)
    eagle3_modules = property(lambda self: self.limits.eagle3_modules)
    sd_top_k = property(lambda self: self.limits.sd_top_k)
    sd_logprobs = property(lambda self: self.limits.sd_logprobs)
    why = property(lambda self: self.limits.why)

    def limits_phrases(self) -> list[str]:
        """What this engine declares it cannot do, one phrase each."""
        return self.limits.phrases()


class EngineUnderTest:
    """The `make_engine` fixture: ``make_engine(model_dir)`` is an engine of ``spec``."""

    def __init__(self, spec: EngineSpec, tmp: Path) -> None:
        self.spec = spec
        self._tmp = tmp
        self._exported: dict[tuple[str, str], str] = {}

    def __call__(self, model_dir: Path) -> RolloutEngine:
        return self.spec.open(Path(model_dir), self)

    def _skip(self, what: str) -> None:
        pytest.skip(f"the {self.spec.name} engine declares no {what} ({self.spec.why})")

    def require(self, *, mode: str | None = None, hidden: bool = False, top_k: bool = False) -> None:
        """Skip the test, with the reason, where it needs what the engine declares it cannot do.
        ``top_k``: the test samples with top-k (which only ``mode`` "rejection" applies here)."""
        if mode is not None and mode not in self.spec.modes:
            self._skip(f"mode {mode!r}")
        if hidden and not self.spec.hidden_states:
            self._skip("return_hidden")
        if top_k and mode == "rejection" and not self.spec.sd_top_k:
            self._skip("rejection top-k while it can speculate")

    def sampled_mode(self) -> str:
        """coupled where the engine runs it (each row repeats alone), else rejection."""
        return "coupled" if "coupled" in self.spec.modes else "rejection"

    def reproducible(self, **fields: Any) -> SamplingParams:
        """Sampling that gives the same tokens on every call: coupled where the engine
        runs it, else greedy (``temperature`` etc. are dropped for greedy)."""
        if "coupled" in self.spec.modes:
            return SamplingParams(mode="coupled", **fields)
        return SamplingParams(mode="greedy", **{k: v for k, v in fields.items()
                                                if k in ("max_new_tokens", "stop_on_eos")})

    def drafter(self, kind: str, cfg: LMConfig) -> Any:
        """The suite's drafter of ``kind`` for a target of ``cfg`` in the form the engine
        loads (skips the test where the engine cannot load that kind)."""
        if kind not in self.spec.drafter_kinds:
            self._skip(f"drafter kind {kind!r}")
        if self.spec.drafter_form == "module":
            return make_drafter(kind, cfg)
        key = (kind, repr(cfg))
        if key not in self._exported:  # the suite's drafters are seeded: one folder per (kind, target)
            folder = self._tmp / f"{kind}-{len(self._exported)}"
            folder.mkdir(parents=True)
            write_eagle3_hf(make_drafter(kind, cfg), folder)
            self._exported[key] = str(folder)
        return self._exported[key]

    def speculating(self, model_dir: Path, drafter_dir: str, capture_layers: tuple[int, ...]) -> RolloutEngine:
        """An engine of ``model_dir`` speculating with the exported EAGLE-3 ``drafter_dir``."""
        return self.spec.build_with_eagle3(Path(model_dir), drafter_dir, tuple(capture_layers))

    def first_drafter(self, kinds: tuple[str, ...], cfg: LMConfig) -> Any:
        """`drafter` of the first of ``kinds`` the engine loads."""
        usable = [k for k in kinds if k in self.spec.drafter_kinds]
        if not usable:
            self._skip(f"drafter kind of {list(kinds)}")
        return self.drafter(usable[0], cfg)


# ---- the engines -------------------------------------------------------------------------------
def _open_torch(model_dir: Path, under_test: EngineUnderTest) -> RolloutEngine:
    return TorchRolloutEngine.from_hf_folder(model_dir)


def _build_torch(model_dir: Path, drafter_dir: str, layers: tuple[int, ...]) -> RolloutEngine:
    engine = TorchRolloutEngine.from_hf_folder(model_dir)
    engine.load_drafter(read_eagle3_hf(drafter_dir))
    return engine


def _open_with_eagle3(model_dir: Path, under_test: EngineUnderTest, build: Callable[..., Any]) -> RolloutEngine:
    """TensorRT-LLM speculates only with the drafter it was built with, so its engine is
    built with the suite's EAGLE-3 drafter (exported), capturing that drafter's layers,
    then the drafter is unloaded (speculation off) like every engine's at start;
    `load_drafter(folder)` switches it back on with that folder's weights."""
    cfg = read_config(model_dir)
    engine = build(model_dir, under_test.drafter("eagle3", cfg), default_capture_layers(cfg.num_layers))
    engine.load_drafter(None)
    return engine


TRTLLM_MAX_DRAFT = 4  # the suite's deepest chain


def _build_trtllm(model_dir: Path, drafter_dir: str, layers: tuple[int, ...]) -> RolloutEngine:
    from nemo_tlt.rollout.trtllm_engine import TRTLLMRolloutEngine  # lazy: optional package

    return FollowingSchedule(TRTLLMRolloutEngine.from_hf_folder(
        model_dir, drafter_dir=drafter_dir, eagle3_layers_to_capture=layers, max_draft_len=TRTLLM_MAX_DRAFT))


class FollowingSchedule:
    """The TensorRT-LLM engine as the suite drives it. TensorRT-LLM fixes the draft-length
    schedule (and the drafter) per build, and the engine refuses a policy whose schedule
    differs; the suite asks each call for its own policy's. So before a call whose schedule
    differs from the built one this restarts the engine with it (`settings_for_schedule`; no
    drafter for plain decoding) and loads the last complete policy weights again (kept here:
    the suite's models are tiny). Drafter folders and refusals are the engine's own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._drafter = engine.config.drafter_dir
        self._weights: list[tuple[str, torch.Tensor]] | None = None
        self.restarts = 0

    @property
    def model_config(self) -> LMConfig:
        return self.engine.model_config

    def load_policy_weights(self, weights) -> None:
        pairs = list(weights.items() if isinstance(weights, dict) else weights)
        self.engine.load_policy_weights(iter(pairs))
        self._weights = [(name, tensor.detach().clone()) for name, tensor in pairs]

    def load_drafter(self, drafter) -> None:
        self.engine.load_drafter(drafter)
        self._drafter = None if drafter is None else str(drafter)
        self._reload_weights()

    def generate(self, requests, sampling, *, policy=None, **kwargs) -> GenerateOutput:
        self._follow(policy)
        return self.engine.generate(requests, sampling, policy=policy, **kwargs)

    def _follow(self, policy) -> None:
        from nemo_tlt.rollout.trtllm_schedule import draft_len_schedule, same_schedule, settings_for_schedule

        n = self.engine.config.max_batch_size
        wanted = draft_len_schedule(policy, TRTLLM_MAX_DRAFT, n)
        built = self.engine.config.build_schedule()
        if same_schedule(wanted, built, n):
            return
        if not wanted:
            self.engine.restart(drafter_dir=None, draft_len_schedule=None, max_concurrency=None)
        elif self._drafter is None:
            return  # the engine refuses the call, naming the missing drafter
        else:
            self.engine.restart(drafter_dir=self._drafter, load_format="auto", **settings_for_schedule(wanted))
        self.restarts += 1
        self._reload_weights()

    def _reload_weights(self) -> None:
        if self._weights is not None:
            self.engine.load_policy_weights(iter(self._weights))


class TRTLLMLimitedTorchEngine:
    """The torch engine behind TensorRT-LLM's declared limits, to run the suite's trtllm
    path here (tests only; it says nothing about TensorRT-LLM itself): built with an
    EAGLE-3 HF folder whose captured layers it checks as the TensorRT-LLM engine does,
    drafters only as such folders, coupled sampling and return_hidden refused by the
    TensorRT-LLM engine's own checks, per-step stats not reported; acceptance reported as
    TensorRT-LLM reports it (per request: decode iterations and tokens per iteration; here one
    record for the whole rollout) through the TensorRT-LLM engine's own mapping
    (`speculation_report`); no log-probs while a drafter is loaded (NaN, ``logprobs_from="none"``)."""

    def __init__(self, model_dir: Path, drafter_dir: str, layers: tuple[int, ...]) -> None:
        self._engine = TorchRolloutEngine.from_hf_folder(model_dir)
        config = TRTLLMEngineConfig(target_dir=str(model_dir), drafter_dir=drafter_dir, eagle3_layers_to_capture=layers)
        self._captured = trtllm_capture_layers(config, self.model_config.num_layers)
        self.load_drafter(drafter_dir)

    @property
    def model_config(self) -> LMConfig:
        return self._engine.model_config

    def load_policy_weights(self, weights) -> None:
        self._engine.load_policy_weights(weights)

    def load_drafter(self, drafter) -> None:
        if isinstance(drafter, torch.nn.Module):
            raise ValueError("load_drafter takes an EAGLE-3 HF folder (eagle3-hf), not a torch module")
        if drafter is None:
            self._engine.load_drafter(None)
            return
        check_drafter_layers(drafter, self._captured)
        self._engine.load_drafter(read_eagle3_hf(drafter))

    def generate(self, requests, sampling, *, policy=None, return_hidden=False, on_finish=None) -> GenerateOutput:
        validate_requests(requests, sampling, self.model_config)  # TensorRT-LLM's checks: coupled refused
        if return_hidden:
            raise ValueError("generate: return_hidden is not available from TensorRT-LLM's LLM API")
        out = self._engine.generate(requests, sampling, policy=policy)
        drafting = self._engine.drafter is not None
        if drafting:  # TensorRT-LLM reports no log-probs with speculative decoding configured
            for result in out.results:
                result.logprobs = [float("nan")] * len(result.tokens)
        stats = GenerationStats(tokens_generated=out.stats.tokens_generated)
        stats.wall_s = stats.time_other_s = out.stats.wall_s
        steps = out.stats.accept_lengths
        if steps:  # what TensorRT-LLM reports, as one request: decode iterations and tokens per iteration
            reported = SimpleNamespace(outputs=[SimpleNamespace(request_perf_metrics=None)], decoding_iter=len(steps),
                                       avg_decoded_tokens_per_iter=sum(steps) / len(steps))
            _, stats.accept_lengths = speculation_report([reported])
        for i, result in enumerate(out.results if on_finish is not None else ()):  # together, as the LLM API's
            on_finish(i, result)
        return GenerateOutput(out.results, stats, logprobs_from="none" if drafting else "engine")


TORCH = EngineSpec("torch", _open_torch, limits=TorchRolloutEngine.LIMITS, build_with_eagle3=_build_torch)
# the torch engine behind TensorRT-LLM's declared limits (read from its class: no TensorRT-LLM needed)
TRTLLM_LIMITS = EngineSpec(
    "torch-as-trtllm", lambda model_dir, under_test: _open_with_eagle3(model_dir, under_test, TRTLLMLimitedTorchEngine),
    limits=TRTLLMRolloutEngine.LIMITS, build_with_eagle3=TRTLLMLimitedTorchEngine,
    # 3 layers: the EAGLE-3 drafter captures (0, 1, 2); on 2 it would repeat one, and
    # TensorRT-LLM captures distinct layers (trtllm_engine.check_drafter_layers)
    model_shape=dict(num_layers=3))
TRTLLM = replace(
    TRTLLM_LIMITS, name="trtllm", writes_as_it_streams=False, open=lambda model_dir, under_test: _open_with_eagle3(model_dir, under_test,
                                                                                      _build_trtllm),
    build_with_eagle3=_build_trtllm,
    # head_dim 64 (hidden 128, 2 heads): a head size TensorRT-LLM's attention kernels are
    # built for; the torch suite's head_dim 8 is likely not one (unverified: never run)
    # its own kernels, not the reference's arithmetic: log-probs held to 1e-3 (unverified)
    logprobs_atol=1e-3,
    model_shape=dict(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, num_layers=3))


class _VLLMEngines:
    """vLLM engines of the suite, kept for the session: an engine takes seconds to build, so
    a test asking for one again gets a built one back as a fresh one would be: the folder's
    weights reloaded and the built drafter's weights restored (through the engine's own
    refit, which the suite checks elsewhere). One engine per (target folder, drafter folder,
    slot), the slot counting the calls for that pair within one test (its fixtures
    included: `new_test`, called from conftest.py before each test's setup), so that the
    engines a test holds at once are distinct ones (two builds per folder at most, here).
    A module-scoped fixture's engine may be handed out again, reset, to a later test of
    its module that asks for one itself; no test that runs on vLLM does."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, str | None, int], RolloutEngine] = {}
        self._calls: dict[tuple[str, str | None], int] = {}

    def new_test(self) -> None:
        self._calls.clear()

    def __call__(self, model_dir: Path, drafter_dir: str | None, layers: tuple[int, ...] = ()) -> RolloutEngine:
        from nemo_tlt.model.hf_io import read_state_dict
        from nemo_tlt.rollout.vllm_engine import VLLMRolloutEngine  # lazy: optional package

        pair = (str(model_dir), drafter_dir)
        slot = self._calls.get(pair, 0)
        self._calls[pair] = slot + 1
        key = (*pair, slot)
        engine = self._built.get(key)
        if engine is None:
            engine = self._built[key] = VLLMRolloutEngine.from_hf_folder(
                model_dir, drafter_dir=drafter_dir, num_speculative_tokens=4, max_num_seqs=64, kv_cache_gib=0.03,
                dtype="float32")
            return engine
        engine.load_policy_weights(read_state_dict(Path(model_dir)))
        if drafter_dir is not None:
            engine.load_drafter(drafter_dir)
        return engine


VLLM_ENGINES = _VLLMEngines()
VLLM = EngineSpec(
    "vllm", lambda model_dir, under_test: _open_with_eagle3(model_dir, under_test, VLLM_ENGINES),
    limits=VLLMRolloutEngine.LIMITS, writes_as_it_streams=False, build_with_eagle3=VLLM_ENGINES,
    # vLLM's CPU attention takes head sizes of 32 and up; 3 layers: distinct captured layers
    model_shape=dict(hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, num_layers=3))
