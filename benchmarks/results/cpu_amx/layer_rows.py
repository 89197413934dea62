"""The default model's quantized projections (all 121 of them, Q4_1 layers and the Q8_0
LM head; bf16 activations) at a given number of rows: the integer kernel against the
weights unpacked onto AMX tiles (or, without AMX, for ATen's GEMM), each call once per
pass, 7 passes taking turns; ms per pass (min, median). Weights are cold: a pass reads
~105 MB, more than the caches hold.

    python layer_rows.py 1,8,16,24,32,64,256
"""
import statistics
import sys
import time

import torch
from specserve.kernels import cpu_ops

from specserve import LLMEngine
from specserve.bench.cli import describe_machine
from specserve.models.quantized import QuantLinear

engine = LLMEngine(speculative_method="none")
AMX = getattr(cpu_ops, "amx_tiles", lambda: False)()  # (the tree before them has no such function)
layers = [m for m in engine.runner.model.modules() if isinstance(m, QuantLinear)]
print(f"{describe_machine()}, {torch.get_num_threads()} threads, {len(layers)} layers, AMX tiles: {AMX}")
inputs = {}


def one_pass(rows: int, dequant_rows: int) -> float:
    xs = inputs.setdefault(rows, [torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in layers])
    began = time.perf_counter()
    for x, m in zip(xs, layers):
        cpu_ops.quant_linear(x, m.packed, m.scales, m.mins, m.bits, m.group, m.bias, dequant_rows)
    return time.perf_counter() - began


print("| rows | integer kernel, ms (min / median) | unpacked, ms (min / median) |")
print("| ---: | ---: | ---: |")
for rows in (int(r) for r in sys.argv[1].split(",")):
    integer, unpacked = [], []
    for _ in range(7):
        integer.append(one_pass(rows, 0))
        unpacked.append(one_pass(rows, 1))
    print(f"| {rows} | {min(integer) * 1e3:.1f} / {statistics.median(integer) * 1e3:.1f} | "
          f"{min(unpacked) * 1e3:.1f} / {statistics.median(unpacked) * 1e3:.1f} |", flush=True)
