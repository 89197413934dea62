#!/bin/bash
# Second call: the W8A8 schemes' anatomy as the loader builds them (anatomy_shipped.py),
# PDL off then on.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
HERE=benchmarks/results/quant_gpu/standing_2026-12-07
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu2.txt
S="fp8 W8A8 per channel,fp8 W8A8 128x128 blocks"
SPECSERVE_PDL=0 timeout 110 python $HERE/anatomy_shipped.py $OUT/anatomy_shipped_nopdl.json "$S" 2>&1 \
  | grep -v -i "warn" > $OUT/anatomy_shipped_nopdl.log
timeout 110 python $HERE/anatomy_shipped.py $OUT/anatomy_shipped_pdl.json "$S" 2>&1 \
  | grep -v -i "warn" > $OUT/anatomy_shipped_pdl.log
grep -v '^{' $OUT/anatomy_shipped_nopdl.log | head -30
grep '^{' $OUT/anatomy_shipped_*.log | cut -c1-330
