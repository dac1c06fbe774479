"""Adaptive speculative decoding: the SD policies (learned: plain or which tree per step,
from step costs shared across batch sizes; threshold: BEG-MAB over tree shapes below a
batch-size threshold)."""
from nemo_tlt.adaptive.bandit import BanditConfig, BegMab, BucketStats
from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, FixedSDPolicy, SDPolicyConfig, SpecPolicy

__all__ = [
    "AdaptiveSDPolicy",
    "BanditConfig",
    "BegMab",
    "BucketStats",
    "FixedSDPolicy",
    "LearnedSDConfig",
    "LearnedSDPolicy",
    "SDPolicyConfig",
    "SpecPolicy",
]
