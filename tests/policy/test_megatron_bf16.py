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
from ranks import launch_forked  # noqa: E402
from nemo_tlt.model.config import LMConfig  # noqa: E402
from nemo_tlt.model.lm import DecoderLM  # noqa: E402
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig, build_policy_backend  # noqa: E402

CFG = LMConfig(family="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2)
OPTIM = PolicyOptimConfig(lr=1e-3, grad_clip=0.0)


@pytest.mark.timeout(180)
def test_megatron_bf16_step_keeps_fp32_masters_and_tracks_the_torch_backend():
    g = torch.Generator().manual_seed(4)
    canonical = DecoderLM(CFG).init_weights_(g).state_dict()
    batch = [(torch.randint(3, 100, (4,), generator=g).tolist(), torch.randint(3, 100, (int(n),), generator=g).tolist())
             for n in torch.randint(2, 9, (5,), generator=g)]
    adv = torch.randn(5, generator=g)
    policy = PolicyConfig(backend="megatron", tensor_parallel=2, micro_batch=4, optim=OPTIM)
    got = launch_forked(bf16_update, 2, CFG, canonical, policy, batch, adv, timeout_s=120)[0]
    for rank in got["ranks"]:
        assert rank["optimizers"] == ["DistributedOptimizer"]
        assert rank["param_dtypes"] == ["torch.bfloat16"] and rank["master_dtypes"] == ["torch.float32"]
        assert rank["state_dtypes"] == ["torch.float32"] and rank["params_are_rounded_masters"]
        # rollout.training_state=offload after the step: bf16 weights, fp32 main params, Adam state and
        # gradient buffers released, then back bit for bit (gradients zeroed)
        assert rank["offload"] == {"kept": [], "same": True, "grads_zero": True}
    ref = build_policy_backend(PolicyConfig(micro_batch=4, optim=OPTIM), canonical, CFG, temperature=1.0, seed=0,
                               placement=Placement.cpu(torch.bfloat16))
    want = ref.update(batch, adv, None, None, sum(len(r) for _, r in batch))
    # bf16 forwards of two implementations differ by rounding: a few per cent on the norm
    assert got["stats"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.03)
    assert got["stats"]["loss"] == pytest.approx(want["loss"], rel=0.03, abs=1e-3)
    # the step itself, on the fp32 masters of both (each starts from the bf16-rounded weights): AdamW's first
    # step is about lr x sign(gradient) per weight, so rounding noise in the gradients flips few of them
    # (measured: least-squares scale and cosine >= 0.97 per tensor, 0.995 over the model), while a flipped
    # gradient sign gives a scale of -1 and a doubled learning rate one of 2
    start = {k: v.to(torch.bfloat16).float() for k, v in canonical.items()}
    names = [k for k, p in ref.model.named_parameters() if p.requires_grad]
    want_step = {k: m.detach() - start[k] for k, m in zip(names, ref.master.masters, strict=True)}
    got_step = {k: m - start[k] for k, m in got["masters"].items()}
    assert set(got_step) == set(want_step)
    for name in want_step:
        got_flat, want_flat = got_step[name].reshape(-1), want_step[name].reshape(-1)
        assert _scale(got_flat, want_flat) == pytest.approx(1.0, abs=0.1), name
        assert torch.nn.functional.cosine_similarity(got_flat, want_flat, dim=0) > 0.9, name
    flat_got, flat_want = (torch.cat([d[k].reshape(-1) for k in sorted(want_step)]) for d in (got_step, want_step))
    assert _scale(flat_got, flat_want) == pytest.approx(1.0, abs=0.02)
    assert torch.nn.functional.cosine_similarity(flat_got, flat_want, dim=0) > 0.98
    # the bf16 weights are the masters' rounding (rank by rank above; here the gathered whole)
    assert all(torch.equal(got["weights"][k], m.to(got["weights"][k].dtype)) for k, m in got["masters"].items())


def _scale(got: torch.Tensor, want: torch.Tensor) -> float:
    """The least-squares factor a in ``got ~ a * want``."""
    return float((got * want).sum() / (want * want).sum())
