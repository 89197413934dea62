#!/bin/bash
# One device call: the prefetch tests and the FP8 GEMM tests on the GPU, then ab.py.
# Random weights: no model wheel.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" 2>&1 | tee -a $OUT/gpu.txt
timeout ${TEST_S:-120} python -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_pdl.py tests/test_checkpoint_quant.py -k "pdl or fp8_gemm or split_k or hopper"} 2>&1 | tail -8 | tee $OUT/tests.log
timeout ${AB_S:-400} python benchmarks/results/quant_gpu/prefetch_depth_2026-12-06/ab.py $OUT/ab.json ${SCHEMES:-w8a8,blocks} ${MODES:-t2,t0,t4,t8,t16} 2>&1 \
  | grep -v "Warning\|warn" | tee $OUT/ab.log
