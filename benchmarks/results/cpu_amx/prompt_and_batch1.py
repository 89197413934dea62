"""Prompt processing and batch-1 decoding of the default model (Q4_1 kept quantized) in
the tree it runs from (PYTHONPATH): the time to the first token of prompts of 128-2048
tokens (median of 5, prefix caching off), and batch-1 greedy decoding of 4 held-out chat
prompts (64 new tokens, speculation off and the default adaptive draft), tokens/s.

    PYTHONPATH=<tree> python prompt_and_batch1.py OUT.json
"""
import json
import statistics
import sys
import time

from specserve import LLM, SamplingParams
from specserve.bench.offline import load_workload, prompt_ids

out = {}
engine = LLM(speculative_method="none", enable_prefix_caching=False)
ids = list(range(1000, 3048))  # token ids of ordinary words, no special tokens
first = SamplingParams(temperature=0, max_tokens=1)
for length in (128, 512, 2048):
    times = []
    for _ in range(6):
        began = time.perf_counter()
        engine.generate([ids[:length]], first, use_tqdm=False)
        times.append(time.perf_counter() - began)
    out[f"ttft_{length}_ms"] = statistics.median(times[1:]) * 1e3
    print(f"prompt of {length}: {out[f'ttft_{length}_ms']:.0f} ms to the first token", flush=True)
reqs = prompt_ids(engine.engine, load_workload("chat", 4, output_len=64, tokenizer=engine.tokenizer))
greedy = SamplingParams(temperature=0, max_tokens=64)
for name, method in (("off", "none"), ("default", "draft_model")):
    e = engine if method == "none" else LLM(speculative_method=method)
    e.generate([reqs[0]], greedy, use_tqdm=False)  # warm
    tokens, seconds = 0, 0.0
    for r in reqs:
        began = time.perf_counter()
        result = e.generate([r], greedy, use_tqdm=False)[0]
        seconds += time.perf_counter() - began
        tokens += len(result.token_ids)
    out[f"batch1_{name}_tok_s"] = tokens / seconds
    print(f"batch 1, {name}: {tokens / seconds:.1f} tokens/s", flush=True)
with open(sys.argv[1], "w") as handle:
    json.dump(out, handle, indent=1)
