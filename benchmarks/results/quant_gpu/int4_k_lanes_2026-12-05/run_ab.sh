#!/bin/bash
# Second call: the decode step against 8b5ee64's kernel in one process (ab_decode.py), then
# the CUDA tests the first call's 150 s did not reach.
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
D=benchmarks/results/quant_gpu/int4_k_lanes_2026-12-05
T0=$(date +%s)
timeout 150 python $D/ab_decode.py $OUT/ab_decode.json > $OUT/ab_decode.log 2>&1
cut -c1-400 $OUT/ab_decode.log | tail -4; echo "ab done at $(( $(date +%s) - T0 )) s"
timeout $(( 390 - ($(date +%s) - T0) )) python -m pytest -q -p no:cacheprovider -rf tests/test_checkpoint_quant.py \
  -k "int4_gemm or streams or one_launch or row_does" > $OUT/pytest_h100.log 2>&1
tail -4 $OUT/pytest_h100.log; echo "tests done at $(( $(date +%s) - T0 )) s"
