#!/bin/bash
# The shipped change: the CUDA tests of the 4-bit GEMMs, the decode step against 8b5ee64's
# kernel in one process (ab_decode.py), and the 8B-shape decode section once.
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
D=benchmarks/results/quant_gpu/int4_k_lanes_2026-12-05
T0=$(date +%s)
timeout 150 python -m pytest -q -p no:cacheprovider -rf tests/test_checkpoint_quant.py \
  -k "int4 or one_launch or row_does or captured or streams or nibble" > $OUT/pytest_h100.log 2>&1
tail -3 $OUT/pytest_h100.log; echo "tests done at $(( $(date +%s) - T0 )) s"
timeout 150 python $D/ab_decode.py $OUT/ab_decode.json > $OUT/ab_decode.log 2>&1
cat $OUT/ab_decode.log | cut -c1-400; echo "ab done at $(( $(date +%s) - T0 )) s"
timeout $(( 470 - ($(date +%s) - T0) )) python benchmarks/quant_gpu.py --sections decode --reps 20 --json $OUT/decode.json > $OUT/decode.log 2>&1
grep '"decode"' $OUT/decode.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print(r['scheme'], r['step_ms'], r['floor_ms'], r['vs_floor'], r['verify_1_plus_4_ms'])"
echo "decode done at $(( $(date +%s) - T0 )) s"
