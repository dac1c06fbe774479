"""The trainable policy behind one contract (layer "policy": above weights, below config and rl).

config            -- ``PolicyConfig`` / ``PolicyOptimConfig`` (the ``policy:`` block)
protocol          -- ``PolicyBackend``: log-probs, update, weights out, checkpoint state
torch_backend     -- ``TorchPolicy``: a ``DecoderLM`` replica per rank (default, the oracle)
megatron_backend  -- ``MegatronPolicy``: a megatron-core TP x PP ``GPTModel`` (optional)
factory           -- ``build_policy_backend``
batching, loss    -- micro-batching and the pure PG / KL loss math both backends share

Imports nothing of nemo_tlt.rl, nemo_tlt.config or above.
"""
from nemo_tlt.policy.config import PolicyConfig, PolicyOptimConfig
from nemo_tlt.policy.factory import build_policy_backend
from nemo_tlt.policy.protocol import PolicyBackend

__all__ = ["PolicyBackend", "PolicyConfig", "PolicyOptimConfig", "build_policy_backend"]
