#!/bin/bash
# One device call: the tensor-core 4-bit kernel against the shipped ones (int4_mma.py),
# then the W8A8 schemes' anatomy as the loader builds them (../standing_2026-12-07/run2.sh).
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import cupy; print('cupy', cupy.__version__)"; } 2>&1 | tail -3 | tee $OUT/gpu.txt
T0=$(date +%s)
timeout 200 python benchmarks/results/quant_gpu/int4_mma_2026-12-07/int4_mma.py 2>&1 | grep -v -i "warn" | tee $OUT/int4_mma.log | cut -c1-700
echo "int4_mma done at $(( $(date +%s) - T0 )) s"
bash benchmarks/results/quant_gpu/standing_2026-12-07/run2.sh 2>&1 | tail -8
echo "anatomy done at $(( $(date +%s) - T0 )) s"
