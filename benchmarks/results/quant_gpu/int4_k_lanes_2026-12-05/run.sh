#!/bin/bash
# The one-row 4-bit kernels, per projection (sweep.py), on the device.
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 420 python benchmarks/results/quant_gpu/int4_k_lanes_2026-12-05/sweep.py $OUT/sweep.json > $OUT/sweep.log 2>&1
echo rc $?
python - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/sweep.log") if l.startswith("{")]
by = {}
for r in rows:
    by.setdefault(r["gemm"], []).append(r)
for g, rs in by.items():
    base = [r for r in rs if r["variant"] == "shipped"][0]
    best = sorted(rs, key=lambda r: r["us"])[:6]
    print(g, "shipped", base["us"], "| best:", [(r["variant"], r["us"], r["rel_err_fp64"]) for r in best])
PY
grep FAILED $OUT/sweep.log | head -5
