#!/bin/bash
# Both 4-bit kernels' nibbles through _NIBBLE_BITS: GEMMs at 1-16 rows against 8b5ee64
# (gemm_ab.py), the decode and verify steps (ab_decode.py), the CUDA tests.
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
D=benchmarks/results/quant_gpu/int4_tiled_ptx_2026-12-05
T0=$(date +%s)
timeout 120 python $D/gemm_ab.py $OUT/gemm_ab.json > $OUT/gemm_ab.log 2>&1
python -c "
import json
for l in open('$OUT/gemm_ab.log'):
    if l.startswith('{'):
        r = json.loads(l); print(r['gemm'], r['rows'], r['same_bits'], r['new_us'], r['old_us'])
    else: print(l.rstrip()[:300])
"; echo "gemm done at $(( $(date +%s) - T0 )) s"
timeout 120 python $D/ab_decode.py $OUT/ab_decode.json > $OUT/ab_decode.log 2>&1
cut -c1-400 $OUT/ab_decode.log | tail -4; echo "ab done at $(( $(date +%s) - T0 )) s"
timeout $(( 300 - ($(date +%s) - T0) )) python -m pytest -q -p no:cacheprovider -rf tests/test_checkpoint_quant.py \
  -k "int4_gemm or streams or one_launch or row_does or engine_decodes" > $OUT/pytest_h100.log 2>&1
tail -4 $OUT/pytest_h100.log; echo "tests done at $(( $(date +%s) - T0 )) s"
