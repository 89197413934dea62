#!/bin/bash
# One device call: study.py's sweep of the narrow W8A8 projections' tiles under PDL, then the
# decode and verify steps with the shipped plans and the sweep's fastest.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
H=benchmarks/results/quant_gpu/narrow_tiles_2026-12-07
{ nvidia-smi --query-gpu=name --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/gpu.txt 2>&1
T0=$(date +%s)
timeout ${STUDY_S:-470} python $H/study.py $OUT/study.json ${SECTIONS:-sweep,step} 2>&1 | grep -v -i warn > $OUT/study.log
echo "study done at $(( $(date +%s) - T0 )) s"
grep -E '"sweep_best"|"step"' $OUT/study.log | cut -c1-330; grep -c '"sweep"' $OUT/study.log
