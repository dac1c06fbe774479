"""Learning-rate schedule shared by every trainer (SFT, offline drafter, spot drafter)."""
from __future__ import annotations

import math


def warmup_cosine_lr(step: int, peak: float, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Linear warmup over `warmup_steps` (step 0 already gets peak / warmup_steps), then
    cosine decay from `peak` to `peak * min_ratio` over `decay_steps`, flat afterwards."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(decay_steps, 1), 1.0)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))
