"""Supervised warm start: teach a tiny LM the task traces before RL.

RL from a random model would never earn a reward, so the policy first learns the
format (and most of the arithmetic) by supervised fine-tuning on reference
traces. Contract:

- An example is ``BOS + prompt + completion + EOS``; the loss is the token-mean
  next-token cross entropy over the completion and its EOS only (the prompt is
  context, never a target), matching what RL later optimises.
- ``train_sft`` is a plain PyTorch AdamW loop (linear warmup, cosine decay to
  ``min_lr_ratio * lr``, global-norm clipping). Batches are drawn with replacement
  by an explicit ``torch.Generator`` seeded from ``SFTConfig.seed`` and padded
  on the right (the model is causal, so right padding never changes the logits
  of real tokens). Lengths are heavy-tailed, so padding a whole batch to its
  longest example wastes most of the compute: the batch is instead sorted by
  length and cut into micro-batches of at most ``micro_batch_tokens`` padded
  tokens, whose gradients are accumulated with the batch-wide token count as the
  denominator. That changes the speed, not the gradient (up to float rounding).
- ``cached_warm_start`` trains once per (model, task, SFT, data) configuration
  and stores an HF-format folder under a hash of those configs; later calls
  return the folder without training. The folder is written atomically.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.model.config import LMConfig
from nemo_tlt.optim import OptimConfig, build_optimizer
from nemo_tlt.model.hf_io import save_hf_folder
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.demo.tasks import Problem, TaskConfig, make_problems
from nemo_tlt.demo.tokenizer import CharTokenizer

Example = Union[Problem, tuple[str, str], tuple[Sequence[int], Sequence[int]]]
_CACHE_FORMAT = 1  # bump when the meaning of a cached folder changes


@dataclass(frozen=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    seq_len: int = 512
    micro_batch_tokens: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "micro_batch_tokens"):
            check_int(f"SFTConfig.{name}", getattr(self, name), 1)
        check_int("SFTConfig.warmup_steps", self.warmup_steps, 0, self.steps)
        check_float("SFTConfig.lr", self.lr, 0, lo_open=True)
        check_float("SFTConfig.min_lr_ratio", self.min_lr_ratio, 0, 1)
        check_float("SFTConfig.weight_decay", self.weight_decay, 0)
        check_float("SFTConfig.grad_clip", self.grad_clip, 0, lo_open=True)
        for name in ("adam_beta1", "adam_beta2"):
            check_float(f"SFTConfig.{name}", getattr(self, name), 0, 1, hi_open=True)
        check_int("SFTConfig.seed", self.seed)


def lr_at(step: int, config: SFTConfig) -> float:
    """Learning rate for 0-based ``step``: linear warmup to ``lr``, then cosine to
    ``min_lr_ratio * lr`` at the last step."""
    return optim_config(config).lr_at(step)


def optim_config(config: SFTConfig) -> OptimConfig:
    """The shared AdamW + schedule form of ``config`` (the decay ends at the last step)."""
    return OptimConfig(lr=config.lr, weight_decay=config.weight_decay, betas=[config.adam_beta1, config.adam_beta2],
                       grad_clip=config.grad_clip, warmup_steps=config.warmup_steps,
                       decay_steps=max(0, config.steps - config.warmup_steps - 1), min_lr_ratio=config.min_lr_ratio)


def encode_example(example: Example, tokenizer: CharTokenizer) -> tuple[list[int], list[int]]:
    """``(ids, loss_mask)`` of ``BOS + prompt + completion + EOS``; the mask is 1 on
    the completion and EOS (the tokens the model must learn to produce)."""
    if isinstance(example, Problem):
        example = (example.prompt, example.solution)
    if not (isinstance(example, tuple) and len(example) == 2):
        raise ValueError(f"SFT example must be a Problem or a (prompt, completion) pair, got {type(example)}")
    prompt, completion = example
    if isinstance(prompt, str) != isinstance(completion, str):
        raise ValueError("SFT example: prompt and completion must both be text or both be token ids")
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    completion_ids = tokenizer.encode(completion) if isinstance(completion, str) else [int(t) for t in completion]
    ids = [tokenizer.bos_id] + prompt_ids + completion_ids + [tokenizer.eos_id]
    mask = [0] * (1 + len(prompt_ids)) + [1] * (len(completion_ids) + 1)
    return ids, mask


def collate(encoded: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-pad to the longest example: ``(inputs[B,L-1], targets[B,L-1], weights[B,L-1])``
    where ``weights`` is the loss mask of each target token (0 on padding)."""
    length = max(len(ids) for ids, _ in encoded)
    ids = torch.full((len(encoded), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(encoded), length), dtype=torch.float32)
    for row, (seq, seq_mask) in enumerate(encoded):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = torch.tensor(seq_mask, dtype=torch.float32)
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def _weighted_ce_sum(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                reduction="none")
    return (per_token * weights.reshape(-1)).sum()


def sft_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Token-mean cross entropy of ``model(inputs)`` against ``targets`` where ``weights`` is 1."""
    return _weighted_ce_sum(model, inputs, targets, weights) / weights.sum().clamp(min=1.0)


def length_buckets(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` sorted by length and cut greedily into groups whose
    padded size (rows x longest) stays within ``max_tokens``; an example longer
    than ``max_tokens`` gets a group of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for index in order:
        if groups and (len(groups[-1]) + 1) * lengths[index] <= max_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def accumulate_batch_grad(model: nn.Module, batch: Sequence[tuple[list[int], list[int]]], pad_id: int,
                          micro_batch_tokens: int) -> tuple[float, int]:
    """Backward of the batch's token-mean loss, one length bucket at a time.

    Each bucket contributes sum(CE * w) / N with N the loss tokens of the whole
    batch, so the accumulated gradient is that of the full batch. Returns the
    batch loss and N."""
    device = next(model.parameters()).device
    total = sum(sum(mask[1:]) for _, mask in batch)
    denominator = float(max(total, 1))
    loss = 0.0
    for group in length_buckets([len(ids) for ids, _ in batch], micro_batch_tokens):
        inputs, targets, weights = (t.to(device) for t in collate([batch[i] for i in group], pad_id))
        part = _weighted_ce_sum(model, inputs, targets, weights) / denominator
        part.backward()
        loss += part.item()
    return loss, int(total)


def _optimizer(model: nn.Module, config: SFTConfig):
    # Decay matrices only: decaying norm gains and biases just fights the init.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return build_optimizer(groups, optim_config(config))


def train_sft(
    model: nn.Module,
    examples: Sequence[Example],
    config: SFTConfig,
    tokenizer: CharTokenizer,
    log_every: int = 50,
    progress: bool = True,
) -> dict[str, Any]:
    """Fine-tune ``model`` in place; returns stats.

    Stats: ``losses`` (every step), ``initial_loss`` (step 0), ``final_loss`` (mean
    of the last 10% of steps, at least one), ``log`` (step, loss, lr every
    ``log_every`` steps; 0 disables), ``tokens`` (loss tokens seen), ``seconds``.
    An example longer than ``config.seq_len`` tokens raises ``ValueError``.
    """
    if not examples:
        raise ValueError("train_sft: no examples")
    encoded = [encode_example(ex, tokenizer) for ex in examples]
    for index, (ids, _) in enumerate(encoded):
        if len(ids) > config.seq_len:
            raise ValueError(f"train_sft: example {index} has {len(ids)} tokens, above SFTConfig.seq_len="
                             f"{config.seq_len}")
    generator = torch.Generator().manual_seed(config.seed)
    optimizer, schedule = _optimizer(model, config)
    was_training = model.training
    model.train()
    losses: list[float] = []
    log: list[dict[str, float]] = []
    tokens, start = 0, time.perf_counter()
    bar = tqdm(range(config.steps), desc="sft", disable=not progress, leave=False)
    for step in bar:
        lr = schedule.apply(step)
        picks = torch.randint(len(encoded), (config.batch_size,), generator=generator).tolist()
        optimizer.zero_grad(set_to_none=True)
        loss, batch_tokens = accumulate_batch_grad(model, [encoded[i] for i in picks], tokenizer.pad_id,
                                                   config.micro_batch_tokens)
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss)
        tokens += batch_tokens
        if log_every and (step % log_every == 0 or step == config.steps - 1):
            log.append({"step": step, "loss": losses[-1], "lr": lr})
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr:.2e}")
    model.train(was_training)
    tail = max(1, config.steps // 10)
    return {"losses": losses, "initial_loss": losses[0], "final_loss": float(np.mean(losses[-tail:])),
            "log": log, "tokens": tokens, "seconds": time.perf_counter() - start}


# ---- cached warm start ------------------------------------------------------

def warm_start_key(model_config: LMConfig, task_config: TaskConfig, sft_config: SFTConfig,
                   num_examples: int, tokenizer: CharTokenizer) -> str:
    """Hash of everything that determines the trained weights."""
    payload = {"format": _CACHE_FORMAT, "model": model_config.to_dict(), "task": task_config.to_dict(),
               "sft": asdict(sft_config), "num_examples": num_examples, "alphabet": tokenizer.alphabet}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def warm_start_name(model_config: LMConfig, task_config: TaskConfig, sft_config: SFTConfig,
                    num_examples: int) -> str:
    """The folder name ``cached_warm_start`` stores this configuration under."""
    key = warm_start_key(model_config, task_config, sft_config, num_examples, CharTokenizer())
    return f"warm_start-{task_config.name}-{key}"


def check_fits(model_config: LMConfig, task_config: TaskConfig, sft_config: SFTConfig,
               tokenizer: CharTokenizer) -> None:
    """Raise ValueError when the task's longest example cannot be trained or represented."""
    if model_config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"LMConfig.vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
                         f"{tokenizer.vocab_size}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        expected = getattr(tokenizer, name.replace("_token", ""))
        if getattr(model_config, name) != expected:
            raise ValueError(f"LMConfig.{name}={getattr(model_config, name)} but the tokenizer uses {expected}")
    longest = task_config.max_total_chars + 2  # BOS and EOS
    if longest > sft_config.seq_len:
        raise ValueError(f"SFTConfig.seq_len={sft_config.seq_len} is shorter than the longest {task_config.name!r} "
                         f"example ({longest} tokens); lower TaskConfig.max_solution_chars or raise seq_len")
    if longest > model_config.max_position_embeddings:
        raise ValueError(f"LMConfig.max_position_embeddings={model_config.max_position_embeddings} is shorter "
                         f"than the longest {task_config.name!r} example ({longest} tokens)")


def cached_warm_start(
    cache_dir: str | os.PathLike,
    model_config: LMConfig,
    task_config: TaskConfig,
    sft_config: SFTConfig,
    num_examples: int = 4096,
    progress: bool = True,
) -> Path:
    """HF-format folder of a model SFT-trained on ``num_examples`` problems of the
    task; trained on the first call, reused afterwards. The folder also holds
    ``warm_start.json`` (the configs and the training stats)."""
    if num_examples < 1:
        raise ValueError(f"cached_warm_start: num_examples must be >= 1, got {num_examples}")
    tokenizer = CharTokenizer()
    check_fits(model_config, task_config, sft_config, tokenizer)
    key = warm_start_key(model_config, task_config, sft_config, num_examples, tokenizer)
    folder = Path(cache_dir) / warm_start_name(model_config, task_config, sft_config, num_examples)
    if (folder / "config.json").is_file() and (folder / "warm_start.json").is_file():
        return folder
    problems = make_problems(task_config, num_examples, np.random.default_rng(sft_config.seed))
    model = DecoderLM(model_config)
    model.init_weights_(torch.Generator().manual_seed(sft_config.seed))
    stats = train_sft(model, problems, sft_config, tokenizer, progress=progress)
    summary = {"key": key, "model": model_config.to_dict(), "task": task_config.to_dict(),
               "sft": asdict(sft_config), "num_examples": num_examples,
               "stats": {k: stats[k] for k in ("initial_loss", "final_loss", "tokens", "seconds", "log")}}
    # save_hf_folder writes a temporary folder and renames it into place, so a
    # crash never leaves a half-written folder that a later call would trust.
    return save_hf_folder(model, folder, extra_files={"warm_start.json": json.dumps(summary, indent=2)})
