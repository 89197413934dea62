"""Is a one-row target pass slower after a multi-row verify pass, without a draft model?
Prompt lookup (n-gram, fixed k = 4) verifies 1 + k rows where the context repeats and one
row where it does not, in one engine: its one-row passes after a one-row pass against
those right after a verify pass, beside speculation off's one-row passes and a
draft-model engine's (fixed k = 4: every decode step verifies). Held-out code prompts
(the chat template), batch 1, greedy, 128 tokens, each engine over the prompts twice,
taking turns.

    python one_row_after_verify.py
"""
import itertools
import statistics
import time

from specserve import LLM, SamplingParams
from specserve import model_runner as mr
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

log = []  # (engine label, rows of the target's pass, seconds)
label = [""]
inner = mr.ModelRunner.execute
targets = set()
def execute(self, output, *a, **k):
    t = time.perf_counter(); out = inner(self, output, *a, **k); s = time.perf_counter() - t
    if id(self) in targets:
        rows = sum(len(p.token_ids) + len(p.draft_token_ids) for p in output.scheduled)
        log.append((label[0], rows, s))
    return out
mr.ModelRunner.execute = execute
engines = {"off": LLM(max_num_seqs=8, max_model_len=4096),
           "ngram k=4": LLM(speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False,
                            max_num_seqs=8, max_model_len=4096),
           "draft k=4": LLM(speculative_method="draft_model", num_speculative_tokens=4, speculative_adaptive=False,
                            max_num_seqs=8, max_model_len=4096)}
for llm in engines.values():
    targets.add(id(llm.engine.runner))
prompts = chat_prompts(engines["off"].engine.tokenizer, held_out_prompts("code", 4))
params = SamplingParams(temperature=0, max_tokens=128)
for _round in range(2):
    for name, llm in engines.items():
        label[0] = name
        for p in prompts:
            llm.generate([p], params, use_tqdm=False)
for name in engines:
    passes = [(r, s) for n, r, s in log if n == name]
    after = {"after a one-row pass": [], "after a verify pass (2+ rows)": []}
    for (prev, _), (rows, s) in itertools.pairwise(passes):
        if rows == 1 and prev < 20:  # (not after a prompt's pass)
            after["after a one-row pass" if prev == 1 else "after a verify pass (2+ rows)"].append(s)
    verify = [s for r, s in passes if 2 <= r <= 5]
    line = ", ".join(f"{k}: {len(v)} passes, median {statistics.median(v) * 1e3:.2f} ms" for k, v in after.items() if v)
    print(f"{name}: one-row passes {line}; verify passes (2-5 rows) {len(verify)}"
          + (f", median {statistics.median(verify) * 1e3:.2f} ms" if verify else ""))
