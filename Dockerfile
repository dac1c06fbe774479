# nemo-tlt on an NGC PyTorch image: CUDA, cuDNN, NCCL, PyTorch and Transformer Engine come
# from the image; nemo-tlt adds megatron-core, transformers and the loggers on top.
# Not built or pulled where this file was written (no GPU, no registry access): see
# docs/container.md. Build:  docker build -t nemo-tlt:latest .
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE_IMAGE}

WORKDIR /opt/nemo-tlt
COPY . .

# The image's torch stays: torch is dropped from the constraints so pip never resolves it
# to another build, and PIP_CONSTRAINT makes every later pip call in the image keep the
# tested versions too.
RUN grep -v -E '^torch==' constraints.txt > /opt/constraints-ngc.txt \
 && python -c "import torch; print('NGC torch', torch.__version__)" \
 && pip install --no-cache-dir -c /opt/constraints-ngc.txt -e ".[hf,megatron,wandb,mlflow,datasets]" \
 && python -c "import torch, megatron.core, nemo_tlt; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
ENV PIP_CONSTRAINT=/opt/constraints-ngc.txt \
    NEMO_TLT_CACHE=/opt/nemo-tlt/.cache

ENTRYPOINT []
CMD ["nemo-tlt", "--help"]
