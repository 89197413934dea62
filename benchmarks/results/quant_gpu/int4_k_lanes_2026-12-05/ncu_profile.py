"""gate_up (28672 x 4096, 4-bit, groups of 128) at one row, for Nsight Compute: a few eager
calls of the shipped one-row kernel and of two ``_lanes`` variants, in that order."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import SCHEMES, _lanes, call, projections_8b, qm, quantized_layer

for name, n, k, linear, g in projections_8b(torch.device("cuda")):
    if name != "gate_up":
        continue
    layer = quantized_layer(linear, SCHEMES["int4 W4A16 g128"])
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
    for kernel, tiles, consts in ((qm._int4_row_kernel, qm.plan(True, "w4a16_row", n, k, 128, x.device), {}),
                                  (_lanes, qm.Tiles(1, 16, 1024, 1, 2, 1), {}),
                                  (_lanes, qm.Tiles(1, 16, 1024, 1, 2, 1), {"TRICK": True})):
        for _ in range(2):
            call(layer, x, kernel, tiles, consts)
        torch.cuda.synchronize()
    print(name, "done", flush=True)
