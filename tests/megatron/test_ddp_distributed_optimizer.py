"""megatron-core's own DistributedDataParallel + DistributedOptimizer run on CPU with gloo
(through megatron_patches.cpu_shims): one step at DP=2 (each rank half the batch) equals a
plain full-batch step with torch AdamW and the same clip rule: grad norm within 1e-5
relative, every updated weight within 5e-6 absolute (fp32, lr 1e-3: 0.5% of the largest
step AdamW takes; DP=1 agrees to 1e-8, DP=2 differs by the order of the gradient sums). This is the ground the megatron policy
backend's switch to megatron's data parallelism stands on; the backend does not use it yet.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).parent))

from ddp_workers import ddp_distopt_step  # noqa: E402

from ranks import launch_forked  # noqa: E402
from nemo_tlt.model.config import LMConfig  # noqa: E402

CFG = LMConfig(family="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2)


@pytest.mark.timeout(180)
def test_megatron_ddp_and_distributed_optimizer_step_equals_plain_adamw():
    batch = torch.randint(0, CFG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    res = launch_forked(ddp_distopt_step, 2, CFG, batch, 1e-3, 0.5, timeout_s=120)[0]
    assert res["ok"] and res["optimizer"] in ("DistributedOptimizer", "ChainedOptimizer")
    assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
    assert res["ref_norm"] > 0.5  # the clip is active
    for name, want in res["want"].items():
        torch.testing.assert_close(res["got"][name], want, rtol=0, atol=5e-6, msg=name)
        assert not torch.equal(want, res["start"][name]) or "norm" in name, name
