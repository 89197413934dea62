"""K split summed in the launch (the tile's last program, ``ONE_LAUNCH_SUM``) against a
second launch (``_sum_splits``): µs per quantized projection at Llama-3.1-8B's shapes, 1
and 5 rows, CUDA-graph replay over weight copies larger than L2; the two take turns
(one, two, two, one) in one process.

    python benchmarks/results/quant_gpu/one_launch_split_2026-12-05/split_sum_ab.py [out.json]
"""
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]
from deterministic import graph_us
from gpu_bench import _copy_bandwidth
from quant_gpu import SCHEMES, layer_bytes, projections_8b, quantized_layer
from specserve.kernels import quant_matmul


def main() -> None:
    device = torch.device("cuda")
    bandwidth = _copy_bandwidth(device)
    print(torch.cuda.get_device_name(device), f"copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for scheme_name, scheme in SCHEMES.items():
        for name, n, k, linear, g in projections_8b(device):
            layer = quantized_layer(linear, scheme)
            size = layer_bytes(layer)
            layers = [layer] + [copy.deepcopy(layer) for _ in range(min(15, -(-256_000_000 // size) - 1))]
            x = torch.randn(5, k, device=device, dtype=torch.bfloat16, generator=g)
            row = {"scheme": scheme_name, "gemm": name, "floor_us": round(1e6 * size / bandwidth, 1)}
            for m in (1, 5):
                xm = x[:m].clone()
                outs = {}
                for turn, one in enumerate((True, False, False, True)):
                    quant_matmul.ONE_LAUNCH_SUM = one
                    outs[one] = layer(xm)
                    us = graph_us(lambda xm=xm, ls=layers: [each(xm) for each in ls], 20, device, calls=1) / len(layers)
                    row.setdefault(f"m{m}_{'one' if one else 'two'}_us", []).append(round(us, 2))
                row[f"m{m}_equal"] = bool(torch.equal(outs[True], outs[False]))
            quant_matmul.ONE_LAUNCH_SUM = True
            rows.append(row)
            print(json.dumps(row), flush=True)
            layers, layer, linear = [], None, None
            torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


main()
