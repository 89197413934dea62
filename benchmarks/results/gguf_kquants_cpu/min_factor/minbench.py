"""Mins as a factor against a float16/float32 min per group, one layer at a time: the same
layers (Q8_0, Q4_0, Q5_0, Q6_K; 3072 x 1536, random blocks), one row, 2 threads, weights
streamed (24 layers of each kind, called in turn); the two forms take turns, best and
median of 15 rounds. Run from the repository root."""
import statistics
import sys
import time

import torch

sys.path.insert(0, "tests")
from specserve.kernels import cpu_ops
from test_quantized import random_weight

from specserve.models.quantized import decode, pack

torch.set_num_threads(2)
ROWS, K, LAYERS = 3072, 1536, 24


def layers_of(kind: str) -> list[tuple]:
    out = []
    for i in range(LAYERS):
        decoded = decode(random_weight(kind, ROWS, K, seed=i))
        if decoded.bits not in cpu_ops.weight_forms():
            decoded = decoded.widened()
        packed, scales, factor = pack(decoded)
        assert factor.dim() == 0
        mins = (scales.float() * factor).to(scales.dtype)  # the per-group form: the same values
        assert torch.equal(mins.float(), scales.float() * factor)
        out.append((packed, scales, factor, mins, decoded.bits, decoded.group))
    return out


for kind in ("Q8_0", "Q4_0", "Q5_0", "Q6_K"):
    weights = layers_of(kind)
    x = torch.randn(1, K).bfloat16()

    def run(factor_form: bool, weights=weights, x=x) -> float:
        start = time.perf_counter()
        for packed, scales, factor, mins, bits, group in weights:
            cpu_ops.quant_linear(x, packed, scales, factor if factor_form else mins, bits, group, None, 0)
        return (time.perf_counter() - start) / LAYERS * 1e6

    run(False)
    run(True)
    times = {False: [], True: []}
    for _ in range(15):
        for form in (False, True):
            times[form].append(run(form))
    megabytes = {form: sum(p.numel() + s.numel() * s.element_size() + (0 if form else m.numel() * m.element_size())
                           for p, s, _, m, *_ in weights) / LAYERS / 1e6 for form in (False, True)}
    median = {form: statistics.median(times[form]) for form in (False, True)}
    print(f"{kind}: per-group mins {min(times[False]):.0f} / {median[False]:.0f} us ({megabytes[False]:.2f} MB), "
          f"factor {min(times[True]):.0f} / {median[True]:.0f} us ({megabytes[True]:.2f} MB): "
          f"{median[False] / median[True]:.3f}x", flush=True)
