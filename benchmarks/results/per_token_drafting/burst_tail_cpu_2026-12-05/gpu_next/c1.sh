#!/bin/bash
# Call 1 of a lease: part 1 of the default model's wheel kept; the GPU tests of the
# 4-bit nibble extraction and of the kernels' sm_90 compile (not yet run on a GPU in their final form).
mkdir -p /root/w && cp device_carry_a/part_aa /root/w/
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
PYTHONPATH=$PWD timeout 150 python -m pytest -q -x tests/test_checkpoint_quant.py \
  -k "nibbles_from_ptx or compile_for_hopper" 2>&1 | tail -5
