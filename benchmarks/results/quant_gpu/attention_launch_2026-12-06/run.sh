#!/bin/bash
# One device call: the kernel tests on the GPU (the attention's two ways of combining KV
# splits must give the same bits there too), then ab.py. Random weights: no model wheel.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" 2>&1 | tee -a $OUT/gpu.txt
timeout ${TEST_S:-170} python -m pytest -x -q -p no:cacheprovider ${TESTS:-tests/test_triton_kernels.py tests/test_pdl.py} 2>&1 | tail -15 | tee $OUT/tests.log
timeout ${AB_S:-380} python benchmarks/results/quant_gpu/attention_launch_2026-12-06/${AB:-ab.py} $OUT/ab.json ${SCHEMES:-w8a8,int4} ${MODES:-} 2>&1 \
  | grep -v "Warning\|warn" | tee $OUT/ab.log
