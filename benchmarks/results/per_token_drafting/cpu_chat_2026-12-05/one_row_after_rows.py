"""Which multi-row work slows speculation off's next one-row pass? Between off's steps,
run the target's own quantized projections (every layer's, or the LM head) on 1 or 5 rows
of random activations, and time the step's target pass (its one-row passes only); held-out
code prompts (the chat template), batch 1, greedy, 64 tokens, the settings taking turns, twice.

    python one_row_after_rows.py
"""
import statistics
import time

import torch

from specserve import LLM, SamplingParams
from specserve import engine as emod
from specserve import model_runner as mr
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

llm = LLM(max_num_seqs=8, max_model_len=4096)
model = llm.engine.runner.model
layers = [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                       layer.mlp.gate_up_proj, layer.mlp.down_proj)]
setting = {"work": None}
inputs = {}


def work(modules, rows):
    with torch.inference_mode():
        for m in modules:
            key = (m.in_features, rows)
            if key not in inputs:
                inputs[key] = torch.randn(rows, m.in_features, dtype=torch.bfloat16)
            m(inputs[key])


SETTINGS = {"nothing": None,
            "every layer's projections, 1 row": lambda: work(layers, 1),
            "every layer's projections, 5 rows": lambda: work(layers, 5),
            "the LM head, 1 row": lambda: work([model.lm_head], 1),
            "the LM head, 5 rows": lambda: work([model.lm_head], 5)}
times = {name: [] for name in SETTINGS}
inner = mr.ModelRunner.execute
def execute(self, output, *a, **k):
    t = time.perf_counter(); out = inner(self, output, *a, **k); s = time.perf_counter() - t
    if sum(len(p.token_ids) for p in output.scheduled) == 1:
        times[setting["name"]].append(s)
    return out
mr.ModelRunner.execute = execute
inner_step = emod.LLMEngine.step
def step(self, *a, **k):
    if setting["work"] is not None:
        setting["work"]()
    return inner_step(self, *a, **k)
emod.LLMEngine.step = step
prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts("code", 4))
params = SamplingParams(temperature=0, max_tokens=64)
for _round in range(2):
    for name, fn in SETTINGS.items():
        setting.update(name=name, work=fn)
        for p in prompts:
            llm.generate([p], params, use_tqdm=False)
for name, t in times.items():
    print(f"between steps: {name}: {len(t)} one-row passes, median {statistics.median(t) * 1e3:.2f} ms")
