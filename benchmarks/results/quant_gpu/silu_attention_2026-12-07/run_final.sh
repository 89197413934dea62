#!/bin/bash
# The third device call, at the commit that ships the three changes: their tests on the
# GPU, study.py's ``final`` A/B, then quant_gpu.py's decode section as shipped.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
H=benchmarks/results/quant_gpu/silu_attention_2026-12-07
{ nvidia-smi --query-gpu=name --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/gpu.txt 2>&1
T0=$(date +%s)
timeout ${TEST_S:-90} python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_fused_kernels.py \
  -k "float8 or split or silu or decode or plan" > $OUT/tests.log 2>&1; echo "tests done at $(( $(date +%s) - T0 )) s"
timeout ${FINAL_S:-200} python $H/study.py $OUT/final.json final 2>&1 | grep -v -i warn > $OUT/final.log
echo "final done at $(( $(date +%s) - T0 )) s"
timeout ${DECODE_S:-100} python benchmarks/quant_gpu.py --sections decode --reps 30 --json $OUT/decode.json 2>&1 \
  | grep -v -i warn > $OUT/decode.log; echo "decode done at $(( $(date +%s) - T0 )) s"
tail -2 $OUT/tests.log; grep '"final"' $OUT/final.log | cut -c1-260; grep '"decode"' $OUT/decode.log | cut -c1-250
