"""4-bit GEMMs at 1, 2, 5 and 16 rows, with the nibbles of both kernels through
``_NIBBLE_BITS`` (this tree) against 8b5ee64's (shift, mask and int-to-float;
``../int4_k_lanes_2026-12-05/quant_matmul_8b5ee64.py``): µs per projection at
Llama-3.1-8B's shapes (groups of 128), CUDA-graph replay over weight copies larger than
L2, taking turns (new, old, old, new); and whether the outputs are the same bits.

    python benchmarks/results/quant_gpu/int4_tiled_ptx_2026-12-05/gemm_ab.py [out.json]
"""
import copy
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests"), str(HERE.parent / "int4_k_lanes_2026-12-05")]
import quant_matmul_8b5ee64 as before
from deterministic import graph_us
from quant_gpu import SCHEMES, layer_bytes, projections_8b, quantized_layer
from specserve.kernels import quant_matmul


def run(module, layer, x):
    return module.int4_linear(x, layer.packed, layer.scales, layer.zeros, layer.group, None,
                              counters=layer.tile_counters)


def main() -> None:
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), flush=True)
    rows = []
    for name, n, k, linear, g in projections_8b(device):
        layer = quantized_layer(linear, SCHEMES["int4 W4A16 g128"])
        layers = [layer] + [copy.deepcopy(layer) for _ in range(min(15, -(-256_000_000 // layer_bytes(layer)) - 1))]
        x = torch.randn(16, k, device=device, dtype=torch.bfloat16, generator=g)
        for m in (1, 2, 5, 16):
            xm = x[:m].clone()
            row = {"gemm": name, "rows": m,
                   "same_bits": bool(torch.equal(run(quant_matmul, layer, xm), run(before, layer, xm)))}
            for key in ("new", "old", "old", "new"):
                module = quant_matmul if key == "new" else before
                us = graph_us(lambda mod=module, xm=xm, ls=layers: [run(mod, each, xm) for each in ls], 20, device,
                              calls=1) / len(layers)
                row.setdefault(f"{key}_us", []).append(round(us, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
        layers, layer, linear = [], None, None
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


main()
