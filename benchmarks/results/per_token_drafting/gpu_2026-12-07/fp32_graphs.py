"""Float32 on CUDA, which side moves with CUDA graphs: speculation off with graphs against off
eager, and the chain (k = 4) with graphs against both; per prompt, the first token that differs."""
from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

params = SamplingParams(temperature=0, max_tokens=64)
outs = {}
for name, eager, spec in (("off eager", True, {}), ("off graphs", False, {}),
                          ("chain graphs", False, {"speculative_method": "draft_model", "num_speculative_tokens": 4,
                                                       "speculative_adaptive": False}),
                          ("chain k=1 graphs", False, {"speculative_method": "draft_model", "num_speculative_tokens": 1,
                                                           "speculative_adaptive": False})):
    llm = LLM(device="cuda", dtype="float32", num_kv_blocks=1024, enforce_eager=eager, **spec)
    prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts("chat", 4))
    outs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


for name, tokens in outs.items():
    print(name, "vs off eager, first differing token per prompt:",
          [first_diff(a, b) for a, b in zip(tokens, outs["off eager"])], flush=True)
