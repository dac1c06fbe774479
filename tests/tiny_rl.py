"""The tiny RL assets the loop tests share: a 2-layer policy SFT'd briefly on short
arithmetic traces and a random EAGLE drafter for it (built once per test session by the
``tiny_models`` fixture in ``conftest.py``), and the overrides that run the demo config on them."""
from __future__ import annotations

from pathlib import Path

import torch

from nemo_tlt.demo.sft import SFTConfig, cached_warm_start
from nemo_tlt.demo.tasks import TaskConfig
from nemo_tlt.demo.tokenizer import CharTokenizer
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.io import save_drafter
from nemo_tlt.model.config import LMConfig

TINY_TASK = dict(max_solution_chars=80, max_value=20, tail_exponent=1.1)


def tiny_assets(root: Path) -> tuple[Path, Path]:
    """A 2-layer, hidden-64 policy SFT'd briefly on short arithmetic traces (cached per
    test session; it answers well-formed but often wrong, so rewards vary within a
    group) and a randomly initialised EAGLE drafter for it."""
    task = TaskConfig(name="arith", **TINY_TASK)
    lm = LMConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=256)
    sft = SFTConfig(steps=60, batch_size=16, lr=5e-3, warmup_steps=5, seq_len=128)
    target = cached_warm_start(root, lm, task, sft, num_examples=512, progress=False)
    drafter = root / "drafter"
    if not (drafter / "drafter.json").is_file():
        torch.manual_seed(0)
        save_drafter(EagleDrafter(EagleConfig.from_target(lm)), drafter)
    return target, drafter


def tiny_overrides(target: Path, drafter: Path, run_dir: Path, steps: int = 3, workers: int = 2) -> list[str]:
    task = [f"task.options.{k}={v}" for k, v in TINY_TASK.items()]
    return task + [
        f"run_dir={run_dir}", f"steps={steps}", "progress=false",
        f"model.target_dir={target}", f"model.drafter_dir={drafter}",
        "grpo.prompts_per_step=4", "grpo.group_size=4", "grpo.max_new_tokens=100", "policy.optim.lr=1e-3",
        "task.reward_options.format_bonus=0.1", "grpo.acceptance=coupled",
        "rollout.threshold.threshold_on=4", "rollout.threshold.threshold_off=6",  # with rollout.sd_policy=threshold
        f"workers.num_workers={workers}", "workers.start_method=fork", "workers.timeout_s=120",
        # full priority for idle-time training, so a loaded test machine cannot starve it
        "drafter.nice=0",
        "debug.weight_digests=1",  # replicas_identical / final_policy_identical every step
    ]
