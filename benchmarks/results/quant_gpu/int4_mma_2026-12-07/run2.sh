#!/bin/bash
# Second call: int4_mma.py again, with the kernel loading DEPTH chunks ahead.
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import cupy; print('cupy', cupy.__version__)"; } 2>&1 | tail -3 | tee $OUT/gpu.txt
timeout 200 python benchmarks/results/quant_gpu/int4_mma_2026-12-07/int4_mma.py 2>&1 | grep -v -i "warn" | tee $OUT/int4_mma.log \
  | python -c "
import json, sys
for line in sys.stdin:
    if not line.startswith('{'):
        print(line.rstrip()[:200]); continue
    r = json.loads(line)
    best = min((v['us'], k) for k, v in r.items() if isinstance(v, dict))
    print(r['gemm'], r['m'], 'floor', r['floor_us'], 'shipped', r['shipped_us'], 'best', best,
          ' '.join(f\"{k[4:]}={v['us']}\" for k, v in r.items() if isinstance(v, dict)), 'err', max(v['err'] for v in r.values() if isinstance(v, dict)))
"
