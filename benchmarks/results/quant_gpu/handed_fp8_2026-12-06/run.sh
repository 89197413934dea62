#!/bin/bash
# One device call from the repository root: handed_ab.py, then the changed kernels' and
# layers' tests compiled on CUDA. Logs and the JSON come back in $OUT.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/root/ext PYTHONUNBUFFERED=1
D=benchmarks/results/quant_gpu/handed_fp8_2026-12-06
timeout 300 python $D/handed_ab.py $OUT/handed_ab.json 2>&1 | tee $OUT/handed_ab.log | tail -40
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_checkpoint_quant.py \
  -k "float8_rows or hand_float8 or activation_quantizer" \
  > $OUT/tests.log 2>&1
tail -15 $OUT/tests.log
