#!/bin/bash
# One device call: the tests of the handed float8 output on the GPU, then ab.py. Random
# weights: no model wheel.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" 2>&1 | tee -a $OUT/gpu.txt
timeout ${TEST_S:-150} python -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_checkpoint_quant.py -k hand} 2>&1 | tail -15 | tee $OUT/tests.log
timeout ${TEST2_S:-100} python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "float8_per_head or compile" 2>&1 | tail -5 | tee $OUT/tests2.log
timeout ${AB_S:-250} python benchmarks/results/quant_gpu/attention_fp8_2026-12-06/ab.py $OUT/ab.json ${SCHEMES:-blocks,w8a8} 2>&1 \
  | grep -v "Warning\|warn" | tee $OUT/ab.log
