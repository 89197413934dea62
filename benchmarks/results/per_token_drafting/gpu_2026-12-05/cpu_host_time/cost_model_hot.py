"""One cost-model update (``CostModel.observe`` with its solves as they come), timed hot in
a loop on random 10-feature samples, beside ``adaptive_host_time.py``'s in-engine figures.

    python cost_model_hot.py > cost_model_hot.txt
"""
import timeit

import numpy as np

from specserve.spec.cost_model import CostModel

model = CostModel(10)
rng = np.random.default_rng(0)
samples = [list(rng.random(10)) for _ in range(200)]
truth = np.arange(10) + 1.0
for x in samples[:50]:
    model.observe(x, float(np.dot(x, truth)))
count = [0]


def one() -> None:
    x = samples[count[0] % len(samples)]
    count[0] += 1
    model.observe(x, float(np.dot(x, truth)))


n = 2000
print(f"CostModel.observe: {timeit.timeit(one, number=n) / n * 1e6:.1f} us a call (solves included)")
print(f"CostModel.solve: {timeit.timeit(model.solve, number=500) / 500 * 1e6:.1f} us a call")
