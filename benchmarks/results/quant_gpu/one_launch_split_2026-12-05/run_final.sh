#!/bin/bash
# At 7f1aaac (the sum in the launch for 4-bit weights only): the GEMM tests that take
# split K, then the 8B-shape decode step once.
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
T0=$(date +%s)
timeout 100 python benchmarks/quant_gpu.py --sections decode --reps 20 --json $OUT/decode_final.json > $OUT/decode_final.log 2>&1
grep '"decode"' $OUT/decode_final.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print(r['scheme'], r['step_ms'], r['floor_ms'], r['vs_floor'], r['verify_1_plus_4_ms'])"
echo "decode done at $(( $(date +%s) - T0 )) s"
timeout $(( 290 - ($(date +%s) - T0) )) python -m pytest -q -p no:cacheprovider -rf tests/test_checkpoint_quant.py \
  -k "one_launch or captured_before or int4_gemm" > $OUT/pytest_final.log 2>&1
tail -3 $OUT/pytest_final.log; echo "tests done at $(( $(date +%s) - T0 )) s"
