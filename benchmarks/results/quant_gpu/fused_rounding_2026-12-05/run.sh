#!/bin/bash
# Call 1 of a lease: keeps the model wheel's first part for the next calls, then the 8B-shape
# decode step with W8A8 inputs rounded inside the product (this tree) against 1002be8 (a
# tarball: rounded by a launch of their own), taking turns; the CUDA GEMM tests between.
mkdir -p /root/w && cp device_carry_q1/part_aa /root/w/
nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"
mkdir -p /root/base && tar xzf device_carry_old/base.tar.gz -C /root/base
for R in $PWD /root/base; do (cd $R && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts); done
T0=$(date +%s)
run() {  # label root
  (cd $2 && PYTHONPATH=$2 timeout 110 python benchmarks/quant_gpu.py --sections decode --reps 30 --json $OUT/decode_$1.json > $OUT/decode_$1.log 2>&1)
  grep '"decode"' $OUT/decode_$1.log | python -c "
import sys, json
for l in sys.stdin:
    r = json.loads(l[l.index('{'):])
    print('$1', r['scheme'], r['step_ms'], r['floor_ms'], r['vs_floor'], r['verify_1_plus_4_ms'])"
  echo "$1 done at $(( $(date +%s) - T0 )) s"
}
run new1 $PWD
run base1 /root/base
PYTHONPATH=$PWD timeout 150 python -m pytest -q -p no:cacheprovider tests/test_checkpoint_quant.py \
  -k "fp8_gemm or fp8_block or ct_fp8_dynamic or int4_gemm or row_does" > $OUT/pytest_gpu.log 2>&1
tail -3 $OUT/pytest_gpu.log; echo "tests done at $(( $(date +%s) - T0 )) s"
run base2 /root/base
run new2 $PWD
