import sys
import time

import torch

from specserve.models.quantized import quantize_linears

torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[2]))
k, n, copies = 576, 3072, 48
layers = []
for i in range(copies):
    m = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)); quantize_linears(m, "Q4_1"); layers.append(m[0])
out = []
for rows in (1, 2, 3, 4, 5):
    x = torch.randn(rows, k).bfloat16()
    for lin in layers: lin(x)
    best = 1e9
    for _ in range(7):
        s = time.perf_counter()
        for lin in layers: lin(x)
        best = min(best, (time.perf_counter() - s) / copies * 1e6)
    out.append(f"r{rows}={best:.1f}")
print(sys.argv[1], "threads", sys.argv[2], " ".join(out))
