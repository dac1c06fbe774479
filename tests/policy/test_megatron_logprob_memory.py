"""The megatron policy's log-prob loss holds one fp32 copy of its vocab-parallel logits
(``nemo_tlt.policy.megatron_forward.vocab_parallel_logprobs``): the temperature and the padding
mask are applied in place, as the planner's logits term counts (``nemo_tlt.plan.memory``: 6
bytes per logit beside the bf16 ones, 8 where the vocabulary is padded). Measured with the
tracked memory of ``nemo-tlt bench memory`` on one CPU rank, forward and backward apart."""
from __future__ import annotations

import pytest
import torch

from ranks import launch_forked

B, T, V = 2, 65, 1024
FP32_COPY = B * (T - 1) * V * 4  # one fp32 copy of the logits the loss reads (the last position has no target)


def _peaks(ctx, vocab_size: int, temperature: float) -> dict:
    from nemo_tlt.bench.tracked_memory import PhaseMemory
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.policy.megatron_forward import vocab_parallel_logprobs

    init_model_parallel(1, 1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab_size, (B, T), generator=g)
    memory = PhaseMemory()
    with memory.phase("forward"):
        logprobs = vocab_parallel_logprobs(logits, ids, temperature, vocab_size)
    with memory.phase("backward"):
        logprobs.sum().backward()
    return {k: v["peak_change_bytes"] for k, v in memory.parts.items()}


@pytest.mark.parametrize("vocab_size,temperature", [(V, 1.0), (V, 0.7), (V - 24, 0.7)],
                         ids=["unpadded", "temperature", "padded"])
def test_the_loss_holds_one_fp32_copy_of_the_logits(vocab_size, temperature):
    pytest.importorskip("megatron.core")
    peaks = launch_forked(_peaks, 1, vocab_size, temperature, timeout_s=120)[0]
    # forward: the fp32 copy (kept for backward) and small per-row tensors; a second copy
    # (an out-of-place scale or mask) would double it
    assert FP32_COPY <= peaks["forward"] < 1.25 * FP32_COPY, peaks
    # backward: beside the saved fp32 buffer megatron turns into the gradient in place, at most
    # one new fp32 gradient (the scale's or the mask's backward) and the bf16 cast
    assert peaks["backward"] <= 1.1 * (FP32_COPY + FP32_COPY // 2), peaks
