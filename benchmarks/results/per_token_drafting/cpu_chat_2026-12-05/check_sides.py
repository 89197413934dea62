"""What the goodput check's two sides see on chat (batch 1, the CPU default): each step's
emitted tokens and seconds as ``observe_goodput`` receives them, drafted and plain (its checks),
beside speculation off's tokens/s in the same process.

    python check_sides.py
"""
import statistics

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.spec import controller as cmod

log = []
orig = cmod.DraftLengthController.observe_goodput
def obs(self, num_tokens, seconds, choice=None, backlog_s=0.0):
    c = choice or self.last
    log.append((c.drafted, c.checked, c.check is not None, num_tokens, seconds, backlog_s))
    return orig(self, num_tokens, seconds, choice, backlog_s)
cmod.DraftLengthController.observe_goodput = obs
llm = LLM(speculative_method="draft_model", num_speculative_tokens=4, max_num_seqs=8, max_model_len=4096)
off = LLM(max_num_seqs=8, max_model_len=4096)
prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts("chat", 4))
import time

for name, l in (("off", off), ("adaptive", llm), ("off", off), ("adaptive", llm)):
    t = time.perf_counter(); n = 0
    for p in prompts:
        n += len(l.generate([p], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)[0].token_ids)
    print(name, f"{n / (time.perf_counter() - t):.1f} tok/s")
for drafted in (True, False):
    rows = [r for r in log if r[0] == drafted and r[2]]
    if rows:
        secs = [r[4] for r in rows]
        print("drafted" if drafted else "plain", len(rows), f"median {statistics.median(secs)*1e3:.2f} ms",
              f"tokens/step {sum(r[3] for r in rows)/len(rows):.2f}", f"goodput {sum(r[3] for r in rows)/sum(secs):.0f}",
              "checked", sum(r[1] for r in rows), "backlog", f"{sum(r[5] for r in rows)*1e3:.1f} ms")
plain = [r for r in log if not r[0] and r[2]]
print("plain steps (ms):", " ".join(f"{r[4]*1e3:.1f}" for r in plain[:40]))
