"""Median time of a target verify pass of 1 + d rows (one request, 256 tokens of context), d = 0..6."""
import statistics
import sys
import time

from specserve import LLM, SamplingParams
from specserve.scheduler import ScheduledRequest, SchedulerOutput

llm = LLM(device="cpu", speculative_method="none")
e = llm.engine
kv, runner = e.kv if hasattr(e, "kv") else e.scheduler.kv, e.runner
greedy = SamplingParams(temperature=0)
ctx = 256
res = []
for d in range(7):
    assert kv.allocate_slots("p", ctx + 1 + d)
    step = SchedulerOutput([ScheduledRequest("p", [5], ctx, list(kv.block_table("p")), greedy, num_lookahead=d, draft_token_ids=[7] * d)], [])
    for _ in range(5): runner.execute(step).argmax(-1).tolist()
    ts = []
    for _ in range(40):
        s = time.perf_counter(); runner.execute(step).argmax(-1).tolist(); ts.append(time.perf_counter() - s)
    kv.free("p")
    res.append(statistics.median(ts) * 1e3)
print(sys.argv[1], " ".join(f"{1+d}:{t:.2f}" for d, t in enumerate(res)))
