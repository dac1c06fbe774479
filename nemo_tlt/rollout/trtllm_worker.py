"""Our extension of TensorRT-LLM's Ray workers (named by ``ray_worker_extension_cls``).

Imported only inside TensorRT-LLM's Ray workers, never by nemo-tlt itself: it
subclasses ``tensorrt_llm.llmapi.rlhf_utils.WorkerExtension`` (documented:
``update_weights(ipc_handles)`` loads a partial set of HF-named tensors, each rank
sharding them itself; ``update_weights(None)`` finalises) and adds
``set_draft_len_schedule``.

UNVERIFIED (never run: no GPU and no TensorRT-LLM where this was written):
``set_draft_len_schedule`` writes the schedule into the worker's speculative
config, an internal of TensorRT-LLM's PyTorch executor, not a documented API; the
executor may cache a derived mapping (and CUDA graphs are captured per draft
length) so a new schedule may be ignored or only partly honoured. docs/trtllm.md
says how to check it on a GPU node.
"""
from __future__ import annotations

from tensorrt_llm.llmapi.rlhf_utils import WorkerExtension


class TLTWorkerExtension(WorkerExtension):
    def set_draft_len_schedule(self, schedule: dict[int, int]) -> None:
        """Install TensorRT-LLM's draft_len_schedule (batch-size threshold -> draft
        length; ``{}``: no speculation) for the next iterations. Unverified."""
        spec_config = self.engine.model_engine.spec_config
        if spec_config is None:
            raise ValueError("set_draft_len_schedule: this LLM was built without a speculative_config")
        spec_config.draft_len_schedule = dict(sorted(schedule.items())) if schedule else {1: 0}
