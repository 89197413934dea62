#!/bin/bash
# One device call: PDL against plain launches (pdl_ab.py), then the CUDA kernel tests with
# PDL on (the default). Random weights only: no model wheel needed.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__); from triton.language.extra.cuda import gdc_wait" 2>&1 | tee -a $OUT/gpu.txt
timeout ${AB_S:-400} python benchmarks/results/quant_gpu/pdl_2026-12-06/pdl_ab.py $OUT/pdl_ab.json ${SCHEMES:-small,w8a8,int4,bf16} 2>&1 \
  | grep -v "Warning\|warn" | tee $OUT/pdl_ab.log
timeout ${TEST_S:-150} python -m pytest -x -q -p no:cacheprovider ${TESTS:-tests/test_fused_kernels.py tests/test_triton_kernels.py} 2>&1 | tail -15 | tee $OUT/tests.log
