"""The served model holds one copy of its weights: after decoding (plain and speculative),
no module keeps a tensor beside its parameters and buffers (an inference-time concatenation of
q/k/v or gate/up would be a second copy of most of each layer: 62% of it)."""
from __future__ import annotations

import torch

from nemo_tlt.adaptive.sd_policy import FixedSDPolicy
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.rollout.protocol import Request
from nemo_tlt.rollout.torch_engine import TorchRolloutEngine
from nemo_tlt.speculative.sampling import SamplingParams
from nemo_tlt.speculative.tree_shape import TreeShape
from tiny import tiny_config, tiny_target


def _held_tensors(obj, seen: set[int], depth: int = 0) -> list[torch.Tensor]:
    """Tensors an object keeps in its attributes (nested objects followed), not counting a
    module's parameters, buffers and submodules (walked on their own)."""
    if depth > 3 or id(obj) in seen:
        return []
    seen.add(id(obj))
    out = []
    for name, value in vars(obj).items():
        if name in ("_parameters", "_buffers", "_modules"):
            continue
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, type)):
                out += _held_tensors(v, seen, depth + 1)
    return out


def test_the_served_model_keeps_no_second_copy_of_its_weights():
    target = tiny_target(family="qwen2")  # q/k/v biases too
    engine = TorchRolloutEngine(target)
    engine.load_drafter(EagleDrafter(EagleConfig.from_target(tiny_config(family="qwen2"))))
    reqs = [Request([3, 4, 5]), Request([6, 7])]
    engine.generate(reqs, SamplingParams(max_new_tokens=8))
    engine.generate(reqs, SamplingParams(max_new_tokens=8), policy=FixedSDPolicy(TreeShape(3, 2, 4)))
    seen: set[int] = set()
    extra = [(type(m).__name__, tuple(t.shape)) for m in target.modules() for t in _held_tensors(m, seen)]
    assert extra == []

