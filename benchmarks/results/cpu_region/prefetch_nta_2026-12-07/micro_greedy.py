"""The greedy argmax op and the check before it, called in a loop on one [1, 49152] float32
row (the default model's vocabulary), hot in cache: what they cost outside an engine step."""
import time

import torch
from specserve.kernels import cpu_ops

from specserve import sampler

cpu_ops.available()
x = torch.randn(1, 49152)
for name, f in [("check (sampler._cpu_greedy)", lambda: sampler._cpu_greedy(x)),
                ("greedy_rows op", lambda: torch.ops.specserve_cpu.greedy_rows(x, False)),
                ("greedy_tokens(...).tolist()", lambda: sampler.greedy_tokens(x).tolist())]:
    for _ in range(100):
        f()
    start = time.perf_counter()
    for _ in range(2000):
        f()
    print(f"{name}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us")
