#!/bin/bash
# A second lease: the 8B-shape decode step with W8A8 inputs rounded by a launch of their own
# ("unfused": this tree, 583bc8d's in-product rounding taken out), rounded inside the product
# ("fused": 4083fc2, tarball) and 1002be8 ("base", tarball: before 583bc8d), taking turns.
# Each tarball holds specserve/ and kernels/; the benchmark scripts and tests are this tree's.
nvidia-smi --query-gpu=name --format=csv,noheader
for v in fused base; do
  mkdir -p /root/$v && cp -r benchmarks tests drafts /root/$v/ && tar xzf device_carry_old/$v.tar.gz -C /root/$v
done
grep -c QUANTIZE_X /root/fused/kernels/quant_matmul.py /root/base/kernels/quant_matmul.py kernels/quant_matmul.py
for R in $PWD /root/fused /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
T0=$(date +%s)
run() {  # label root
  (cd $2 && PYTHONPATH=$2 timeout 100 python benchmarks/quant_gpu.py --sections decode --reps 30 --json $OUT/decode_$1.json > $OUT/decode_$1.log 2>&1)
  grep '"decode"' $OUT/decode_$1.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print('$1', r['scheme'], r['step_ms'], r['floor_ms'], r['vs_floor'], r['verify_1_plus_4_ms'])"
  tail -2 $OUT/decode_$1.log | grep -i error
  echo "$1 done at $(( $(date +%s) - T0 )) s"
}
run unfused1 $PWD
run fused1 /root/fused
run base1 /root/base
run unfused2 $PWD
