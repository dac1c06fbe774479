"""The megatron backend (megatron-core DDP + DistributedOptimizer, gloo, CPU) against the torch
backend on the same batch, at layouts and settings the single-axis cases of
test_megatron_backend.py do not reach: TP2 x PP2 x DP2 at once (8 ranks), and at TP2
``policy.recompute=full`` and ``policy.recompute=selective`` (megatron's activation checkpoint
runs on CPU through megatron_patches.cpu_shims' RNG-state shim).

``policy.sequence_parallel=true`` does not run on CPU: megatron-core's local layer spec builds
its RMSNorm as ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel`` (apex, the
fused alternative, is not installable here); Transformer Engine's spec, the one that supports
it, needs a GPU. The backend refuses it before any collective there (tested below).

Compared with ``TorchPolicy`` on the whole batch (fp32): every rank's log-probs within 2e-5;
the loss (DP: the replicas' shares summed) and the pre-clip global grad norm within 1e-5
relative; every updated weight within 1e-5 absolute (lr 1e-3, so 1% of an AdamW first step;
see ``assert_same_step`` for the few ill-conditioned weights). Clipping is active, so the norm
had to be the global one. The settings must reach megatron-core's ``TransformerConfig`` (checked
on every rank): equal numbers alone cannot tell recompute on from off.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).parent))

from megatron_backend_workers import session  # noqa: E402
from test_megatron_backend import LLAMA, OPTIM, QWEN_TIED, _case, _policy, _reference, assert_same_step  # noqa: E402

from ranks import launch_forked  # noqa: E402
from nemo_tlt.policy.megatron_backend import MegatronPolicy  # noqa: E402

# Qwen2 with tied embeddings: the embedding's gradient is summed over the first and last stage
# as well as over TP (vocab-parallel) and DP; 5 sequences split 3 / 2 over the two replicas
CASE_3D = _case("tp2_pp2_dp2", QWEN_TIED, _policy(tp=2, pp=2), 5, shards=((0, 2, 4), (1, 3)))
CASES_TP2 = [
    _case("tp2_recompute_full", LLAMA, replace(_policy(tp=2), recompute="full"), 7),
    _case("tp2_recompute_selective", LLAMA, replace(_policy(tp=2), recompute="selective"), 8),
]
CASES = [CASE_3D] + CASES_TP2
MCORE_RECOMPUTE = {"none": None, "full": "full", "selective": "selective"}


@pytest.fixture(scope="module")
def results():
    out = launch_forked(session, 8, [CASE_3D], timeout_s=120)[0]
    out.update(launch_forked(session, 2, CASES_TP2, timeout_s=120)[0])
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_loss_grad_norm_and_updated_weights_match_the_torch_backend(results, case):
    want = _reference(case)
    ranks = results[case.name]["ranks"]
    dp = len(case.shards) or 1
    assert len(ranks) == dp * case.policy.model_parallel
    for rank in ranks:
        assert rank["mcore"] == {"sequence_parallel": case.policy.sequence_parallel,
                                 "recompute_granularity": MCORE_RECOMPUTE[case.policy.recompute]}, rank["coords"]
        for j, i in enumerate(rank["ids"]):
            torch.testing.assert_close(rank["old"][j], want["old"][i], rtol=0, atol=2e-5)
        # the norm after the DP reduce, before clipping: the whole batch's, on every rank
        assert rank["stats"]["grad_norm"] == pytest.approx(want["stats"]["grad_norm"], rel=1e-5), rank["coords"]
    assert want["stats"]["grad_norm"] > OPTIM.grad_clip
    # one rank per replica reports its replica's share of the global token-mean loss
    shares = {rank["dp"]: rank["stats"] for rank in ranks}
    assert sorted(shares) == list(range(dp))
    for key in ("loss", "pg_loss", "kl"):
        got = sum(s[key] for s in shares.values())
        assert got == pytest.approx(want["stats"][key], rel=1e-5, abs=1e-7), key
    updated = want["weights"]
    assert sorted(results[case.name]["canonical"]) == sorted(updated)
    moved = max(float((updated[k] - case.canonical[k]).abs().max()) for k in updated)
    assert moved > 50 * 1e-5  # the step is large against the tolerance: a wrong update shows
    assert_same_step(results[case.name]["canonical"], updated, want["grads"], case.policy.optim.lr, tol=1e-5)


def test_sequence_parallel_on_the_local_spec_is_refused_before_any_collective():
    """No process group exists here: a collective would hang, the refusal comes first."""
    with pytest.raises(ValueError, match=r"policy\.sequence_parallel=true needs Transformer Engine.*cpu rank"):
        MegatronPolicy({}, LLAMA, replace(_policy(tp=2), sequence_parallel=True), temperature=1.0, seed=0)
