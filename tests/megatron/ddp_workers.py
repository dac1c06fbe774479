"""Gloo worker for tests/megatron/test_ddp_distributed_optimizer.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_tlt.dist import RankContext


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    from nemo_tlt.megatron.pipeline_forward import causal_attention_mask

    B, T = ids.shape
    logits = model(ids, torch.arange(T).unsqueeze(0).expand(B, T), causal_attention_mask(T, B)).float()
    return (logits.logsumexp(-1) - logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)).mean()


def ddp_distopt_step(ctx: RankContext, cfg, batch: torch.Tensor, lr: float, clip: float) -> dict | None:
    """One step of megatron-core DDP + DistributedOptimizer over DP=world (each rank half the batch),
    and the plain reference on rank 0: full-batch loss, torch AdamW, the same clip rule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_patches.cpu_shims import cpu_shims
    from nemo_tlt.megatron.gpt_builder import build_gpt_model
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.weights.layout import ParallelLayout

    with cpu_shims():
        init_model_parallel(1, 1)
        torch.manual_seed(0)  # megatron's CPU initialisation draws from the global RNG: same weights on every replica
        model = build_gpt_model(cfg, ParallelLayout(1, 1))
        start = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        reference = build_gpt_model(cfg, ParallelLayout(1, 1))
        reference.load_state_dict(start, strict=False)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, adam_beta1=0.9,
                                                     adam_beta2=0.999, adam_eps=1e-8, clip_grad=clip,
                                                     use_distributed_optimizer=True), [ddp])
        ddp.zero_grad_buffer()
        opt.zero_grad()
        mine = batch.chunk(ctx.world)[ctx.rank]
        _loss(ddp, mine).backward()
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
        got = {k: v.detach().clone() for k, v in model.state_dict().items() if k in start}
        out = None
        if ctx.rank == 0:
            params = [p for p in reference.parameters() if p.requires_grad]
            adam = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
            _loss(reference, batch).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(params, clip)
            adam.step()
            want = {k: v.detach().clone() for k, v in reference.state_dict().items() if k in start}
            out = {"ok": ok, "norm": float(norm), "ref_norm": float(ref_norm), "got": got, "want": want,
                   "start": start, "optimizer": type(opt).__name__}
        dist.barrier()
    return out
