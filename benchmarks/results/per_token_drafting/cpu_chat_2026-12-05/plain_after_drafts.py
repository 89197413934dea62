"""The target pass of plain steps after drafted ones: the adaptive engine forced into a pattern of three
choices with k = 4 and three with none (a choice is made a step ahead: the phases shift by one), against
speculation off in the same process; 4 held-out chat prompts, twice, batch 1, greedy, 128 tokens.

    python plain_after_drafts.py
"""
import statistics
import time

from specserve import LLM, SamplingParams
from specserve import engine as emod
from specserve import model_runner as mr
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.spec import controller as cmod

cnt = [0]
orig_choose = cmod.DraftLengthController.choose
def choose(self, caps, *a, **k):
    orig_choose(self, caps, *a, **k)  # (the controller still learns and plans)
    cnt[0] += 1
    if cnt[0] % 6 >= 3:
        self.stop = None
        return dict.fromkeys(caps, 0)
    return {r: 4 for r in caps}
cmod.DraftLengthController.choose = choose
ex = []
inner = mr.ModelRunner.execute
def execute(self, *a, **k):
    t = time.perf_counter(); out = inner(self, *a, **k); ex.append((self, time.perf_counter() - t)); return out
mr.ModelRunner.execute = execute
rec = []
inner_step = emod.LLMEngine.step
def step(self, *a, **k):
    ex.clear(); t = time.perf_counter(); out = inner_step(self, *a, **k)
    target = [s for r, s in ex if r is self.runner]
    rec.append((cnt[0] % 6, time.perf_counter() - t, sum(target)))
    return out
emod.LLMEngine.step = step
llm = LLM(speculative_method="draft_model", num_speculative_tokens=4, max_num_seqs=8, max_model_len=4096)
prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts("chat", 4))
for p in prompts * 2:
    llm.generate([p], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
for phase in range(6):
    rows = [r for r in rec if r[0] == phase]
    print(f"phase {phase} ({'plain' if phase >= 3 else 'drafted'}): {len(rows)} steps, step {statistics.median([r[1] for r in rows])*1e3:.2f} ms, target pass {statistics.median([r[2] for r in rows])*1e3:.2f} ms")
off = LLM(max_num_seqs=8, max_model_len=4096)
rec.clear()
for p in prompts * 2:
    off.generate([p], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
print(f"off: {len(rec)} steps, step {statistics.median([r[1] for r in rec])*1e3:.2f} ms, target pass {statistics.median([r[2] for r in rec])*1e3:.2f} ms")
rec.clear()
for p in prompts * 2:
    llm.generate([p], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
for phase in range(6):
    rows = [r for r in rec if r[0] == phase]
    print(f"again phase {phase}: {len(rows)} steps, step {statistics.median([r[1] for r in rows])*1e3:.2f} ms, target pass {statistics.median([r[2] for r in rows])*1e3:.2f} ms")
