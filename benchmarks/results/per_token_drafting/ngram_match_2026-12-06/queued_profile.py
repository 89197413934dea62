"""32 held-out chat requests at once (128 tokens at most, EOS honoured) on one engine, after
8 others warmed it up, under cProfile: tokens/s, the draft lengths verified, and the step's
time against the speculator's host work. ``MODE``: off, or the n-gram engine's
draft_stopping (confidence, plan).

    python queued_profile.py MODE"""
import cProfile
import pstats
import sys
import time
from collections import Counter

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

mode = sys.argv[1]
llm = LLM(**({} if mode == "off" else {"speculative_method": "ngram", "draft_stopping": mode}))
prompts = chat_prompts(llm.tokenizer, held_out_prompts("chat", 40))
params = SamplingParams(temperature=0, max_tokens=128)
llm.generate(prompts[32:40], params, use_tqdm=False)
spec = llm.engine.speculator
before = Counter(spec.draft_length_counts)
profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
outs = llm.generate(prompts[:32], params, use_tqdm=False)
profile.disable()
seconds = time.perf_counter() - start
print(f"{mode}: {sum(len(o.token_ids) for o in outs) / seconds:.1f} tokens/s; request-steps by k verified: "
      f"{dict(sorted((k, n - before.get(k, 0)) for k, n in spec.draft_length_counts.items()))}")
pstats.Stats(profile).sort_stats("cumulative").print_stats(r"engine.py:\d+\(step\)|model_runner.py:\d+\(forward\)|"
                                                           r"speculator.py:\d+\((propose|learn|_choose)\)")
