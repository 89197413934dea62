#!/bin/bash
# The quantized GEMMs' and checkpoints' tests on CUDA (tests/test_checkpoint_quant.py, which
# compiles the Triton kernels for real at Llama-3.1-8B's shapes on a GPU), on the code as it
# stands since 751d081 (the input rounding taken out of the block-wise W8A8 GEMM).
set -u
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
T0=$(date +%s)
PYTHONPATH=$PWD timeout ${1:-540} python -m pytest -q -p no:cacheprovider -rf --durations=5 \
  tests/test_checkpoint_quant.py > $OUT/pytest_cuda.log 2>&1
echo "rc $? at $(( $(date +%s) - T0 )) s"
tail -15 $OUT/pytest_cuda.log
