#!/bin/bash
# The second device call (little device time left): the rounding spread over a row's
# slices (SiLU·mul per row, each program finding the row's largest magnitude itself; the
# norms, each program summing the whole row and rounding its slice): the kernels alone,
# beside the plain kernels and the separate quantizer in the same run, then the kernel
# test compiled on CUDA.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
D=benchmarks/results/quant_gpu/handed_fp8_2026-12-06
timeout 80 python $D/handed_ab.py $OUT/split_ab.json kernels 2>&1 | tee $OUT/split_ab.log | tail -14
timeout 100 python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py -k "float8_rows" > $OUT/split_tests.log 2>&1
tail -6 $OUT/split_tests.log
