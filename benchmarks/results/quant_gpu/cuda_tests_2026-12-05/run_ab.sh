#!/bin/bash
# The W8A8 engine test that failed on this tree, at each of the commits that touched the FP8
# GEMMs since 1002be8 (trees carried as archives in device_carry_ab/), and here.
set -u
nvidia-smi --query-gpu=name --format=csv,noheader
SEL="engine_decodes and (ct_fp8_dynamic or fp8_block or ct_fp8_w8a16)"
for c in 1002be8 4083fc2 751d081 770cc2c; do
  mkdir -p /tmp/t_$c && tar xzf device_carry_ab/$c.tar.gz -C /tmp/t_$c
  (cd /tmp/t_$c && ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts && \
   PYTHONPATH=/tmp/t_$c timeout 100 python -m pytest -q -p no:cacheprovider tests/test_checkpoint_quant.py -k "$SEL" 2>&1 \
   | grep -E "passed|failed|AssertionError: " | sed "s/^/$c: /" | tee -a $OUT/ab.log)
done
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
PYTHONPATH=$PWD timeout 100 python -m pytest -q -p no:cacheprovider tests/test_checkpoint_quant.py -k "$SEL" 2>&1 \
  | grep -E "passed|failed|AssertionError: " | sed "s/^/HEAD: /" | tee -a $OUT/ab.log
