"""quant_linear at the default model's shapes (Q4_1, and Q8_0), 1..8 rows, 2 threads: us per call.

    python projection_rows.py Q4_1,Q8_0 out.json
"""
import json
import sys
import time

import torch
from torch import nn

from specserve.models.quantized import quantize_linears

torch.manual_seed(0)
torch.set_num_threads(2)
shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["Q4_1"]
out = {}
for kind in kinds:
    for name, (k, n) in shapes.items():
        m = nn.Sequential(nn.Linear(k, n, bias=False)); quantize_linears(m, kind); layer = m[0]; layer.dequant_rows = 0
        for rows in range(1, 9):
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            reps = 20 if name == "head" else 200
            best = []
            for _ in range(5):
                layer(x)
                t = time.perf_counter()
                for _ in range(reps): layer(x)
                best.append((time.perf_counter() - t) / reps * 1e6)
            out[f"{kind} {name} {rows}"] = min(best)
        print(kind, name, " ".join(f"{out[f'{kind} {name} {r}']:.0f}" for r in range(1, 9)), flush=True)
with open(sys.argv[2] if len(sys.argv) > 2 else "projection_rows.json", "w") as f:
    json.dump(out, f)
