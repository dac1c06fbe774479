"""The ``rollout:`` block: whether each worker's rollout speculates, and which policy decides.

Contract
--------
* ``sd_enabled: false`` is plain decoding (``build_policy`` returns None: the
  engine's ``generate(policy=None)``); the drafter is then not loaded either.
* ``sd_policy`` names the policy; each has its own nested block, which is that
  policy's own config class (no copies): ``threshold`` (:class:`SDPolicyConfig`:
  SD on below a running-row threshold) with ``bandit`` (:class:`BanditConfig`:
  BEG-MAB's arms, buckets, exploration) choosing the tree; or ``learned``
  (:class:`LearnedSDConfig`: plain decoding or a tree per bucket from measured
  cost). Only the chosen policy's blocks are read.
* Arm strings (``'4_2_8'``) are parsed into ``TreeShape`` when those blocks are
  constructed, once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, SDPolicyConfig, SpecPolicy
from nemo_tlt.speculative.tree_shape import TreeShape

SD_POLICIES = ("threshold", "learned")


@dataclass(frozen=True)
class SpecDecodingConfig:
    sd_enabled: bool = True
    sd_policy: str = "threshold"
    threshold: SDPolicyConfig = field(default_factory=lambda: SDPolicyConfig(threshold_on=8, threshold_off=12))
    bandit: BanditConfig = field(default_factory=BanditConfig)
    learned: LearnedSDConfig = field(default_factory=LearnedSDConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.sd_enabled, bool):
            raise ValueError(f"SpecDecodingConfig.sd_enabled must be a bool, got {self.sd_enabled!r}")
        if self.sd_policy not in SD_POLICIES:
            raise ValueError(f"SpecDecodingConfig.sd_policy must be one of {', '.join(SD_POLICIES)}, "
                             f"got {self.sd_policy!r}")

    @property
    def arms(self) -> tuple[TreeShape, ...]:
        """The tree shapes the chosen policy (``sd_policy``) picks from."""
        return tuple(self.learned.arms if self.sd_policy == "learned" else self.bandit.arms)

    def build_policy(self, rng: np.random.Generator) -> SpecPolicy | None:
        """A fresh policy for one worker (None: plain decoding); ``rng`` drives the
        bandit's exploration (the learned policy draws no random numbers)."""
        if not self.sd_enabled:
            return None
        if self.sd_policy == "learned":
            return LearnedSDPolicy(self.learned)
        return AdaptiveSDPolicy(self.threshold, BegMab(self.bandit, rng))
