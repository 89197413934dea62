#!/bin/bash
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /root/base && tar xzf device_carry_q3/base.tar.gz -C /root/base
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
T0=$(date +%s)
PYTHONPATH=$PWD timeout 90 python device_carry_q3/fp8_sweep.py 2>&1 | grep -v Warn | tail -12
echo "sweep took $(( $(date +%s) - T0 )) s"
run() {  # label root
  (cd $2 && PYTHONPATH=$2 timeout 80 python benchmarks/quant_gpu.py --sections decode --reps 30 --json $OUT/decode_$1.json > $OUT/decode_$1.log 2>&1)
  grep '"decode"' $OUT/decode_$1.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print('$1', r['scheme'], r['step_ms'], r['floor_ms'], r['vs_floor'], r['verify_1_plus_4_ms'])"
  echo "$1 done at $(( $(date +%s) - T0 )) s"
}
run new1 $PWD
run base1 /root/base
