#!/bin/bash
# The 4-bit one-row variants (sweep.py), then the decode step again with the K splits summed
# in the launch and by a second launch (the second pair of ../one_launch_split_2026-12-05).
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
T0=$(date +%s)
timeout 300 python benchmarks/results/quant_gpu/int4_row_magic_2026-12-05/sweep.py $OUT/sweep.json > $OUT/sweep.log 2>&1
grep -E "FAILED|Error" $OUT/sweep.log | head -5
python - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/sweep.json"))
for r in rows:
    print(f"{r['gemm']:8s} {r['variant']:22s} {r['us']:7.2f} diff {r['rel_diff_vs_shipped']:.2e} err {r['rel_err_fp64']:.2e}")
PY
echo "sweep done at $(( $(date +%s) - T0 )) s"
decode() {  # label one_launch(True/False)
  timeout 110 python -c "
import runpy, sys
from specserve.kernels import quant_matmul
quant_matmul.ONE_LAUNCH_SUM = $2
sys.argv = ['quant_gpu.py', '--sections', 'decode', '--reps', '20', '--json', '$OUT/decode_$1.json']
runpy.run_path('benchmarks/quant_gpu.py', run_name='__main__')" > $OUT/decode_$1.log 2>&1
  grep '"decode"' $OUT/decode_$1.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print('$1', r['scheme'], r['step_ms'], r['floor_ms'], r['vs_floor'], r['verify_1_plus_4_ms'])"
  echo "$1 done at $(( $(date +%s) - T0 )) s"
}
decode two2 False
decode one2 True
