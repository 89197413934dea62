"""Float32 on CUDA: does speculative greedy decoding equal plain greedy? Chain, two paths and
a tree, with and without CUDA graphs, 4 held-out chat prompts, 64 tokens."""
import sys

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

params = SamplingParams(temperature=0, max_tokens=64)
for eager in (False, True):
    base = LLM(device="cuda", dtype="float32", num_kv_blocks=1024, enforce_eager=eager)
    prompts = chat_prompts(base.engine.tokenizer, held_out_prompts("chat", 4))
    want = [o.token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    del base
    for i, extra in enumerate(({}, {"num_draft_paths": 2}, {"draft_tree_nodes": 3})):
        llm = LLM(device="cuda", dtype="float32", num_kv_blocks=1024, enforce_eager=eager,
                  speculative_method="draft_model", num_speculative_tokens=4, speculative_adaptive=False, **extra)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.engine.spec_stats
        print(f"eager={eager} {extra or 'chain'}: same {sum(a == b for a, b in zip(got, want))}/4, "
              f"acceptance {1 + s.num_accepted_tokens / max(s.num_drafts, 1):.2f}", flush=True)
    sys.stdout.flush()
