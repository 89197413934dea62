"""Float32 on CUDA with graphs, the chain (k = 4) against off eager, with the draft's feed
on its own stream or not and replayed on the target's inputs or not."""
from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

params = SamplingParams(temperature=0, max_tokens=64)
off = LLM(device="cuda", dtype="float32", num_kv_blocks=1024, enforce_eager=True)
prompts = chat_prompts(off.engine.tokenizer, held_out_prompts("chat", 4))
want = [o.token_ids for o in off.generate(prompts, params, use_tqdm=False)]
for own_stream, shares in ((True, True), (False, True), (True, False), (False, False)):
    llm = LLM(device="cuda", dtype="float32", num_kv_blocks=1024, speculative_method="draft_model",
              num_speculative_tokens=4, speculative_adaptive=False)
    drafter = llm.engine.speculator.drafter
    drafter.own_stream, drafter.shares_target_inputs = own_stream, shares
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    print(f"own_stream={own_stream} shares_target_inputs={shares}: first differing token per prompt",
          [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, want)], flush=True)
