"""Speculation off's target pass when this many MB of other memory are touched
between steps (0, 16, 32, 64, 0): how much of the pass's speed is the weights staying in cache.

    python memory_between_steps.py
"""
import statistics
import time

import torch

from specserve import LLM, SamplingParams
from specserve import engine as emod
from specserve import model_runner as mr
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

ex = []
inner = mr.ModelRunner.execute
def execute(self, *a, **k):
    t = time.perf_counter(); out = inner(self, *a, **k); ex.append(time.perf_counter() - t); return out
mr.ModelRunner.execute = execute
junk = {"mb": 0}
buf = torch.zeros(64 * 2**20, dtype=torch.uint8)
inner_step = emod.LLMEngine.step
def step(self, *a, **k):
    if junk["mb"]:
        buf[: junk["mb"] * 2**20].add_(1)  # touch this many MB between steps
    return inner_step(self, *a, **k)
emod.LLMEngine.step = step
off = LLM(max_num_seqs=8, max_model_len=4096)
prompts = chat_prompts(off.engine.tokenizer, held_out_prompts("chat", 4))
for mb in (0, 16, 32, 64, 0):
    junk["mb"] = mb; ex.clear()
    for p in prompts:
        off.generate([p], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
    print(f"off, {mb} MB touched between steps: target pass median {statistics.median(ex)*1e3:.2f} ms")
