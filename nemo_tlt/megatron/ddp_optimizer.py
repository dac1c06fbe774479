"""megatron-core's own data parallelism for a policy ``GPTModel``: DDP + the distributed optimizer.

Contract (collective over megatron's parallel groups, called alike on every rank):
* ``build_ddp_optimizer(model, optim, dtype)`` wraps this rank's ``GPTModel`` in
  megatron-core ``DistributedDataParallel`` (contiguous fp32 grad buffers:
  ``grad_reduce_in_fp32``; gradients reduce-scattered over the data-parallel group) and
  builds megatron's ``DistributedOptimizer`` through ``get_megatron_optimizer``: Adam with
  decoupled weight decay (torch ``AdamW`` where neither Transformer Engine nor apex is
  installed, their fused Adam otherwise), fp32 main params (for bf16 weights; fp32 weights
  are their own main params), fp32 Adam moments, each data-parallel rank holding
  1 / DP of them. Weight decay applies to every weight (``config_overrides={}``; megatron's
  default would exempt biases and norms, the torch backend does not), so both backends learn
  the same thing.
* The model's ``TransformerConfig`` must have ``calculate_per_token_loss=True``: the policy's
  loss is already a share of the step's global token mean, so gradients are *summed* over
  data-parallel replicas (megatron's default averages them).
* ``finish_step(ddp, optimizer)``: after the backward passes of a step,
  ``finalize_model_grads`` (the data-parallel reduce-scatter, the tied-embedding sum over
  the first and last pipeline stage, the sequence-parallel norm sum) and the optimizer's own
  step (global grad norm over every weight counted once, clip, Adam, fp32 -> bf16 copy,
  parameter all-gather over DP). Returns the pre-clip grad norm (also when
  ``grad_clip`` is 0, which disables clipping).
* ``local_state(optimizer)`` / ``load_local_state(optimizer, state)``: this rank's own shard
  of the optimizer (Adam moments and step of its main-param shards, and for bf16 weights its
  fp32 main-param shards), exactly, for a run checkpoint written at the same TP x PP x DP;
  the sharded, layout-independent form is ``optimizer.sharded_state_dict``
  (``nemo_tlt.megatron.policy_checkpoint``).
* ``offload_training_state(ddp, optimizer, host, also)`` / ``reload_training_state(ddp, host)``
  (per rank, no collective): the DDP buffers through megatron-core's own calls (the parameter
  buffer copied to host memory and released: ``_ParamAndGradBuffer.offload_to_cpu``; the
  gradient buffers released and zeroed on the way back: ``offload_grad_buffers`` /
  ``restore_grad_buffers``), the optimizer's state, its fp32 main params and the tensors
  ``also`` (the KL reference) through ``host`` (``nemo_tlt.model.offload.HostOffload``), all in
  place: the model's parameters, the main params and their views stay the same tensors.
"""
from __future__ import annotations

import math

import torch

from nemo_tlt.model.offload import HostOffload
from nemo_tlt.optim import OptimConfig

ADAM_EPS = 1e-8  # torch AdamW's default, which the torch backend uses
# What every megatron policy runs with (``nemo-tlt plan`` checks a plan against these):
DISTRIBUTED_OPTIMIZER = True  # fp32 main params and Adam state sharded over data-parallel replicas
GRAD_BYTES = 4                # grad_reduce_in_fp32: fp32 gradient buffers


def build_ddp_optimizer(model: torch.nn.Module, optim: OptimConfig, dtype: torch.dtype):
    """(DDP-wrapped model, megatron optimizer) for ``model`` (see the module docstring)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if not model.config.calculate_per_token_loss:
        raise ValueError("build_ddp_optimizer: the model's TransformerConfig needs calculate_per_token_loss=True "
                         "(the policy loss is a share of the global token mean: replicas' gradients are summed)")
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=GRAD_BYTES == 4, use_distributed_optimizer=DISTRIBUTED_OPTIMIZER, overlap_grad_reduce=False,
        overlap_param_gather=False), model)
    config = OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=0.0, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], adam_eps=ADAM_EPS,
        # megatron computes the grad norm only when it clips; clip 0 (off) becomes an infinite bound,
        # whose coefficient inf / norm never scales a gradient, so the norm is still reported
        clip_grad=optim.grad_clip if optim.grad_clip > 0 else math.inf, bf16=dtype == torch.bfloat16,
        params_dtype=dtype, use_distributed_optimizer=DISTRIBUTED_OPTIMIZER, main_grads_dtype=torch.float32,
        main_params_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
    optimizer = get_megatron_optimizer(config, [ddp], config_overrides={})
    return ddp, optimizer


def zero_grads(ddp, optimizer) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()


def finish_step(ddp, optimizer) -> float:
    """Reduce, clip and step (see the module docstring); the pre-clip global grad norm."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp])
    ok, norm, _ = optimizer.step()
    if not ok:  # only a loss-scaled fp16 step can be skipped; this policy never scales
        raise RuntimeError("megatron optimizer skipped the step (inf / nan gradients)")
    return float(norm)


def offload_training_state(ddp, optimizer, host: HostOffload, also: list[torch.Tensor]) -> None:
    """The policy's training state to host memory, its device storage released (module docstring)."""
    buffers = [*ddp.buffers, *ddp.expert_parallel_buffers]
    # megatron-core's optimizer.offload_to_cpu() is not used: it moves CUDA tensors only (nothing
    # on a CPU rank), to pageable memory, and rebinds ``p.data`` of the main params, which for
    # fp32 weights are views of the DDP parameter buffer moved below, so they would stop being
    # views. HostOffload moves the same tensors' storages in place and skips the buffers'.
    state, mains = [], []
    for opt in distributed_optimizers(optimizer):
        state += [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        mains += [p for group in opt.optimizer.param_groups for p in group["params"]]
    host.offload([*ddp.module.parameters(), *mains, *state, *also], drop=[p.grad for p in mains],
                 skip=[t for b in buffers for t in (b.param_data, b.grad_data)])
    for buffer in buffers:
        if buffer.param_data is not None and buffer.param_data_cpu is None:
            # megatron-core makes its host copy as param_data.cpu().pin_memory(): on a CPU rank
            # .cpu() is the buffer itself, which it then frees, and pin_memory needs CUDA. So the
            # host copy is made here once (pinned where CUDA is available) and megatron copies into it.
            buffer.param_data_cpu = torch.empty(buffer.param_data.shape, dtype=buffer.param_data.dtype,
                                                device="cpu", pin_memory=torch.cuda.is_available())
        buffer.offload_to_cpu(move_params=True, move_grads=False)
    cuda = host.device.type == "cuda"
    ddp.offload_grad_buffers(synchronize=cuda, empty_cache=False)  # the freed blocks stay for the engine
    if cuda:
        torch.cuda.synchronize(host.device)


def reload_training_state(ddp, host: HostOffload) -> None:
    """``offload_training_state`` undone: every tensor refilled in place (gradient buffers zeroed)."""
    ddp.restore_grad_buffers(synchronize=False)
    for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        buffer.reload_from_cpu(move_params=True, move_grads=False)
    host.reload()  # synchronizes the device


def distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer``(s) inside ``optimizer`` (a ``ChainedOptimizer`` holds several)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_shards(opt) -> list[torch.Tensor]:
    """This rank's fp32 main-param shards of bf16 weights, in the inner optimizer's order."""
    return [p for group in opt.shard_fp32_from_float16_groups for p in group]


def local_state(optimizer) -> list[dict]:
    """This rank's optimizer shard, one entry per ``DistributedOptimizer`` (see the module docstring)."""
    out = []
    for opt in distributed_optimizers(optimizer):
        out.append({"inner": opt.optimizer.state_dict(),
                    "main": [m.detach().clone() for m in _main_shards(opt)]})
    return out


@torch.no_grad()
def load_local_state(optimizer, state: list[dict]) -> None:
    """Restore ``local_state`` of the same rank at the same layout, then the weights from the main params."""
    opts = distributed_optimizers(optimizer)
    if len(state) != len(opts):
        raise ValueError(f"optimizer state holds {len(state)} optimizers, this policy has {len(opts)}")
    for opt, saved in zip(opts, state):
        opt.optimizer.load_state_dict(saved["inner"])
        mains = _main_shards(opt)
        if len(saved["main"]) != len(mains):
            raise ValueError(f"optimizer state holds {len(saved['main'])} fp32 main shards, this rank has "
                             f"{len(mains)} (another dtype or layout)")
        for m, value in zip(mains, saved["main"]):
            if m.shape != value.shape:
                raise ValueError(f"an fp32 main shard of shape {tuple(value.shape)} for one of {tuple(m.shape)}")
            m.copy_(value)
        if mains:  # bf16 weights continue from the fp32 values, not from their rounding
            opt._copy_main_params_to_model_params()
    for opt in opts:
        for chunk in opt.model_chunks:
            chunk.start_param_sync(force_sync=True)
