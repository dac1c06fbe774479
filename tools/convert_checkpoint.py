#!/usr/bin/env python
"""Checkpoint conversion (HF <-> Megatron torch_dist, HF -> TensorRT-LLM); same as ``nemo-tlt convert``.

Run ``python tools/convert_checkpoint.py --help`` for the options.
"""
from __future__ import annotations

import sys

from nemo_tlt.convert import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
