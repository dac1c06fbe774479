"""A first drafter for a user's target: generate, train with checkpoints, measure, report.

Contract
--------
`make_first_drafter(config)` turns a target folder and a prompts file into a drafter
folder ``config.out`` that `nemo_tlt.drafter.io.load_drafter` reads:

1. the prompts are split once by ``config.seed`` into training prompts and a held-back
   share (``eval_fraction``, at least one prompt each);
2. the target answers the training prompts with plain decoding
   (nemo_tlt.first_drafter.data), the features harvested from the same forward,
   stored in ``out/data/samples.safetensors``;
3. the drafter (EAGLE on the final hidden state, or EAGLE-3 on three fused layers)
   trains with `nemo_tlt.drafter.train.drafter_step` on packed batches
   (nemo_tlt.drafter.packing), AdamW with warmup and cosine decay; every
   ``checkpoint_every`` steps the weights, optimizer and sampling generator go to an
   atomic checkpoint in ``out/checkpoints`` (nemo_tlt.spot.checkpoint);
4. greedy speculative decoding with the tree ``config.tree`` on the held-back prompts
   measures the mean accepted length (tokens per verify step, the engine's
   ``GenerationStats.mean_accept_len``);
5. the drafter is written into ``out`` (``drafter.json``, ``drafter.safetensors``) and
   ``out/report.json`` last: a folder with a report is finished.

Resume: ``out/run.json`` records the settings that decide the result. A folder with a
``run.json`` and no report is a partial run: the same settings continue it (the stored
responses are reused, training goes on from the newest valid checkpoint with the
generator state it saved, so the result equals an uninterrupted run's); other
settings are refused with an error naming them. A finished folder, or one that is not
a run's, is refused unless ``overwrite``.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.atomic import write_json_atomic
from nemo_tlt.checks import check_float, check_int
from nemo_tlt.drafter.kinds import DRAFTER_KINDS, KIND_ALIASES, kind_named
from nemo_tlt.drafter.io import save_drafter
from nemo_tlt.drafter.packing import pack_eagle_batch
from nemo_tlt.drafter.train import DrafterTrainConfig, drafter_step, optim_config
from nemo_tlt.first_drafter.data import (AUTO, encode_prompts, generate_samples, load_samples, pick_tokenizer,
                                         read_prompts, save_samples)
from nemo_tlt.model.hf_io import load_hf_folder
from nemo_tlt.optim import build_optimizer
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from nemo_tlt.spot.checkpoint import CheckpointManager

log = logging.getLogger(__name__)

# the drafter kinds this command starts for a target (DrafterKind.for_target); aliases: KIND_ALIASES
KINDS = tuple(n for n in DRAFTER_KINDS.names() if kind_named(n).for_target is not None)
RUN_FILE, REPORT_FILE, SAMPLES_FILE, CHECKPOINTS = "run.json", "report.json", "data/samples.safetensors", "checkpoints"


@dataclass(frozen=True)
class FirstDrafterConfig:
    target: str
    prompts: str
    out: str
    kind: str = "eagle"
    prompt_key: str = "prompt"
    tokenizer: str = AUTO
    chat_template: bool = False
    system_prompt: str | None = None
    # the target's responses: temperature 0 is greedy, else coupled sampling (reproducible per seed)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    responses: int = 4
    gen_batch: int = 32
    # training (DrafterTrainConfig) and packing
    steps: int = 600
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 40
    pack_tokens: int = 2048
    ttt_steps: int | None = None   # EAGLE-3 draft steps unrolled in training (None: the tree's depth)
    checkpoint_every: int = 100
    # evaluation
    eval_fraction: float = 0.125
    tree: str = "6_2_12"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", KIND_ALIASES.get(self.kind, self.kind))
        if self.kind not in KINDS:
            raise ValueError(f"--type must be one of {list(KINDS)}, got {self.kind!r}")
        check_float("--temperature", self.temperature, 0)
        check_float("--top-p", self.top_p, 0, 1, lo_open=True)
        for name, lo in (("top_k", 0), ("max_new_tokens", 1), ("responses", 1), ("gen_batch", 1), ("steps", 1),
                         ("batch_size", 1), ("warmup_steps", 0), ("pack_tokens", 1), ("checkpoint_every", 1),
                         ("seed", 0)):
            check_int(f"--{name.replace('_', '-')}", getattr(self, name), lo)
        if self.ttt_steps is not None:
            check_int("--ttt-steps", self.ttt_steps, 1)
        check_float("--lr", self.lr, 0, lo_open=True)
        check_float("--eval-fraction", self.eval_fraction, 0, 1, lo_open=True, hi_open=True)
        TreeShape.parse(self.tree, "--tree")

    @property
    def shape(self) -> TreeShape:
        return TreeShape.parse(self.tree)

    def sampling(self) -> SamplingParams:
        if self.temperature == 0:
            return SamplingParams(mode="greedy", max_new_tokens=self.max_new_tokens, seed=self.seed)
        return SamplingParams(mode="coupled", temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens, seed=self.seed)

    def train_config(self) -> DrafterTrainConfig:
        return DrafterTrainConfig(steps=self.steps, batch_size=self.batch_size, lr=self.lr,
                                  warmup_steps=min(self.warmup_steps, self.steps - 1), seed=self.seed)

    def settings(self) -> dict[str, Any]:
        """What decides the result (``run.json``): everything but the output folder and the
        checkpoint interval."""
        s = asdict(self)
        for name in ("out", "checkpoint_every"):
            s.pop(name)
        s["target"], s["prompts"] = str(Path(self.target).resolve()), str(Path(self.prompts).resolve())
        return s


def split_prompts(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-back) prompt indices: a seeded permutation, ceil(fraction * n) held
    back, at least one of each."""
    if n < 2:
        raise ValueError(f"--prompts: {n} prompt(s); at least 2 are needed (some train, some are held back)")
    order = np.random.default_rng(seed).permutation(n).tolist()
    held = min(n - 1, max(1, math.ceil(fraction * n)))
    return sorted(order[held:]), sorted(order[:held])


def prepare_out(config: FirstDrafterConfig, overwrite: bool) -> Path:
    """The output folder, fresh or holding a partial run of the same settings (see the module docstring)."""
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        run_file = out / RUN_FILE
        if overwrite and (run_file.is_file() or (out / "drafter.json").is_file()):
            shutil.rmtree(out)
        elif (out / REPORT_FILE).is_file():
            raise ValueError(f"--out: {out} holds a finished drafter ({REPORT_FILE}); choose another folder or "
                             "pass --overwrite")
        elif not run_file.is_file():
            raise ValueError(f"--out: {out} is not empty and holds no {RUN_FILE} of a drafter run; choose an empty "
                             "or new folder")
        else:
            saved = json.loads(run_file.read_text())
            saved["kind"] = KIND_ALIASES.get(saved.get("kind"), saved.get("kind"))  # a run saved as "eagle2" is "eagle"
            wanted = json.loads(json.dumps(config.settings()))
            differ = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
            if differ:
                raise ValueError(f"--out: {out} holds a partial run with other settings ({', '.join(differ)}: "
                                 f"{[saved.get(k) for k in differ]} there, {[wanted.get(k) for k in differ]} now); "
                                 "resume it with the same options, or pass --overwrite to start over")
            return out
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / RUN_FILE, config.settings())
    return out


def new_drafter(config: FirstDrafterConfig, target) -> torch.nn.Module:
    """An untrained drafter of ``config.kind`` for ``target`` (seeded; EAGLE-3 unrolls
    ``ttt_steps``, by default the tree's depth)."""
    depth = config.ttt_steps if config.ttt_steps is not None else config.shape.depth
    return kind_named(config.kind).for_target(target, torch.Generator().manual_seed(config.seed), depth)


def train(drafter: torch.nn.Module, target, samples, config: FirstDrafterConfig, out: Path,
          progress: bool) -> dict[str, Any]:
    """Train from the newest checkpoint in ``out`` (or from scratch); checkpoint as it goes."""
    tc = config.train_config()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt, schedule = build_optimizer(params, optim_config(tc))
    gen = torch.Generator().manual_seed(tc.seed)
    # a row holds at least the longest sample: samples are never split (nemo_tlt.drafter.packing)
    budget = max(config.pack_tokens, max(s.num_pairs for s in samples))
    start, history = 0, []
    with CheckpointManager(out / CHECKPOINTS, keep_last=2) as ckpt:
        if ckpt.latest() is not None:
            found = ckpt.load(expected_shapes={k: v.shape for k, v in drafter.state_dict().items()})
            drafter.load_state_dict(found.tensors)
            opt.load_state_dict(found.extra_state["optimizer"])
            gen.set_state(found.extra_state["rng"])
            start, history = found.json_state["step"], found.json_state["history"]
            log.info("resuming from %s (step %d of %d)", found.path, start, tc.steps)
        drafter.train()
        bar = tqdm(range(start, tc.steps), desc=f"train {config.kind} drafter", initial=start, total=tc.steps,
                   disable=not progress)
        for step in bar:
            schedule.apply(step)
            stats = drafter_step(drafter, target, samples, lambda b: pack_eagle_batch(b, budget), opt, tc, gen)
            history.append(stats["loss"])
            bar.set_postfix(loss=f"{stats['loss']:.3f}")
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == tc.steps:
                ckpt.save_sync(step + 1, dict(drafter.state_dict()),
                               {"optimizer": opt.state_dict(), "rng": gen.get_state()},
                               {"step": step + 1, "history": history})
    drafter.eval()
    tail = history[-max(1, len(history) // 10):]
    return {"resumed_from_step": start, "final_loss": float(np.mean(tail)), "token_budget": budget}


def measure(target, drafter, prompts: list[list[int]], shape: TreeShape, max_new_tokens: int,
            batch_size: int) -> dict[str, float]:
    """Greedy SD with ``shape``: mean accepted length (tokens per verify step) and target
    forwards per generated token over all the prompts."""
    engine = TorchRolloutEngine(target, drafter)
    accepted, forwards, tokens = [], 0, 0
    for start in range(0, len(prompts), batch_size):
        reqs = [Request(p, seq_id=start + i) for i, p in enumerate(prompts[start: start + batch_size])]
        stats = engine.generate(reqs, SamplingParams(mode="greedy", max_new_tokens=max_new_tokens),
                                policy=FixedSDPolicy(shape)).stats
        accepted += stats.accept_lengths
        forwards, tokens = forwards + stats.target_forwards, tokens + stats.tokens_generated
    return {"mean_accept_len": sum(accepted) / max(1, len(accepted)),
            "target_fwd_per_token": forwards / max(1, tokens), "eval_tokens": tokens}


def install_drafter(drafter: torch.nn.Module, out: Path, extra: dict) -> None:
    """Write the drafter's two files into ``out`` (each renamed into place)."""
    staging = out / ".drafter"
    save_drafter(drafter, staging, extra=extra)
    for name in ("drafter.safetensors", "drafter.json"):
        (staging / name).replace(out / name)
    staging.rmdir()


def make_first_drafter(config: FirstDrafterConfig, overwrite: bool = False, progress: bool = True) -> dict:
    """See the module docstring; returns the report written to ``out/report.json``."""
    t0 = time.perf_counter()
    if not (Path(config.target) / "config.json").is_file():
        raise ValueError(f"--target: {config.target} is not a model folder (no config.json)")
    prompts = read_prompts(config.prompts, config.prompt_key)
    train_idx, eval_idx = split_prompts(len(prompts), config.eval_fraction, config.seed)
    tokenizer = pick_tokenizer(config.target, config.tokenizer, config.chat_template, config.system_prompt)
    target = load_hf_folder(config.target)
    ids = encode_prompts(tokenizer, prompts, target, config.target)
    drafter = new_drafter(config, target)
    out = prepare_out(config, overwrite)
    samples_path = out / SAMPLES_FILE
    if samples_path.is_file():
        samples = load_samples(samples_path)
    else:
        samples = generate_samples(target, drafter, [ids[i] for i in train_idx], config.sampling(),
                                   config.responses, config.gen_batch, progress)
        save_samples(samples, samples_path)
    t_gen = time.perf_counter()
    trained = train(drafter, target, samples, config, out, progress)
    t_train = time.perf_counter()
    measured = measure(target, drafter, [ids[i] for i in eval_idx], config.shape, config.max_new_tokens,
                       config.gen_batch)
    t_eval = time.perf_counter()
    report = {
        "mean_accept_len": measured["mean_accept_len"],
        "target_fwd_per_token": measured["target_fwd_per_token"],
        "tree": config.tree, "type": config.kind, "seed": config.seed,
        "target": str(Path(config.target).resolve()), "prompts_file": str(Path(config.prompts).resolve()),
        "tokenizer": repr(tokenizer),
        "train_prompts": len(train_idx), "eval_prompts": len(eval_idx), "eval_prompt_indices": eval_idx,
        "samples": len(samples), "train_pairs": sum(s.num_pairs for s in samples),
        "eval_tokens": measured["eval_tokens"],
        "sampling": asdict(config.sampling()), "responses_per_prompt": config.responses,
        "steps": config.steps, "batch_size": config.batch_size, "lr": config.lr, **trained,
        "time_s": {"generate": t_gen - t0, "train": t_train - t_gen, "eval": t_eval - t_train,
                   "total": t_eval - t0},
        "torch_threads": torch.get_num_threads(),
    }
    install_drafter(drafter, out, {"report": REPORT_FILE})
    write_json_atomic(out / REPORT_FILE, report)
    return report
