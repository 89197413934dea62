#!/bin/bash
# The shipped one-row 4-bit kernel's tiling with deferred sums and cheaper nibbles (row2.py).
nvidia-smi --query-gpu=name --format=csv,noheader
ln -sfn ../kernels specserve/kernels && ln -sfn ../drafts specserve/drafts
export PYTHONPATH=$PWD
D=benchmarks/results/quant_gpu/int4_k_lanes_2026-12-05
timeout 400 python $D/row2.py $OUT/row2.json > $OUT/row2.log 2>&1
echo rc $?
python - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/row2.log") if l.startswith("{")]
by = {}
for r in rows:
    by.setdefault(r["gemm"], []).append(r)
for g, rs in by.items():
    print(g, [(r["variant"].replace("row2 ", ""), r["us"]) for r in rs])
PY
grep -E "FAILED|^sass" $OUT/row2.log | cut -c1-400
