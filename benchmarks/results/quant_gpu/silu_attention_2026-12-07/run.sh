#!/bin/bash
# One device call, random weights only: the changed kernels' tests on the GPU, then study.py
# (kernels, attention sweep, steps), its rows streaming to study.log.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
H=benchmarks/results/quant_gpu/silu_attention_2026-12-07
{ nvidia-smi --query-gpu=name --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $OUT/gpu.txt 2>&1
T0=$(date +%s)
timeout ${TEST_S:-100} python -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_triton_kernels.py \
  -k "float8 or split or silu" > $OUT/tests.log 2>&1; echo "tests done at $(( $(date +%s) - T0 )) s"
timeout ${STUDY_S:-470} python $H/study.py $OUT/study.json ${SECTIONS:-kernels,attention,step} 2>&1 \
  | grep -v -i warn > $OUT/study.log; echo "study done at $(( $(date +%s) - T0 )) s"
tail -3 $OUT/tests.log; grep '"silu\|"step"' $OUT/study.log | cut -c1-300
