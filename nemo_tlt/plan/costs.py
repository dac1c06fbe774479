"""Roofline costs of the phases of an RL step on a ``ClusterSpec``.

Contract: pure functions returning seconds. A forward pass of a rollout replica (TP
``r``) costs max(bytes it reads from HBM / achieved HBM bandwidth, its FLOPs / achieved
FLOP/s) on each of its GPUs, plus a fixed per-forward overhead and, for r > 1, two
all-reduces per layer. Decode reads every weight once per step plus the KV cache of
every running row; its FLOPs are 2 x parameters per query token plus attention
(4 x layers x q_width x context per query token). An SD step is the drafter's
``depth`` forward passes (one layer plus the target's LM head, on rows x topk tokens,
each with a smaller fixed overhead)
plus one target verify pass of ``num_verify + 1`` query tokens per row. Training
phases are compute-bound: 2 x P FLOPs per token for log-probs, 6 x P for the update
(8 x P with full recomputation; selective recomputation repeats only the core attention,
whose FLOPs these training costs leave out, so 6 x P), spread over all GPUs, stretched by
the pipeline bubble (1 + (pp - 1) / m for m micro-batches in one schedule; the policy runs one
micro-batch per schedule call, so the plan passes m = 1: pp).
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_tlt.model.config import LMConfig
from nemo_tlt.plan.cluster import ClusterSpec
from nemo_tlt.plan.memory import drafter_parameter_count, kv_bytes_per_token, layer_parameter_count, parameter_count
from nemo_tlt.speculative.tree_shape import TreeShape


@dataclass(frozen=True)
class RolloutCosts:
    cfg: LMConfig
    cluster: ClusterSpec
    tp: int

    def _forward(self, bytes_read: float, flops: float, tokens: int, layers: int, overhead_ms: float) -> float:
        c = self.cluster
        t = max(bytes_read / c.hbm, flops / c.flops) + overhead_ms * 1e-3
        if self.tp > 1:
            payload = 2 * tokens * self.cfg.hidden_size  # bf16 activations of every query token
            per_allreduce = c.allreduce_latency_us * 1e-6 + 2 * payload / c.link_bytes_per_s(self.tp)
            t += 2 * layers * per_allreduce
        return t

    def target_forward(self, rows: int, context_tokens: float, queries_per_row: int = 1) -> float:
        """One target forward: ``rows`` sequences, ``context_tokens`` cached tokens in total."""
        cfg, q = self.cfg, self.cfg.num_heads * self.cfg.head_dim
        tokens = rows * queries_per_row
        bytes_read = 2 * parameter_count(cfg) / self.tp + kv_bytes_per_token(cfg, self.tp) * context_tokens
        flops = (2 * parameter_count(cfg) * tokens + 4 * cfg.num_layers * q * context_tokens * queries_per_row) / self.tp
        return self._forward(bytes_read, flops, tokens, cfg.num_layers, self.cluster.forward_overhead_ms)

    def decode_step(self, rows: int, context_tokens: float) -> float:
        return self.target_forward(rows, context_tokens, 1)

    def sd_step(self, rows: int, context_tokens: float, shape: TreeShape) -> float:
        """Drafter (``depth`` passes on rows x topk tokens, replicated weights, TP-split LM head) + verify."""
        cfg = self.cfg
        head = 2 * cfg.vocab_size * cfg.hidden_size / self.tp
        drafter = 2 * drafter_parameter_count(cfg)
        tokens = rows * shape.topk
        flops = 2 * (drafter_parameter_count(cfg) + cfg.vocab_size * cfg.hidden_size / self.tp) * tokens
        draft = shape.depth * self._forward(drafter + head, flops, tokens, 1, self.cluster.draft_overhead_ms)
        return draft + self.target_forward(rows, context_tokens, shape.num_verify + 1)

    def prefill(self, rows: int, prompt_tokens: int) -> float:
        cfg = self.cfg
        tokens = rows * prompt_tokens
        flops = (2 * parameter_count(cfg) * tokens + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim
                 * rows * prompt_tokens ** 2) / self.tp
        return self._forward(2 * parameter_count(cfg) / self.tp, flops, tokens, cfg.num_layers,
                             self.cluster.forward_overhead_ms)


def training_seconds(cfg: LMConfig, cluster: ClusterSpec, tokens: int, pp: int, micro_batches: int,
                     full_recompute: bool) -> dict[str, float]:
    """{'logprob_s', 'update_s'} for ``tokens`` tokens (prompts + responses) over the whole cluster."""
    bubble = 1.0 + (pp - 1) / max(1, micro_batches)
    per_flop = bubble / (cluster.world * cluster.flops)
    p = parameter_count(cfg)
    return {"logprob_s": 2 * p * tokens * per_flop, "update_s": (8 if full_recompute else 6) * p * tokens * per_flop}


def layer_bytes(cfg: LMConfig) -> int:
    return 2 * layer_parameter_count(cfg)
