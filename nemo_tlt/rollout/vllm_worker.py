"""Our vLLM worker extension: in-place refit of the target and of the EAGLE-3 drafter.

vLLM mixes ``worker_extension_cls`` into each worker class, so these methods run on every
worker with ``self`` the worker (``LLM.collective_rpc("tlt_reload_policy", args=...)``).
The weights arrive as a list of (HF name, full tensor) pairs when the worker lives in
the caller's process (``distributed_executor_backend="uni"``: passed by reference), or
as the path of a safetensors file that each worker reads (workers in other processes:
vLLM's RPC serialises tensors as nested lists). Imported by vLLM's workers only.

* Target: ``model_runner.reload_weights(weights_iterator=...)``, vLLM's in-place reload of
  checkpoint-format weights (each TP worker keeps its shard; the CPU backend's repacked
  linear weights are rebuilt). The EAGLE-3 drafter shares the target's embedding
  tensor, which the reload writes into, so the drafter sees the new embedding.
* Drafter: the same layer-wise reload on the proposer's model (``model_runner.drafter.model``,
  vLLM's ``Eagle3LlamaForCausalLM``), whose ``load_weights`` maps the export's names
  (``midlayer.*``, ``fc``, ``norm``, ``lm_head``; ``d2t`` only for a smaller draft vocabulary).
* CPU fix (`expand_kernel_cpu`): vLLM 0.32's CPU stand-in for the rejection sampler's
  ``expand_kernel`` (``utils/cpu_triton_utils._expand_kernel_impl``, used where Triton has no
  CPU backend) runs its C++ kernel on an int64 *copy* of the output
  (``_ensure_int64(output)``) and drops it, so the per-draft-token temperature, top-p and
  top-k it expands stay uninitialised memory: rejection SD then samples a wrong
  distribution and reports NaN log-probs (greedy is unaffected). `tlt_fix_cpu_kernels`
  replaces that stand-in through vLLM's own override registry (``triton_utils.dispatcher``).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

Weights = list[tuple[str, torch.Tensor]] | str


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_cpu(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                      replace_from: float, replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:
    """vLLM's ``expand_kernel``, written into ``output``: request i's value (``replace_from``
    read as ``replace_to``) over its tokens ``cu_num_tokens[i-1]:cu_num_tokens[i]``."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def _pairs(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(weights, str):
        from safetensors.torch import load_file
        return iter(load_file(weights).items())
    return iter(weights)


class TLTWorkerExtension:
    """Methods added to vLLM's worker (see the module docstring)."""

    def tlt_reload_policy(self, weights: Weights) -> None:
        self.model_runner.reload_weights(weights_iterator=_pairs(weights))

    def tlt_reload_drafter(self, weights: Weights) -> None:
        """Reload the EAGLE-3 proposer's weights (the engine checked names and shapes first, and
        refused at start-up a drafter whose head vLLM would share with the target)."""
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                       initialize_layerwise_reload)
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "model"):
            raise ValueError("tlt_reload_drafter: this vLLM engine runs no EAGLE drafter")
        model = drafter.model
        initialize_layerwise_reload(model)
        model.load_weights(_pairs(weights))
        finalize_layerwise_reload(model, runner.vllm_config.speculative_config.draft_model_config)

    def tlt_fix_cpu_kernels(self) -> bool:
        """Replace vLLM's broken CPU ``expand_kernel`` stand-in (module docstring) where it is the
        one registered; whether ours is registered now."""
        from vllm.utils import cpu_triton_utils
        from vllm.triton_utils.dispatcher import register_kernels
        from vllm.v1.sample import rejection_sampler

        registered = getattr(rejection_sampler.expand_kernel, "func", None)
        if registered is cpu_triton_utils._expand_kernel_impl:
            register_kernels({EXPAND_KERNEL: expand_kernel_cpu})
            registered = expand_kernel_cpu
        return registered is expand_kernel_cpu

    def tlt_device(self) -> str:
        """This worker's device (``cuda:N`` / ``cpu``)."""
        return str(self.device)
