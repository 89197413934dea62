"""One 4-bit projection at one row (qkv and gate_up of Llama-3.1-8B), for Nsight Compute:
a few eager calls of the planned ``_int4_row_kernel``."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]
from quant_gpu import SCHEMES, projections_8b, quantized_layer

for name, n, k, linear, g in projections_8b(torch.device("cuda")):
    if name in ("qkv", "gate_up"):
        layer = quantized_layer(linear, SCHEMES["int4 W4A16 g128"])
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(3):
            layer(x)
        torch.cuda.synchronize()
        print(name, "done", flush=True)
