"""Forward-only pass of a (TP x PP) megatron-core GPTModel through Megatron's own schedule.

Contract: ``forward_logits(model, input_ids)`` is called on every rank of the
model-parallel group with the same ``input_ids [B, T]``; it runs megatron's
pipeline schedule with ``forward_only=True`` (one micro-batch per sequence
batch), and returns on the last pipeline stage the full-vocabulary logits
``[B, T, padded_vocab]`` (vocab-parallel shards gathered over TP), ``None``
on the other stages. This is the shape of the policy's log-prob forward pass, so
hooks from ``megatron_patches.hidden_capture`` fire inside it. ``causal_attention_mask``
is the explicit mask megatron's local attention needs (its default one is allocated on cuda).
"""
from __future__ import annotations

import torch



def forward_logits(model, input_ids: torch.Tensor) -> torch.Tensor | None:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = input_ids.shape
    positions = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq)
    mask = causal_attention_mask(seq, batch, input_ids.device)

    def forward_step(data_iterator, step_model):
        tokens = next(data_iterator)
        output = step_model(tokens, positions, mask)

        def collect(output_tensor, non_loss_data: bool = False):
            # Logits are vocab-parallel [B, T, V/tp]; gathering over TP gives every token's full row.
            return gather_from_tensor_model_parallel_region(output_tensor).detach()

        return output, collect

    model.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([input_ids]),
            model=[model],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return outputs[0]


def causal_attention_mask(seq_len: int, batch: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's mask convention: ``True`` means *masked out*; shape ``[b, 1, s, s]``, on ``device``."""
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)
    return mask.view(1, 1, seq_len, seq_len).expand(batch, 1, seq_len, seq_len)
