"""The demo's models (main job and benchmarks), made here and cached: nothing is downloaded.

`prepare_assets` returns, for each model, the copy shipped with the package when it
was trained with exactly the requested configuration (``nemo_tlt.demo.shipped_assets``);
otherwise it trains (once per configuration, then reuses from the cache):
1. the *target*: a small Llama-family LM SFT-trained on the long-tailed synthetic
   arithmetic task (nemo_tlt.demo.sft.cached_warm_start);
2. an EAGLE *drafter* trained on the target's own generations (hidden states
   returned by the rollout engine: no extra target forward);
3. a one-layer *assistant* LM for HF assisted generation, SFT-trained on the same task;
4. on request (`prepare_eagle3_drafter`), an EAGLE-3 drafter trained on the same
   generations with the same recipe (steps, batch, optimizer) as the EAGLE drafter;
   never shipped, always cached.

Cache root: ``$NEMO_TLT_CACHE`` or ``~/.cache/nemo_tlt``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.data import DrafterSample
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter, default_capture_layers
from nemo_tlt.drafter.io import load_drafter, save_drafter
from nemo_tlt.drafter.train import DrafterTrainConfig, train_drafter
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import load_hf_folder
from nemo_tlt.demo.sft import SFTConfig, cached_warm_start, warm_start_name
from nemo_tlt.demo.shipped_assets import shipped_folder
from nemo_tlt.demo.tasks import Problem, TaskConfig, make_problems
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape

log = logging.getLogger(__name__)
_VOCAB = CharTokenizer().vocab_size


def default_cache_dir() -> Path:
    return Path(os.environ.get("NEMO_TLT_CACHE") or Path.home() / ".cache" / "nemo_tlt")


@dataclass(frozen=True)
class AssetConfig:
    # Deep and narrow: on a CPU, a forward pass costs mostly per-layer overhead, so
    # depth is what makes a one-layer drafter cheap relative to the target.
    target: LMConfig = LMConfig(vocab_size=_VOCAB, hidden_size=128, intermediate_size=384, num_layers=16,
                                num_heads=4, num_kv_heads=2, max_position_embeddings=640)
    assistant: LMConfig = LMConfig(vocab_size=_VOCAB, hidden_size=128, intermediate_size=384, num_layers=1,
                                   num_heads=4, num_kv_heads=2, max_position_embeddings=640)
    task: TaskConfig = TaskConfig(name="arith", tail_exponent=1.3, max_solution_chars=400)
    # 1200 steps (about 1M completion tokens): the traces are nearly deterministic given
    # the prompt, and a confident warm start both earns RL rewards and is predictable
    # enough for a drafter (why this many: docs/benchmarks.md).
    sft: SFTConfig = SFTConfig(steps=1200, batch_size=16, lr=3e-3, warmup_steps=20, seq_len=640)
    sft_examples: int = 4096
    drafter_prompts: int = 256
    drafter_max_new_tokens: int = 400
    # (mode, temperature, seed) of the target's generations the drafter learns from: its
    # argmax text and coupled samples at the demo's and the benchmark's temperatures.
    # Coupled samples do not depend on the engine's row order, so the data are
    # reproducible. The drafter trains for 2400 steps (why this many: docs/benchmarks.md).
    drafter_data: tuple[tuple[str, float, int], ...] = (("greedy", 1.0, 0), ("coupled", 0.7, 1),
                                                        ("coupled", 1.0, 2))
    drafter_train: DrafterTrainConfig = field(default_factory=lambda: DrafterTrainConfig(
        steps=2400, batch_size=16, lr=3e-3, warmup_steps=40))
    # The EAGLE-3 drafter (trained with drafter_train too): draft steps unrolled by
    # training-time test, as deep as the deepest tree the demo drafts (8_2_16): past
    # its TTT depth a drafter feeds itself inputs it never trained on (docs/benchmarks.md);
    # the demo's character vocabulary is small, so no reduced one.
    eagle3_ttt_steps: int = 8
    # the target layers the EAGLE-3 drafter fuses (None: TensorRT-LLM's default indices)
    eagle3_capture_layers: tuple[int, ...] | None = None


@dataclass
class Assets:
    target_dir: Path
    drafter_dir: Path
    assistant_dir: Path


def task_requests(task: TaskConfig, n: int, seed: int) -> tuple[list[Problem], list[Request]]:
    """n problems and their prompts as requests (BOS + prompt), seq ids 0..n-1."""
    tok = CharTokenizer()
    problems = make_problems(task, n, np.random.default_rng(seed))
    return problems, [Request(tok.encode(p.prompt, add_bos=True), seq_id=i) for i, p in enumerate(problems)]


def _key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _drafter_samples(target, config: AssetConfig, drafter=None) -> list[DrafterSample]:
    """The target's generations on the drafter prompts, with the features `drafter`
    reads (None: the final hidden states; an EAGLE-3 drafter: its captured layers and the final state)."""
    _, reqs = task_requests(config.task, config.drafter_prompts, seed=10_000)
    samples: list[DrafterSample] = []
    engine = TorchRolloutEngine(target, drafter)
    for mode, temperature, seed in config.drafter_data:
        sp = SamplingParams(mode=mode, temperature=temperature, max_new_tokens=config.drafter_max_new_tokens,
                            seed=seed)
        for start in range(0, len(reqs), 32):
            chunk = reqs[start: start + 32]
            res = engine.generate(chunk, sp, return_hidden=True).results
            samples += [DrafterSample(torch.tensor(list(r.prompt) + o.tokens), o.hidden_states)
                        for r, o in zip(chunk, res)]
    return samples


def _train_and_save(drafter, target, samples, config: AssetConfig, out: Path, progress: bool) -> Path:
    history = train_drafter(drafter, target, samples, config.drafter_train, progress=progress)
    tail = history[-max(1, len(history) // 10):]
    stats = {k: float(np.mean([h[k] for h in tail])) for k in tail[0]}
    return save_drafter(drafter, out, extra={"train_stats": stats, "num_samples": len(samples)})


def _train_drafter_on_target(target_dir: Path, config: AssetConfig, out: Path, progress: bool) -> Path:
    target = load_hf_folder(target_dir)
    drafter = EagleDrafter(EagleConfig.from_target(target.config),
                           generator=torch.Generator().manual_seed(config.drafter_train.seed))
    return _train_and_save(drafter, target, _drafter_samples(target, config), config, out, progress)


def _train_eagle3_on_target(target_dir: Path, config: AssetConfig, out: Path, progress: bool) -> Path:
    target = load_hf_folder(target_dir)
    drafter = Eagle3Drafter(Eagle3Config.from_target(target.config, config.eagle3_capture_layers,
                                                     ttt_steps=config.eagle3_ttt_steps),
                            generator=torch.Generator().manual_seed(config.drafter_train.seed))
    # its own head starts as the target's (the EAGLE drafter reads the target's head itself)
    drafter.init_head_from(target)
    samples = _drafter_samples(target, config, drafter)
    return _train_and_save(drafter, target, samples, config, out, progress)


def drafter_name(target_name: str, config: AssetConfig) -> str:
    """The cache folder name of the drafter trained on the target cached as ``target_name``."""
    key = _key({"target": target_name, "prompts": config.drafter_prompts,
                "max_new": config.drafter_max_new_tokens, "train": asdict(config.drafter_train),
                "data": [list(d) for d in config.drafter_data], "format": 3})
    return f"drafter-eagle-{key}"


def eagle3_drafter_name(target_name: str, config: AssetConfig) -> str:
    """The cache folder name of the EAGLE-3 drafter trained on the target cached as ``target_name``."""
    key = _key({"target": target_name, "prompts": config.drafter_prompts,
                "max_new": config.drafter_max_new_tokens, "train": asdict(config.drafter_train),
                "data": [list(d) for d in config.drafter_data], "ttt_steps": config.eagle3_ttt_steps, "format": 3,
                **({"capture": list(config.eagle3_capture_layers)}
                   if config.eagle3_capture_layers not in (None, default_capture_layers(config.target.num_layers))
                   else {})})
    return f"drafter-eagle3-{key}"


def prepare_eagle3_drafter(config: AssetConfig = AssetConfig(), cache_dir: str | os.PathLike | None = None,
                           progress: bool = True) -> Path:
    """The EAGLE-3 drafter of ``config``'s target from the cache, trained on first use
    (the target comes from `prepare_assets`)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target_dir = prepare_assets(config, cache_dir, progress).target_dir
    target_name = warm_start_name(config.target, config.task, config.sft, config.sft_examples)
    out = cache / eagle3_drafter_name(target_name, config)
    if not (out / "drafter.json").is_file():
        log.info("drafter: training EAGLE-3 on the target's generations")
        _train_eagle3_on_target(target_dir, config, out, progress)
    return out


def prepare_assets(config: AssetConfig = AssetConfig(), cache_dir: str | os.PathLike | None = None,
                   progress: bool = True, shipped: bool = True) -> Assets:
    """The three demo models for ``config``: the shipped ones where they were trained
    with exactly this configuration (``shipped``), else the cache's, trained on first use."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def find(role: str, name: str) -> Path | None:
        folder = shipped_folder(role, name) if shipped else None
        if folder is not None:
            log.info("%s: shipped with the package (%s)", role, name)
        return folder

    def warm_start(role: str, model: LMConfig, name: str) -> Path:
        found = find(role, name)
        if found is not None:
            return found
        log.info("%s: SFT warm start (cached under %s)", role, cache)
        return cached_warm_start(cache, model, config.task, config.sft, config.sft_examples, progress)

    target_name = warm_start_name(config.target, config.task, config.sft, config.sft_examples)
    target_dir = warm_start("target", config.target, target_name)
    assistant_dir = warm_start("assistant", config.assistant,
                               warm_start_name(config.assistant, config.task, config.sft, config.sft_examples))
    # named after the target's configuration, not its folder (a shipped one is just "target")
    name = drafter_name(target_name, config)
    drafter_dir = find("drafter", name) or cache / name
    if not (drafter_dir / "drafter.json").is_file():
        log.info("drafter: training EAGLE on the target's generations")
        _train_drafter_on_target(target_dir, config, drafter_dir, progress)
    return Assets(target_dir, drafter_dir, assistant_dir)


def measure_acceptance(target, drafter, task: TaskConfig, shape: TreeShape, num_prompts: int,
                       max_new_tokens: int, seed: int = 20_000) -> dict[str, float]:
    """Greedy SD with ``shape`` on ``num_prompts`` task prompts, one batch: the drafter's
    mean accepted length (tokens per verify step, the engine's definition) and the
    target forwards per generated token."""
    _, reqs = task_requests(task, num_prompts, seed)
    engine = TorchRolloutEngine(target, drafter)
    stats = engine.generate(reqs, SamplingParams(mode="greedy", max_new_tokens=max_new_tokens),
                            policy=FixedSDPolicy(shape)).stats
    return {"mean_accept_len": float(stats.mean_accept_len),
            "target_fwd_per_token": stats.target_forwards / max(1, stats.tokens_generated)}


def load_assets(assets: Assets):
    target = load_hf_folder(assets.target_dir)
    return target, load_drafter(assets.drafter_dir, target)
