"""CPU shims: applied only inside the context, cuda creations land on CPU, refused where CUDA exists."""
from __future__ import annotations

import pytest
import torch

from megatron_patches.cpu_shims import apply_cpu_shims, cpu_shims

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="applies the shims in this process, which can see a GPU: they refuse there")


@needs_no_cuda
def test_shims_redirect_and_restore():
    original_sync = torch.cuda.synchronize
    with cpu_shims():
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()  # a no-op instead of "no CUDA" error
        assert torch.zeros(3, device="cuda").device.type == "cpu"
        assert torch.empty(2, 2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.cuda.synchronize is original_sync
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        torch.zeros(1, device="cuda")


@needs_no_cuda
def test_explicit_apply_and_remove_is_idempotent():
    shims = apply_cpu_shims()
    shims.remove()
    shims.remove()
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        torch.zeros(1, device="cuda")


def test_refused_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # The refusal says how to go on: hide the GPU from the process, or run without the shims.
    with pytest.raises(RuntimeError, match="must not be applied where CUDA is available(.|\n)*"
                                           "CUDA_VISIBLE_DEVICES=(.|\n)*without the shims"):
        apply_cpu_shims()


@needs_no_cuda
def test_megatron_activation_checkpoint_rng_state_is_the_cpu_generators_inside_the_shims():
    """megatron's tensor_parallel.checkpoint (activation recompute) saves and restores the CUDA RNG
    state: inside the shims that is the CPU generator's state and a no-op; outside, megatron's own."""
    rng = pytest.importorskip("megatron.core.tensor_parallel.random")
    original_get, original_set = rng._get_cuda_rng_state, rng._set_cuda_rng_state
    with cpu_shims():
        torch.manual_seed(3)
        state = rng._get_cuda_rng_state(graph_safe=False)
        assert torch.equal(state, torch.get_rng_state())
        rng._set_cuda_rng_state(state)  # megatron's own would queue a CUDA call
    assert rng._get_cuda_rng_state is original_get and rng._set_cuda_rng_state is original_set
