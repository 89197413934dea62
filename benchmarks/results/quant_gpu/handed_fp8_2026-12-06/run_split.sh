#!/bin/bash
# The second device call: the rounding spread over a row's slices (SiLU·mul per row, each
# program finding the row's largest magnitude itself; the norms, each program summing the
# whole row and rounding its slice): the kernels and W8A8 per channel again (handed and
# own), then the kernel tests compiled on CUDA.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
D=benchmarks/results/quant_gpu/handed_fp8_2026-12-06
timeout 200 python $D/handed_ab.py $OUT/split_ab.json per-channel 2>&1 | tee $OUT/split_ab.log | tail -20
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_checkpoint_quant.py \
  -k "float8_rows or hand_float8" > $OUT/split_tests.log 2>&1
tail -8 $OUT/split_tests.log
