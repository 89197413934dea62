"""Where the CPU default loses to speculation off on chat with 24 requests queued (2026-12-04):
per run, the steps that drafted and what they took, and the lazily fed draft's backlog passes
(a request's unfed tokens caught up at its first drafts in a while), off and the default
taking turns.

    python backlog.py
"""
import statistics

from specserve import LLMEngine
from specserve.bench.offline import load_workload, prompt_ids, run_offline, warm_up
from specserve.spec import speculator as S

LOG = []
orig = S.Speculator._learn_cost
def _learn_cost(self, choice, drafts, emitted, elapsed):
    LOG.append((elapsed, drafts.backlog_s, drafts.drafted, len(drafts.scheduled.scheduled)))
    return orig(self, choice, drafts, emitted, elapsed)
S.Speculator._learn_cost = _learn_cost
off = LLMEngine(speculative_method="none")
ad = LLMEngine(speculative_method="draft_model")
reqs = load_workload("chat", 24, output_len=128, tokenizer=off.tokenizer)
ids = prompt_ids(off, reqs)
for e in (off, ad):
    warm_up(e, reqs, ids, num_requests=4)
for r in range(3):
    for name, e in ((("off", off), ("ad", ad)) if r % 2 == 0 else (("ad", ad), ("off", off))):
        LOG.clear()
        run = run_offline(e, reqs, token_ids=ids, progress=False, label=name)
        if name == "ad":
            total = sum(x[0] for x in LOG); bl = sum(x[1] for x in LOG)
            dr = [x for x in LOG if x[2]]
            blsteps = [x for x in LOG if x[1] > 0]
            print(f"round {r} ad {run['output_throughput']:.1f} tok/s steps {len(LOG)} drafted {len(dr)} "
                  f"time {total:.2f}s backlog {bl:.2f}s in {len(blsteps)} steps; drafted steps {sum(x[0] for x in dr):.2f}s "
                  f"plain median {1e3*statistics.median([x[0] for x in LOG if not x[2] and not x[1]] or [0]):.1f} ms", flush=True)
        else:
            print(f"round {r} off {run['output_throughput']:.1f} tok/s", flush=True)
