"""Does exporting an EAGLE-3 head's taps (the inputs of target layers 2, 15 and 27) change
the target's greedy output in bf16 on the CPU? The default engine (the Q4_1 target, no
speculation), 16 held-out chat and 16 code prompts, 128 tokens, each generated with and
without the taps set on the target; the prefix cache emptied between.

    python taps_numerics.py
"""
from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import held_out_prompts
from specserve.training.data import encode_prompt

llm = LLM(max_num_seqs=1, max_model_len=1280)
tok = llm.engine.tokenizer
params = SamplingParams(temperature=0, max_tokens=128)
same = 0
prompts = [encode_prompt(tok, m) for kind in ("chat", "code") for m in held_out_prompts(kind, 16, 0)]
model = llm.engine.runner.model
for p in prompts:
    model.feature_layers = None
    a = llm.generate([p], params, use_tqdm=False)[0].token_ids
    llm.engine.kv.reset_prefix_cache()
    model.feature_layers = (2, 15, 27)
    b = llm.generate([p], params, use_tqdm=False)[0].token_ids
    llm.engine.kv.reset_prefix_cache()
    same += list(a) == list(b)
print("same with and without taps:", same, "of", len(prompts))
