"""``nemo-tlt selfcheck --trtllm``: the TensorRT-LLM engine with a trained EAGLE-3 drafter.

NEVER RUN (no GPU and no TensorRT-LLM where it was written). Checks, in order:

* ``eagle3_drafter``: the demo EAGLE-3 drafter (``demo.assets.prepare_eagle3_drafter``,
  cached under ``$NEMO_TLT_CACHE``; trained on first use, on the host CPU: about 105
  minutes on one thread, docs/benchmarks.md; on a GPU node's CPUs unmeasured) exported
  with ``write_eagle3_hf``;
* ``trtllm_identity_greedy``: greedy rollouts of the demo target on TensorRT-LLM with the
  drafter speculating, token for token against the torch engine's plain greedy;
* ``trtllm_acceptance``: TensorRT-LLM's per-request acceptance over those rollouts
  (``rollout.trtllm_stats``): mean accepted length (tokens per verify step), draft
  tokens accepted / drafted; fails unless the mean is above ``MIN_MEAN_ACCEPT`` (speculation
  ran: an untrained EAGLE-3 drafter measured 1.009 on the demo target with a 4-token chain);
* ``trtllm_throughput``: tokens/s with and without the drafter, per batch size;
* ``pytest_trtllm``: ``pytest -m trtllm tests/conformance tests/rollout`` in a
  subprocess, its summary line.
"""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.selfcheck.demo_rollouts import demo_prompts, greedy, pytest_marked, sd_throughput
from nemo_tlt.speculative.tree_shape import TreeShape

BENCH_NOTE = ("training it takes about 105 minutes on one CPU thread (docs/benchmarks.md, 'Rollout: EAGLE-3 vs "
              "EAGLE-2 drafter'); it trains on the host CPU, on a GPU node too (time there unmeasured)")


# Mean accepted length (tokens per verify step) that shows speculation ran with a trained drafter:
# an untrained EAGLE-3 drafter on the demo target, greedy, 4-token chain, 8 prompts: 1.009 (torch
# engine, CPU); a 1 would mean no draft token was ever accepted.
MIN_MEAN_ACCEPT = 1.5


class DrafterNotCached(LookupError):
    """No trained demo EAGLE-3 drafter in the cache and training was not allowed."""


@dataclass(frozen=True)
class TrainedEagle3:
    target_dir: Path          # the demo target, HF format
    drafter_dir: Path         # the trained drafter, exported in the EAGLE-3 HF layout
    capture_layers: tuple[int, ...]
    trained_here_s: float | None  # seconds spent training it now (None: from the cache)


def cached_eagle3_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `prepare_eagle3_drafter` keeps the demo EAGLE-3 drafter (present or not)."""
    from nemo_tlt.demo.assets import AssetConfig, default_cache_dir, eagle3_drafter_name
    from nemo_tlt.demo.sft import warm_start_name

    config = AssetConfig()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / eagle3_drafter_name(warm_start_name(config.target, config.task, config.sft, config.sft_examples),
                                       config)


def export_trained_eagle3(folder: Path, cache_dir: str | os.PathLike | None = None,
                          train_if_missing: bool = True) -> TrainedEagle3:
    """The demo target and its trained EAGLE-3 drafter exported into ``folder`` (created).
    Without a cached drafter and ``train_if_missing`` false: `DrafterNotCached`."""
    from nemo_tlt.demo.assets import AssetConfig, prepare_assets, prepare_eagle3_drafter
    from nemo_tlt.drafter.eagle3_hf import write_eagle3_hf
    from nemo_tlt.drafter.io import load_drafter
    from nemo_tlt.model.hf_io import load_hf_folder

    cached = cached_eagle3_dir(cache_dir)
    missing = not (cached / "drafter.json").is_file()
    if missing and not train_if_missing:
        raise DrafterNotCached(f"no trained demo EAGLE-3 drafter at {cached}; {BENCH_NOTE}")
    t0 = time.perf_counter()
    drafter_cache = prepare_eagle3_drafter(AssetConfig(), cache_dir, progress=False)
    trained_s = time.perf_counter() - t0 if missing else None
    target_dir = Path(prepare_assets(AssetConfig(), cache_dir, progress=False).target_dir)
    drafter = load_drafter(drafter_cache, load_hf_folder(target_dir))
    folder.mkdir(parents=True, exist_ok=True)
    write_eagle3_hf(drafter, folder)
    return TrainedEagle3(target_dir, folder, tuple(drafter.capture_layers), trained_s)


class TRTLLMRun:
    """The engines of one ``--trtllm`` run, built once and shared by the checks."""

    def __init__(self, work: Path, cache_dir: str | None, prompts: int, max_new: int, draft_len: int,
                 batch_sizes: tuple[int, ...]) -> None:
        self.work, self.cache_dir = work, cache_dir
        self.prompts, self.max_new, self.draft_len, self.batch_sizes = prompts, max_new, draft_len, batch_sizes
        self.drafter: TrainedEagle3 | None = None
        self._identity: dict[str, Any] | None = None

    @property
    def policy(self) -> FixedSDPolicy:
        return FixedSDPolicy(TreeShape(self.draft_len, 1, self.draft_len))  # a chain: TensorRT-LLM's linear draft

    def eagle3_drafter(self) -> dict[str, Any]:
        self.drafter = export_trained_eagle3(self.work / "eagle3-hf", self.cache_dir, train_if_missing=True)
        return {"target_dir": str(self.drafter.target_dir), "drafter_dir": str(self.drafter.drafter_dir),
                "capture_layers": list(self.drafter.capture_layers), "trained_here_s": self.drafter.trained_here_s}

    def _engine(self, with_drafter: bool):
        from nemo_tlt.rollout.trtllm_engine import TRTLLMRolloutEngine

        if self.drafter is None:
            self.eagle3_drafter()
        kwargs: dict[str, Any] = {"max_batch_size": max(self.batch_sizes + (self.prompts,))}
        if with_drafter:
            kwargs.update(drafter_dir=str(self.drafter.drafter_dir), max_draft_len=self.draft_len,
                          eagle3_layers_to_capture=self.drafter.capture_layers)
        return TRTLLMRolloutEngine.from_hf_folder(self.drafter.target_dir, **kwargs)

    def identity(self) -> dict[str, Any]:
        """TensorRT-LLM greedy SD against TensorRT-LLM plain greedy (same engine, same GPU:
        the promise is identity within one engine configuration); the torch engine's plain
        greedy on the host is reported beside it, as information (kernels differ)."""
        from nemo_tlt.rollout.torch_engine import TorchRolloutEngine

        prompts = demo_prompts(self.prompts)
        plain, _, _ = greedy(self._engine(with_drafter=False), prompts, self.max_new, None)
        engine = self._engine(with_drafter=True)
        sd, stats, _ = greedy(engine, prompts, self.max_new, self.policy)
        torch_plain, _, _ = greedy(TorchRolloutEngine.from_hf_folder(self.drafter.target_dir), prompts,
                                    self.max_new, None)
        same = sum(a == b for a, b in zip(plain, sd))
        self._identity = {"stats": stats, "speculation": engine.last_speculation}
        if same != len(plain):
            raise AssertionError(f"TensorRT-LLM greedy SD differs from TensorRT-LLM plain greedy on "
                                 f"{len(plain) - same} of {len(plain)} sequences")
        return {"sequences": len(plain), "identical_rate": same / len(plain), "all_identical": True,
                "draft_len": self.draft_len,
                "torch_engine_plain_identical_rate": sum(a == b for a, b in zip(torch_plain, sd)) / len(plain)}

    def acceptance(self) -> dict[str, Any]:
        if self._identity is None:
            self.identity()
        stats, report = self._identity["stats"], self._identity["speculation"]
        out = {"mean_accept_len": stats.mean_accept_len, "accept_histogram": stats.accept_histogram(),
               "report": None if report is None else report.summary()}
        if not stats.mean_accept_len > MIN_MEAN_ACCEPT:
            raise AssertionError(f"mean accepted length {stats.mean_accept_len} per verify step, not above "
                                 f"{MIN_MEAN_ACCEPT}: speculation did not run (or hardly accepted) with the trained "
                                 f"drafter ({out})")
        return out

    def throughput(self) -> dict[str, Any]:
        methods = {"sd": (self._engine(True), self.policy), "plain": (self._engine(with_drafter=False), None)}
        rows = sd_throughput(methods, demo_prompts(max(self.batch_sizes)), self.batch_sizes, self.max_new)
        return {"draft_len": self.draft_len, "max_new_tokens": self.max_new, "rows": rows}


def pytest_trtllm(timeout_s: float | None = None,
                  run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> dict[str, Any]:
    """``pytest -m trtllm`` over the conformance suite and the engine's tests, as a user runs it."""
    return pytest_marked("trtllm", timeout_s, run)


def trtllm_plan(work: Path, cache_dir: str | None, prompts: int = 32, max_new: int = 400, draft_len: int = 4,
                batch_sizes: tuple[int, ...] = (1, 32)) -> dict[str, Callable[[], Any]]:
    """Check name -> zero-argument function returning its figures (raising when it fails)."""
    run = TRTLLMRun(work, cache_dir, prompts, max_new, draft_len, batch_sizes)
    return {"eagle3_drafter": run.eagle3_drafter, "trtllm_identity_greedy": run.identity,
            "trtllm_acceptance": run.acceptance, "trtllm_throughput": run.throughput,
            "pytest_trtllm": pytest_trtllm}


def trtllm_environment() -> dict[str, Any]:
    import importlib.metadata

    try:
        version = importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"tensorrt_llm": version}
