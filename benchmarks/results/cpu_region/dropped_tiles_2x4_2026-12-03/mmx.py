"""Quantized projections at the default model's shapes (Q4_1), µs per call by rows: one line each."""
import sys
import time

import torch

from specserve.models.quantized import quantize_linears

label, threads = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)
shapes = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
for name, (k, n) in shapes.items():
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    quantize_linears(model, "Q4_1")
    lin = model[0]
    out = []
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, k).bfloat16()
        for _ in range(20):
            lin(x)
        reps, times = (40 if name == "head" else 400), []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                lin(x)
            times.append((time.perf_counter() - start) / reps * 1e6)
        out.append(f"r{rows}={min(times):.1f}")
    print(f"{label} threads={threads} {name} {k}x{n}: {' '.join(out)}", flush=True)
