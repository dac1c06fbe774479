"""Adaptive speculative decoding: the BEG-MAB bandit over tree shapes and the SD on/off policy."""
from nemo_tlt.adaptive.bandit import BanditConfig, BegMab, BucketStats
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, FixedSDPolicy, SDPolicyConfig, SpecPolicy

__all__ = [
    "AdaptiveSDPolicy",
    "BanditConfig",
    "BegMab",
    "BucketStats",
    "FixedSDPolicy",
    "SDPolicyConfig",
    "SpecPolicy",
]
