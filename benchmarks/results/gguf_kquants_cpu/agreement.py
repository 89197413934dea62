"""Each requantized file run quantized by specserve (float32 activations) against
transformers on the same file's dequantised weights (float32): over greedy answers to 4
held-out chat prompts, how often transformers' next-token choice, teacher-forced on
specserve's answer, is the token specserve chose (int16 activations are the only
difference), and how many tokens the two greedy answers share before they first differ.

    python agreement.py DIR KIND[,KIND...]
"""
import sys

import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
from specserve.loader import default_model_gguf, resolve_model

directory, kinds = sys.argv[1], sys.argv[2].split(",")
for kind in kinds:
    path = str(default_model_gguf()) if kind == "Q4_1" else f"{directory}/SmolLM2-135M-Instruct.{kind}.gguf"
    llm = LLM(path, dtype="float32", max_num_seqs=4)
    assert llm.engine.quantized_weights
    prompts = chat_prompts(llm.tokenizer, held_out_prompts("chat", 4))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(path).path, dtype=torch.float32).eval()
    agree = total = shared = 0
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1].argmax(-1).tolist()
        same = [w == t for w, t in zip(want, out.token_ids)]
        agree += sum(same)
        total += len(same)
        shared += next((i for i, s in enumerate(same) if not s), len(same))
    formats = sorted({f for m in llm.engine.runner.model.modules() for f in getattr(m, "formats", ())})
    print(f"{kind}: formats {'+'.join(formats)}; transformers' choice agrees at {agree}/{total} positions; "
          f"the greedy answers share their first {shared / len(outs):.1f} tokens on average", flush=True)
    llm.close()
