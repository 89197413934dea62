"""Logs, per plan of the CPU default, the goodput it promises over the plan without drafts
(chat, 24 prompts, 2 requests/s then all at once, two rounds).

    python plan_gain.py chat
"""
import sys

import numpy as np

import specserve.spec.controller as C
from specserve import LLMEngine
from specserve.bench.arrivals import arrival_times
from specserve.bench.offline import prompt_ids, run_offline, warm_up
from specserve.bench.workloads import load_workload

log = []
inner = C.plan_draft_lengths
def wrapped(alpha, rate, cap, prices, passes, min_gain, *a, **kw):
    k, chain, ratio = inner(alpha, rate, cap, prices, passes, min_gain, *a, **kw)
    n = alpha.shape[0]
    base = n / max(prices.plain or prices.fixed, 1e-9)
    log.append((n, int(k.sum()), ratio / base, prices.plain > 0, PHASE[0]))
    return k, chain, ratio
C.plan_draft_lengths = wrapped
PHASE = ["warm"]
wl = sys.argv[1] if len(sys.argv) > 1 else "chat"
e = LLMEngine(speculative_method="draft_model")
reqs = load_workload(wl, 24, output_len=128, tokenizer=e.tokenizer)
ids = prompt_ids(e, reqs)
warm_up(e, reqs, ids, num_requests=4)
for rnd in range(2):
    PHASE[0] = f"r{rnd} rate2"
    r = run_offline(e, reqs, token_ids=ids, progress=False, arrivals=arrival_times(24, 2.0))
    PHASE[0] = f"r{rnd} inf"
    r = run_offline(e, reqs, token_ids=ids, progress=False)
    print(rnd, r["output_throughput"])
for ph in sorted({p for *_, p in log}):
    rows = [l for l in log if l[4] == ph]
    for lo, hi in ((1, 4), (4, 8), (8, 16), (16, 64)):
        sel = [l for l in rows if lo <= l[0] < hi]
        dr = [l for l in sel if l[1] > 0]
        if sel:
            print(ph, f"batch {lo}-{hi-1}: plans {len(sel)}, drafting {len(dr)}, predicted gain of drafting plans: "
                  f"median {np.median([l[2] for l in dr]) if dr else float('nan'):.3f} "
                  f"q10 {np.quantile([l[2] for l in dr], 0.1) if dr else float('nan'):.3f} measured bar {sum(l[3] for l in dr)}")
