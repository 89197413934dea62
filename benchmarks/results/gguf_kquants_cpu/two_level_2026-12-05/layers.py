"""K-quant layers on the CPU with two-level scales (an int8 a group, a float32 factor a
super-block) against the same layers with float32 products (the form before), in one
process: microseconds per call at 1 and 5 rows, cycling through enough copies of each layer
that no call finds its weight in cache, and the bytes a call reads.

    PYTHONPATH=.:tests python layers.py [--n 4096] [--k 4096] [--copies 24] [--threads 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
from specserve.kernels import cpu_ops
from tiny_models import (
    random_gguf_weight as random_weight,  # the tests' random GGUF blocks
)

from specserve.models.quantized import QuantLinear


def nbytes(layer: QuantLinear) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.packed, layer.scales, layer.mins))


def timed(layers: list[QuantLinear], x: torch.Tensor, rounds: int) -> float:
    """Median µs per call over ``rounds`` passes through every copy."""
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for layer in layers:
            layer(x)
        times.append((time.perf_counter() - began) / len(layers) * 1e6)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--copies", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kinds", default="Q4_K,Q5_K,Q6_K,Q3_K,Q2_K,IQ4_XS")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_ops.two_level_scales(), "this build takes no two-level scales (not built for AVX-512 VNNI)"
    results = []
    print(f"{args.n} x {args.k}, {args.copies} copies, {args.threads} threads; µs per call (median of "
          f"{args.rounds} passes), bits a weight read")
    for kind in args.kinds.split(","):
        weight = random_weight(kind, args.n, args.k)
        forms = {}
        two = QuantLinear([(0, weight)], args.k, args.n, None)
        real = cpu_ops.two_level_scales
        cpu_ops.two_level_scales = lambda: False
        try:
            products = QuantLinear([(0, weight)], args.k, args.n, None)
        finally:
            cpu_ops.two_level_scales = real
        assert two.scales.dtype == torch.uint8 and products.scales.dtype == torch.float32, kind
        for name, layer in (("float32 products", products), ("two-level", two)):
            layer.dequant_rows = 0  # the integer kernel at these rows, as a decode or verify step runs it
            forms[name] = [layer] + [copy.deepcopy(layer) for _ in range(args.copies - 1)]
        row = {"kind": kind, "bits": {n: 8 * nbytes(ls[0]) / (args.n * args.k) for n, ls in forms.items()}}
        for rows in (1, 5):
            x = torch.randn(rows, args.k).bfloat16()
            assert torch.equal(forms["two-level"][0](x), forms["float32 products"][0](x)), kind  # the same bits
            for name, layers in list(forms.items()) * 2:  # taking turns, twice
                timed(layers, x, 1)  # warm
                row.setdefault(f"{rows} rows", {}).setdefault(name, []).append(timed(layers, x, args.rounds))
        results.append(row)
        print(f"{kind}: bits {row['bits']['float32 products']:.2f} -> {row['bits']['two-level']:.2f}; " + "; ".join(
            f"{r}: " + ", ".join(f"{n} {', '.join(f'{v:.0f}' for v in vs)}" for n, vs in row[r].items())
            for r in ("1 rows", "5 rows")), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
