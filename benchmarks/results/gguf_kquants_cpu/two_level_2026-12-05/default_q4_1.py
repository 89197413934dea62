"""The default model from its Q4_1 GGUF (kept quantized), batch 1, speculation off: tokens/s
over 4 held-out chat prompts, 128 new tokens each (end of sequence ignored), after a warm-up.
Run from outside the repository with PYTHONPATH at the checkout to time (its own
TORCH_EXTENSIONS_DIR), the label as argument:

    cd /tmp && PYTHONPATH=/path/to/checkout python default_q4_1.py new
"""
import sys
import time

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

llm = LLM(max_num_seqs=1, max_model_len=2048)
prompts = chat_prompts(llm.engine.tokenizer, held_out_prompts("chat", 4))
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
began = time.perf_counter()
tokens = sum(len(llm.generate([p], params, use_tqdm=False)[0].token_ids) for p in prompts)
print(sys.argv[1], f"{tokens / (time.perf_counter() - began):.1f} tokens/s")
