"""Controlled: a step of B requests, each drafting k (verify pass), and draft passes over n rows,
timed; beside the cost model's prices after the start-up profile."""
import statistics
import sys
import time

from specserve import LLMEngine, SamplingParams
from specserve.scheduler import ScheduledRequest, SchedulerOutput

e = LLMEngine(speculative_method="draft_model")
sp = e.speculator
ctl = sp.controller
kv = sp.kv
runner = sp.runner
greedy = SamplingParams(temperature=0)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 24
context = int(sys.argv[2]) if len(sys.argv) > 2 else 160
ids = [f"m{i}" for i in range(B)]
for i in ids:
    assert kv.allocate_slots(i, context + 1 + 8)
def step_of(ks):
    return SchedulerOutput([ScheduledRequest(i, [0], context, list(kv.block_table(i)), greedy, num_lookahead=k,
                                             draft_token_ids=[0] * k) for i, k in zip(ids, ks)], [])
def t_target(ks, reps=7):
    st = step_of(ks); ts = []
    for _ in range(reps):
        t = time.perf_counter(); runner.execute(st).argmax(-1).tolist(); ts.append(time.perf_counter() - t)
    return statistics.median(ts[1:]) * 1e3, st
costs = ctl.costs
th = costs.target.theta
print("target theta", [round(x * 1e3, 3) for x in th])
print("draft theta (o, d, e) ms", [round(x * 1e3, 3) for x in costs.draft.theta], "padded?", runner.device.type)
for ks in ([0] * B, [1] * B, [2] * B, [3] * B, [4] * B, [1] * (B // 2) + [0] * (B - B // 2), [4] * (B // 4) + [0] * (B - B // 4)):
    ms, st = t_target(ks)
    tokens = B + sum(ks); spans = sum(1 for k in ks if k)
    padded = runner.padded_tokens(st)
    pred = costs.target.predict(costs.features(tokens, B, B * (context + 1) + sum(ks), spans, padded, 0)) * 1e3
    print(f"ks sum {sum(ks):3d} max {max(ks)} rows {tokens:3d} padded {padded:3d}: measured {ms:6.1f} ms predicted {pred:6.1f}")
d = sp.drafter
for n in (B, B // 2, B // 4, 1):
    st = step_of([0] * B)
    sched = st.scheduled[:n]
    ts = [d.time_pass(sched, 4) for _ in range(5)]
    o, dd, ee = costs.draft.theta
    print(f"draft pass over {n:2d} rows: measured {statistics.median(ts)*1e3:5.2f} ms, priced d + e n = {(dd + ee * n)*1e3:5.2f}")
