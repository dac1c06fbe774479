"""nemo-tlt: Taming the Long Tail for Megatron-core / NeMo RL training."""
__version__ = "0.1.0"
