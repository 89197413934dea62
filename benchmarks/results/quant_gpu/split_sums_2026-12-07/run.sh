#!/bin/bash
# One device call, main at b42fa4a with split_sums.patch applied: the GPU tests of the norm
# adding K splits, study.py's pair and step sections, then quant_gpu.py's decode section
# (the splits handed on).
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
H=benchmarks/results/quant_gpu/split_sums_2026-12-07
{ nvidia-smi --query-gpu=name --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/gpu.txt 2>&1
T0=$(date +%s)
timeout ${TEST_S:-60} python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_checkpoint_quant.py -k "k_splits" \
  > $OUT/tests.log 2>&1; echo "tests done at $(( $(date +%s) - T0 )) s"
timeout ${STUDY_S:-360} python $H/study.py $OUT/study.json ${SECTIONS:-pair,step} 2>&1 | grep -v -i warn > $OUT/study.log
echo "study done at $(( $(date +%s) - T0 )) s"
timeout ${DECODE_S:-80} python benchmarks/quant_gpu.py --sections decode --reps 30 --json $OUT/decode.json 2>&1 \
  | grep -v -i warn > $OUT/decode.log; echo "decode done at $(( $(date +%s) - T0 )) s"
tail -2 $OUT/tests.log; grep '"pair"' $OUT/study.log | cut -c1-200; grep '"step"' $OUT/study.log | cut -c1-250
grep '"decode"' $OUT/decode.log | cut -c1-250
