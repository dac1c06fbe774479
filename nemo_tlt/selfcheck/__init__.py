"""``nemo-tlt selfcheck --gpu``: the GPU acceptance run (``docs/gpu.md``).

engine_check  -- the embedded engine on a device in fp32 and bf16: SD-vs-plain identity
                 rates and plain / SD / HF generate tokens/s, on the demo model and on a
                 randomly initialised model the size of Qwen2.5-0.5B
system_checks -- the demo main job on one device, the megatron backend at world size 1,
                 a run-checkpoint round trip with device tensors
trtllm_check  -- ``--trtllm``: the TensorRT-LLM engine with the trained demo EAGLE-3 drafter
                 exported (identity, per-step acceptance, tokens/s) and ``pytest -m trtllm``
cli           -- runs them in order, each recorded as passed or failed, into one JSON
"""
