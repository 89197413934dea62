"""What the GPU default's plan sees at batch 1: every fresh plan's prices, the request's
acceptance estimates and the k chosen; every choice's k; the goodput checks' verdicts."""
import collections
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import numpy as np
from workloads import run_cold

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.spec import controller as C

out = os.environ.get("OUT", "/tmp")
plans, ks, checks = [], collections.Counter(), collections.Counter()
orig_plan, orig_choose = C.DraftLengthController._plan, C.DraftLengthController.choose
def _plan(self, caps, *a, **kw):
    k, unforked, prices = orig_plan(self, caps, *a, **kw)
    rows = self.estimates.rows(list(caps)) if self.estimates is not None else None
    plans.append({"k": k.tolist(), "prices": [round(x * 1e6, 1) for x in (prices.fixed, prices.token, prices.span,
                  prices.padded_token, prices.draft_pass, prices.draft_token)],
                  "alpha": None if rows is None else np.round(self.estimates.alpha[rows][0], 3).tolist(),
                  "weight": None if rows is None or not hasattr(self.estimates, "weight") else round(float(self.estimates.weight[rows][0]), 3)})
    return k, unforked, prices
def choose(self, caps, *a, **kw):
    r = orig_choose(self, caps, *a, **kw)
    for v in r.values():
        ks[v] += 1
    c = self.last
    checks["checked" if c.checked else ("vetoed" if c.check is not None and c.check.vetoed else "ok")] += 1
    return r
C.DraftLengthController._plan, C.DraftLengthController.choose = _plan, choose
dev = os.environ.get("DEV", "cuda")
llm = LLM(device=dev, max_num_seqs=8, max_model_len=4096, speculative_method="draft_model",
          **({"gpu_memory_utilization": 0.15} if dev == "cuda" else {}))
tok = llm.engine.tokenizer
for kind in sys.argv[1].split(","):
    prompts = chat_prompts(tok, held_out_prompts(kind, int(os.environ.get("NP", "6"))))
    run_cold(llm, prompts[0], SamplingParams(temperature=0, max_tokens=16))
    plans.clear(); ks.clear(); checks.clear()
    tokens = secs = 0
    for p in prompts:
        r = run_cold(llm, p, SamplingParams(temperature=0, max_tokens=128))
        tokens += len(r.token_ids); secs += r.seconds
    print(f"{kind}: {tokens / secs:.1f} tok/s; k chosen {dict(sorted(ks.items()))}; checks {dict(checks)}; plans {len(plans)}")
    P = np.array([p["prices"] for p in plans])
    print("  prices us (fixed, token, span, padded_token, draft_pass, draft_token): median", np.median(P, 0).tolist(),
          "first", plans[0]["prices"], "last", plans[-1]["prices"])
    A = np.array([p["alpha"] for p in plans if p["alpha"]])
    if len(A):
        print("  alpha mean", np.round(A.mean(0), 3).tolist(), "std", np.round(A.std(0), 3).tolist())
    print("  plans' k", collections.Counter(p["k"][0] for p in plans))
    with open(f"{out}/plans_{kind}_{os.environ.get('TAG', 'x')}.json", "w") as f:
        json.dump(plans, f)
