#!/bin/bash
# One device call at main's HEAD, random weights only (no model wheel): where the 8B-shape
# decode step stands against its floor per weight scheme, as shipped (PDL on), and its
# kernels grouped with PDL off (each kernel's own time, not overlapping the next).
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
HERE=benchmarks/results/quant_gpu
{ nvidia-smi --query-gpu=name --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "nvcc: $(command -v nvcc || echo none)"; ls -d /usr/local/cuda* 2>&1
  python -c "from torch.utils.cpp_extension import CUDA_HOME; print('CUDA_HOME', CUDA_HOME)"
} 2>&1 | tee $OUT/gpu.txt
T0=$(date +%s)
timeout 150 python benchmarks/quant_gpu.py --sections decode --reps 30 --json $OUT/decode.json 2>&1 \
  | grep -v -i "warn" > $OUT/decode.log; echo "decode done at $(( $(date +%s) - T0 )) s"
SPECSERVE_PDL=0 timeout 200 python $HERE/step_anatomy_2026-12-05/anatomy.py $OUT/anatomy_nopdl.json 2>&1 \
  | grep -v -i "warn" > $OUT/anatomy_nopdl.log; echo "anatomy (PDL off) done at $(( $(date +%s) - T0 )) s"
timeout 200 python $HERE/step_anatomy_2026-12-05/anatomy.py $OUT/anatomy_pdl.json 2>&1 \
  | grep -v -i "warn" > $OUT/anatomy_pdl.log; echo "anatomy (PDL on) done at $(( $(date +%s) - T0 )) s"
grep '"decode"\|scheme' $OUT/decode.log | head -12
grep '^{' $OUT/anatomy_nopdl.log | cut -c1-400
