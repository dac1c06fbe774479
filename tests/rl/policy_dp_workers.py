"""Worker function for the torch backend's data-parallel test (tests/rl/test_policy_trainer.py),
run inside gloo processes (run_gloo): one PolicyTrainer replica per rank on its shard of the
batch, gradients summed by the RL loop's own collective (`Comm.allreduce_grads`)."""
from __future__ import annotations

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.rl.policy import PolicyConfig, PolicyTrainer
from nemo_tlt.rl.workers import Comm


def update_with_grads(trainer: PolicyTrainer, batch: list, advantages: torch.Tensor, global_tokens: int,
                      reduce_grads=None) -> dict:
    """One `update` that also returns the gradients as clipping sees them (after the reduce)."""
    old, ref = trainer.logprobs(batch)
    seen: dict[str, torch.Tensor] = {}

    def reduce_and_keep(grads: list[torch.Tensor]) -> None:
        if reduce_grads is not None:
            reduce_grads(grads)
        seen.update({name: p.grad.clone() for name, p in trainer.model.named_parameters()})

    stats = trainer.update(batch, advantages, old, ref, global_tokens, reduce_and_keep)
    return {"stats": stats, "grads": seen,
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}}


def data_parallel_update(rank: int, world: int, cfg: LMConfig, weights: dict, policy: PolicyConfig,
                         batch: list, advantages: torch.Tensor, shards: tuple[tuple[int, ...], ...]) -> dict:
    model = DecoderLM(cfg)
    model.load_state_dict(weights)
    mine = list(shards[rank])
    global_tokens = sum(len(r) for _, r in batch)
    comm = Comm(rank, world, store=None)  # only the gradient all-reduce is used: no store needed
    return update_with_grads(PolicyTrainer(model, policy), [batch[i] for i in mine], advantages[mine],
                             global_tokens, comm.allreduce_grads)
