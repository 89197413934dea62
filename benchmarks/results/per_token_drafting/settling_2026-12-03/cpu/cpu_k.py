"""The CPU default's verified k and the drafter's fitted prices, chat then code, one engine
(run with each checkout's interpreter, the checkout as the argument)."""
import collections
import sys

sys.path.insert(0, sys.argv[1] + "/benchmarks")
from workloads import run_cold

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

llm = LLM(speculative_method="draft_model")
ctl = llm.engine.speculator.controller
print("seed theta draft", ctl.costs.draft.theta, "target", ctl.costs.target.theta.round(5))
for kind in ("chat", "code"):
    prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts(kind, 6))
    run_cold(llm, prompts[0], SamplingParams(temperature=0, max_tokens=16))
    counts = collections.Counter(); tok = sec = 0
    for p in prompts:
        r = run_cold(llm, p, SamplingParams(temperature=0, max_tokens=128))
        counts.update(r.steps); tok += len(r.token_ids); sec += r.seconds
    print(kind, f"{tok/sec:.1f} tok/s", dict(sorted(counts.items())), "draft theta", ctl.costs.draft.theta, "target", ctl.costs.target.theta.round(5))
