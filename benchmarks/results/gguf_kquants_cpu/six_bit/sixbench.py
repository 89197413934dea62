"""Q6_K in 6 bits against its 8-bit form, one layer at a time: 24 random Q6_K layers of
3072 x 1536 called in turn (weights streamed), one and five rows, 2 threads, the two forms
taking turns; best and median of 15 rounds. Run from the repository root."""
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
assert 6 in cpu_ops.weight_forms(), "the kernels here are not built for AVX-512 VNNI"
forms = {6: [], 8: []}
for i in range(LAYERS):
    decoded = decode(random_weight("Q6_K", ROWS, K, seed=i))
    for bits, form in ((6, decoded), (8, decoded.widened())):
        forms[bits].append((*pack(form), form.bits, form.group))
for m in (1, 5):
    x = torch.randn(m, K).bfloat16()
    assert torch.equal(cpu_ops.quant_linear(x, *forms[6][0], None, 0), cpu_ops.quant_linear(x, *forms[8][0], None, 0))

    def run(bits: int, x=x) -> float:
        start = time.perf_counter()
        for weight in forms[bits]:
            cpu_ops.quant_linear(x, *weight, None, 0)
        return (time.perf_counter() - start) / LAYERS * 1e6

    times = {6: [], 8: []}
    for _ in range(16):
        for bits in (8, 6):
            times[bits].append(run(bits))
    megabytes = {bits: sum(t.numel() * t.element_size() for w in forms[bits] for t in w[:3]) / LAYERS / 1e6
                 for bits in (6, 8)}
    median = {bits: statistics.median(times[bits][1:]) for bits in (6, 8)}
    print(f"Q6_K, {m} row(s): 8-bit form {min(times[8]):.0f} / {median[8]:.0f} us ({megabytes[8]:.2f} MB), "
          f"6-bit {min(times[6]):.0f} / {median[6]:.0f} us ({megabytes[6]:.2f} MB): {median[8] / median[6]:.3f}x",
          flush=True)
