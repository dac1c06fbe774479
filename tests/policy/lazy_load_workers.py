"""Worker for tests/policy/test_megatron_lazy_load.py, run inside gloo processes (launch_local)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_tlt.dist import RankContext
from nemo_tlt.model.hf_io import load_hf_folder
from nemo_tlt.policy import PolicyConfig, build_policy_backend
from nemo_tlt.weights.hf_source import SafetensorsFolder
from nemo_tlt.weights.megatron_layout import canonical_to_megatron


def build_from_folder(ctx: RankContext, folder: str, policy: PolicyConfig, dtype: torch.dtype) -> dict | None:
    """Build the megatron policy from the lazily read folder; every rank reports its weights, the
    reference's, today's shard (``canonical_to_megatron`` of the whole fp32 canonical) and bytes read."""
    from megatron.core import parallel_state

    from nemo_tlt.device import Placement
    from nemo_tlt.megatron.gpt_builder import build_gpt_model
    from nemo_tlt.megatron.live import local_shard

    source = SafetensorsFolder(folder)
    canonical = load_hf_folder(folder)
    trainer = build_policy_backend(policy, source, canonical.config, temperature=1.0, seed=1234,
                                   placement=Placement(dtype=dtype))
    want = canonical_to_megatron(canonical.state_dict(), canonical.config, trainer.layout)[trainer.coords]
    with trainer._device_context():
        attributes = {flag: _param_attributes(build_gpt_model(canonical.config, trainer.layout, dtype=dtype,
                                                              initialize=flag)) for flag in (True, False)}
    mine = {"coords": trainer.coords, "bytes_read": source.bytes_read, "attributes": attributes,
            "model": {k: v.clone() for k, v in local_shard(trainer.model).items()},
            "reference": {k: v.clone() for k, v in local_shard(trainer.reference).items()},
            "want": {k: v.to(dtype) for k, v in want.items()}}
    box = [None] * ctx.world if ctx.rank == 0 else None
    dist.gather_object(mine, box, dst=0)
    parallel_state.destroy_model_parallel()
    return box


def _param_attributes(model: torch.nn.Module) -> dict:
    """The plain attributes megatron hangs on each parameter (tensor_model_parallel, partition_dim, ...)."""
    return {name: {k: v for k, v in vars(p).items() if isinstance(v, (bool, int, float, str, type(None)))}
            for name, p in model.named_parameters()}
