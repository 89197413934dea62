"""Target verify pass time at batch 1 by drafts verified (0..6), and a draft pass."""
import statistics
import time

from specserve import LLM, SamplingParams
from specserve.scheduler import ScheduledRequest, SchedulerOutput

llm = LLM(speculative_method="draft_model", num_speculative_tokens=4, max_num_seqs=8, max_model_len=4096)
eng = llm.engine
runner, kv = eng.runner, eng.kv
greedy = SamplingParams(temperature=0)
ctx = 200
res = {}
for rep in range(3):
  for d in range(7):
    rid = f"p{d}"
    kv.allocate_slots(rid, ctx + 1 + d)
    step = SchedulerOutput([ScheduledRequest(rid, [5], ctx, list(kv.block_table(rid)), greedy, num_lookahead=d,
                                             draft_token_ids=[7] * d)], [])
    times = []
    for _ in range(30):
        t = time.perf_counter(); runner.execute(step).argmax(-1).tolist(); times.append(time.perf_counter() - t)
    res.setdefault(d, []).append(statistics.median(times[5:]) * 1e3)
    kv.free(rid)
for d, v in res.items():
    print(f"verify 1+{d} rows: median {min(v):.3f} ms (runs {', '.join(f'{x:.3f}' for x in v)})")
