"""Worker function for the torch backend's data-parallel test (tests/policy/test_torch_backend.py),
run inside gloo processes (launch_local): one TorchPolicy replica per rank on its shard of the
batch; the backend sums the gradients over the ranks itself."""
from __future__ import annotations

import torch

from nemo_tlt.dist import RankContext
from nemo_tlt.model.config import LMConfig
from nemo_tlt.policy.config import PolicyConfig
from nemo_tlt.policy.torch_backend import TorchPolicy, build_decoder


def update_with_grads(policy: TorchPolicy, batch: list, advantages: torch.Tensor, global_tokens: int) -> dict:
    """One `update`; returns its stats, the (reduced, clipped) gradients and the updated weights."""
    old, ref = policy.logprobs(batch)
    stats = policy.update(batch, advantages, old, ref, global_tokens)
    return {"stats": stats, "grads": {name: p.grad.clone() for name, p in policy.model.named_parameters()},
            "weights": {k: v.detach().clone() for k, v in policy.model.state_dict().items()}}


def data_parallel_update(ctx: RankContext, cfg: LMConfig, weights: dict, policy: PolicyConfig,
                         batch: list, advantages: torch.Tensor, shards: tuple[tuple[int, ...], ...]) -> dict:
    mine = list(shards[ctx.rank])
    global_tokens = sum(len(r) for _, r in batch)
    backend = TorchPolicy(build_decoder(weights, cfg), policy, temperature=1.0)
    return update_with_grads(backend, [batch[i] for i in mine], advantages[mine], global_tokens)
