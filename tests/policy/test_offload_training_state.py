"""``rollout.training_state=offload`` in the torch backend (``OffloadsTrainingState``): between
``offload_training_state`` and ``reload_training_state`` the weights, fp32 masters, gradients,
AdamW state and KL reference hold no device memory (their storages are released in place; on
the CPU the move is to a distinct host copy), and after the reload the next update, both the
synchronous one and the pipelined one, is bit for bit the update of a policy that never moved.
The megatron backend's case runs in ``test_megatron_backend.py``'s launches."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.model.offload import HostOffload
from nemo_tlt.policy import PolicyConfig, PolicyOptimConfig
from nemo_tlt.policy.protocol import OffloadsTrainingState
from nemo_tlt.policy.torch_backend import TorchPolicy
from tiny import tiny_config


def _batch(seed: int) -> tuple[list, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch = [(torch.randint(3, 32, (int(p),), generator=g).tolist(), torch.randint(3, 32, (int(r),), generator=g).tolist())
             for p, r in zip(torch.randint(2, 6, (6,), generator=g), torch.randint(1, 12, (6,), generator=g))]
    return batch, torch.randn(6, generator=g)


def _policy(dtype: torch.dtype) -> TorchPolicy:
    model = DecoderLM(tiny_config()).init_weights_(torch.Generator().manual_seed(0)).to(dtype)
    return TorchPolicy(model, PolicyConfig(micro_batch=4, kl_coef=0.05, optim=PolicyOptimConfig(lr=1e-3)),
                       temperature=0.8)


def _state(p: TorchPolicy) -> dict[str, list[torch.Tensor]]:
    """Every tensor of the training state, by kind (the gradients as the update leaves them)."""
    return {"weights": list(p.model.parameters()), "masters": list(p.master.masters),
            "optimizer": [v for s in p.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
            "reference": list(p.reference.parameters()),
            "grads": [t.grad for t in (*p.params, *p.master.masters) if t.grad is not None]}


def _step(p: TorchPolicy, batch: list, adv: torch.Tensor, pipelined: bool) -> dict[str, float]:
    tokens = sum(len(r) for _, r in batch)
    old, ref = p.logprobs(batch)
    if not pipelined:
        return p.update(batch, adv, old, ref, tokens)
    p.begin_accumulation(tokens)
    p.accumulate(batch, adv, old, ref)
    return p.apply_accumulated(tokens)


def _assert_same(a: TorchPolicy, b: TorchPolicy) -> None:
    for kind, (ta, tb) in {k: (v, _state(b)[k]) for k, v in _state(a).items() if k != "grads"}.items():
        assert len(ta) == len(tb) and ta, kind
        for x, y in zip(ta, tb):
            assert torch.equal(x, y), kind  # bit for bit
    assert a.state_dict()["step"] == b.state_dict()["step"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16_masters"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_offload_releases_the_training_state_and_the_next_update_is_bit_identical(dtype, pipelined):
    batch, adv = _batch(1)
    moved, stayed = _policy(dtype), _policy(dtype)
    assert isinstance(moved, OffloadsTrainingState)
    for p in (moved, stayed):  # the optimizer holds state and the gradients are set
        _step(p, batch, adv, pipelined)
    resident = sum(t.untyped_storage().nbytes() for ts in _state(moved).values() for t in ts)
    moved.offload_training_state()
    state = _state(moved)
    assert all(state[k] for k in ("weights", "optimizer", "reference", "grads"))
    for kind, tensors in state.items():
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors), kind
    assert moved.model.rope_cos.untyped_storage().nbytes() > 0  # buffers stay
    with pytest.raises(RuntimeError, match="already offloaded"):
        moved.offload_training_state()
    moved.reload_training_state()
    assert sum(t.untyped_storage().nbytes() for ts in _state(moved).values() for t in ts) == resident
    _assert_same(moved, stayed)
    batch2, adv2 = _batch(2)
    got, want = _step(moved, batch2, adv2, pipelined), _step(stayed, batch2, adv2, pipelined)
    assert got == want
    _assert_same(moved, stayed)
    moved.reload_training_state()  # a resident state: nothing to do
    _assert_same(moved, stayed)


def test_host_offload_moves_each_storage_once_drops_gradients_and_skips_what_it_is_told():
    weight, other, grad = torch.randn(6), torch.randn(3), torch.randn(4)
    view, values = weight[2:4], weight.clone()
    host = HostOffload("cpu")
    # (plain numbers only in the asserts: printing a tensor whose storage is released reads freed memory)
    copied = host.offload([weight, view, other, None], drop=[grad, weight], skip=[other])
    sizes = [t.untyped_storage().nbytes() for t in (weight, view, grad, other)]
    assert (copied, sizes, host.offloaded) == (24, [0, 0, 0, 12], True)
    host.reload()
    assert torch.equal(weight, values) and torch.equal(view, values[2:4]) and not host.offloaded
    assert torch.equal(grad, torch.zeros(4))
    pinned = torch.randn(3)
    pinned.numpy()  # numpy shares the storage: it can no longer be resized
    with pytest.raises(RuntimeError, match="1 storage.*not resizable"):
        host.offload([weight, pinned])
    assert weight.untyped_storage().nbytes() == 24 and not host.offloaded  # refused before anything moved
