"""Minor page faults and the target pass per step: the adaptive engine forced into 3 choices
with k = 4, then PERIOD - 3 with none (a choice is made a step ahead: phases 1-3 are the
drafted steps, 4 … PERIOD - 1 and 0 the plain ones), against speculation off, 4 held-out
chat prompts, two rounds.

    python plain_run_recovery.py [PERIOD]
"""
import resource
import statistics
import sys
import time

from specserve import LLM, SamplingParams
from specserve import engine as emod
from specserve import model_runner as mr
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.spec import controller as cmod

PERIOD = int(sys.argv[1]) if len(sys.argv) > 1 else 12
cnt = [0]
orig_choose = cmod.DraftLengthController.choose
def choose(self, caps, *a, **k):
    orig_choose(self, caps, *a, **k)
    cnt[0] += 1
    if cnt[0] % PERIOD >= 3:
        self.stop = None
        return dict.fromkeys(caps, 0)
    return {r: 4 for r in caps}
cmod.DraftLengthController.choose = choose
ex = []
inner = mr.ModelRunner.execute
def execute(self, *a, **k):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter(); out = inner(self, *a, **k)
    ex.append((self, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)); return out
mr.ModelRunner.execute = execute
rec = []
inner_step = emod.LLMEngine.step
def step(self, *a, **k):
    ex.clear(); out = inner_step(self, *a, **k)
    target = [(s, f) for r, s, f in ex if r is self.runner]
    rec.append((cnt[0] % PERIOD, sum(s for s, _ in target), sum(f for _, f in target)))
    return out
emod.LLMEngine.step = step
llm = LLM(speculative_method="draft_model", num_speculative_tokens=4, max_num_seqs=8, max_model_len=4096)
off = LLM(max_num_seqs=8, max_model_len=4096)
prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts("chat", 4))
for name, engine in (("pattern", llm), ("off", off), ("pattern", llm), ("off", off)):
    rec.clear()
    for p in prompts:
        engine.generate([p], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
    if name == "off":
        print(f"off: target pass {statistics.median([r[1] for r in rec])*1e3:.2f} ms, faults {statistics.mean([r[2] for r in rec]):.0f}")
    else:
        print("pattern, by phase (pass ms / faults):", " ".join(
            f"{ph}:{statistics.median([r[1] for r in rec if r[0] == ph])*1e3:.2f}/{statistics.mean([r[2] for r in rec if r[0] == ph]):.0f}"
            for ph in range(PERIOD)))
