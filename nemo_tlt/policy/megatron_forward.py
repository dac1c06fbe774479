"""The megatron policy's forward pieces: megatron's own schedule over one micro-batch,
token log-probs from vocab-parallel logits, and the GRPO loss of a micro-batch on the last
stage. Functions of their arguments (the policy's
state passed in); megatron-core is imported inside them."""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.policy.batching import MicroBatch, Sequence2, counted_mask, padded
from nemo_tlt.algorithms.loss import policy_and_kl_loss
from nemo_tlt.algorithms.protocol import RLAlgorithm
from nemo_tlt.policy.protocol import HiddenSink, LogprobSink
from nemo_tlt.weights.layout import ParallelLayout


def vocab_parallel_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, vocab_size: int
                            ) -> torch.Tensor:
    """log softmax(logits / T) at the next tokens, from vocab-parallel logits ``[B, T, V/tp]``."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if input_ids.shape[1] == 1:  # a lone token has no target; keep the graph for backward
        return logits.sum(-1) * 0.0
    # one fp32 copy of the logits, scaled in place (its cast's backward keeps nothing): a second
    # fp32 copy would be the update's largest transient
    scaled = logits[:, :-1].float().contiguous()
    if scaled.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr():
        scaled = scaled.clone()  # fp32 logits of one row: no copy yet, and the model's output is not ours
    if temperature != 1.0:
        scaled.div_(temperature)
    part = scaled.shape[-1]
    valid = vocab_size - parallel_state.get_tensor_model_parallel_rank() * part
    if valid < part:
        # Megatron pads the vocabulary with zero rows; their logit 0 would join the partition
        # function, so they get probability exactly 0 (and no gradient) instead.
        # in place: an out-of-place fill would hold a second fp32 copy beside the first
        pad = torch.arange(part, device=scaled.device) >= max(valid, 0)
        scaled.masked_fill_(pad, float("-inf"))
    # The megatron op subtracts the max in place: it gets a tensor nobody else reads.
    return -vocab_parallel_cross_entropy(scaled, input_ids[:, 1:].contiguous())


def run_schedule(model: torch.nn.Module, mb: MicroBatch, loss_fn: Callable, forward_only: bool,
                 batch: Sequence[Sequence2], on_hidden: HiddenSink | None, capture_layers: tuple[int, ...] | None,
                 *, device: torch.device, layout: ParallelLayout, sequence_parallel: bool,
                 model_config: LMConfig, last_stage: bool) -> list:
    """Megatron's own schedule (pipelined for PP > 1) over one micro-batch; hands the final
    hidden states of this forward (or the EAGLE-3 features, with ``capture_layers``) to
    ``on_hidden`` on every rank.

    One schedule call per micro-batch because micro-batches have different lengths
    and the pipeline's point-to-point buffers are shaped per call.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nemo_tlt.megatron.forward_features import ForwardFeatures
    from nemo_tlt.megatron.pipeline_forward import causal_attention_mask

    ids = mb.input_ids.to(device)
    B, T = ids.shape
    # sequence parallelism splits the sequence over TP: pad it (on the right, so causal
    # attention keeps every real token's view) to a multiple of TP, cut the logits back
    padded_T = -(-T // layout.tp) * layout.tp if sequence_parallel else T
    ids = torch.nn.functional.pad(ids, (0, padded_T - T))
    positions = torch.arange(padded_T, device=device).unsqueeze(0).expand(B, padded_T)
    mask = causal_attention_mask(padded_T, B, device)
    capture = (ForwardFeatures(getattr(model, "module", model), layout, model_config.num_layers,
                               capture_layers) if on_hidden is not None else None)
    last = last_stage

    def forward_step(data_iterator: Iterator, step_model: torch.nn.Module):
        out = step_model(next(data_iterator), positions, mask)
        return (out[:, :T] if last and padded_T != T else out), loss_fn

    try:
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[model], num_microbatches=1,
            seq_length=padded_T, micro_batch_size=B, forward_only=forward_only, collect_non_loss_data=forward_only)
    finally:
        if capture is not None:
            capture.close()
    if capture is not None:
        hidden = capture.features((B, padded_T, model_config.hidden_size), device)[:, :T].cpu()
        for row, i in enumerate(mb.index.tolist()):
            length = len(batch[i][0]) + len(batch[i][1])
            on_hidden(i, mb.input_ids[row, :length], hidden[row, :length])
    return out


def policy_loss_fn(mb: MicroBatch, advantages: torch.Tensor, logp_old: list[torch.Tensor] | None,
                   logp_ref: list[torch.Tensor] | None, global_tokens: int, totals: torch.Tensor,
                   on_logprobs: LogprobSink | None, *, device: torch.device,
                   token_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], algorithm: RLAlgorithm,
                   clip_eps: float, kl_coef: float, counted: torch.Tensor | None = None) -> Callable:
    """The last stage's loss for one micro-batch (``algorithm.policy_loss`` over the counted
    sequences, + KL); accumulates the step stats into ``totals`` and hands ``on_logprobs``
    each sequence's response log-probs."""
    idx = mb.index.tolist()
    all_tokens = mb.mask.to(device)
    mask = counted_mask(mb, counted).to(device)
    ids = mb.input_ids.to(device)
    old = None if logp_old is None else padded([logp_old[i].to(all_tokens) for i in idx], all_tokens)
    ref = padded([logp_ref[i].to(all_tokens) for i in idx], all_tokens) if logp_ref is not None else None
    adv = advantages[mb.index].to(mask)
    share = float(mask.sum()) / global_tokens

    def loss_fn(output: torch.Tensor, non_loss_data: bool = False):
        new = token_logprobs(output, ids)
        if on_logprobs is not None:
            detached = new.detach()
            for row, i in enumerate(idx):
                on_logprobs(i, detached[row][all_tokens[row].bool()])
        loss, pg, kl, stats = policy_and_kl_loss(algorithm, new, new.detach() if old is None else old, adv, mask,
                                                 clip_eps, ref, kl_coef)
        parts = (loss.detach(), pg.detach(), kl.detach() if kl is not None else 0.0,
                 stats["clip_frac"], stats["approx_kl"])
        totals.add_(torch.tensor([float(v) for v in parts], dtype=torch.float64, device=totals.device) * share)
        # micro-batch token mean -> its share of the global token mean
        return loss * share, {}

    return loss_fn
