"""The megatron backend in bf16 (``model.dtype=bfloat16``) at TP=2: bf16 parameters, megatron's
DistributedOptimizer with fp32 main params and AdamW state, and a step that tracks the torch backend's bf16 step."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).parent))
from megatron_backend_workers import bf16_update  # noqa: E402

from nemo_tlt.device import Placement
from nemo_tlt.dist import launch_local  # noqa: E402
from nemo_tlt.model.config import LMConfig  # noqa: E402
from nemo_tlt.model.lm import DecoderLM  # noqa: E402
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig, build_policy_backend  # noqa: E402

CFG = LMConfig(family="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2)
OPTIM = PolicyOptimConfig(lr=1e-3, grad_clip=0.0)


@pytest.mark.timeout(300)
def test_megatron_bf16_step_keeps_fp32_masters_and_tracks_the_torch_backend():
    g = torch.Generator().manual_seed(4)
    canonical = DecoderLM(CFG).init_weights_(g).state_dict()
    batch = [(torch.randint(3, 100, (4,), generator=g).tolist(), torch.randint(3, 100, (int(n),), generator=g).tolist())
             for n in torch.randint(2, 9, (5,), generator=g)]
    adv = torch.randn(5, generator=g)
    policy = PolicyConfig(backend="megatron", tensor_parallel=2, micro_batch=4, optim=OPTIM)
    got = launch_local(bf16_update, 2, CFG, canonical, policy, batch, adv, timeout_s=240)[0]
    for rank in got["ranks"]:
        assert rank["optimizers"] == ["DistributedOptimizer"]
        assert rank["param_dtypes"] == ["torch.bfloat16"] and rank["master_dtypes"] == ["torch.float32"]
        assert rank["state_dtypes"] == ["torch.float32"] and rank["params_are_rounded_masters"]
    ref = build_policy_backend(PolicyConfig(micro_batch=4, optim=OPTIM), canonical, CFG, temperature=1.0, seed=0,
                               placement=Placement.cpu(torch.bfloat16))
    want = ref.update(batch, adv, None, None, sum(len(r) for _, r in batch))
    # bf16 forwards of two implementations differ by rounding: a few per cent on the norm
    assert got["stats"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.03)
    assert got["stats"]["loss"] == pytest.approx(want["loss"], rel=0.03, abs=1e-3)
    mine = {k: v.float() for k, v in ref.canonical_weights()}
    start = {k: v.to(torch.bfloat16).float() for k, v in canonical.items()}
    moved = agree = 0
    for name, value in got["weights"].items():
        step_got, step_want = value.float() - start[name], mine[name] - start[name]
        moved += int((step_want != 0).sum())
        agree += int(((step_got != 0) == (step_want != 0)).sum())
    assert moved > 0 and agree >= 0.9 * sum(v.numel() for v in start.values())
