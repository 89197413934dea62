"""Why the EAGLE-3 engine's bf16 greedy output differs from speculation off's on a few
held-out prompts where the built-in draft's never does: the prefix cache. 16 held-out
prompts of each kind, in turn, through speculation off, the EAGLE-3 head and the built-in
draft (k = 4 fixed, the CPU default's Q4_1 target, bf16), with prefix caching on (the
prompts share the chat template's system prompt, so each engine reuses cached blocks) and
off. Per prompt that differs: the first differing token and the prompt tokens each engine
took from its cache.

    python same_as_off.py HEAD_DIR
"""
import sys
from collections import Counter

import torch

from specserve import LLM, SamplingParams
from specserve.bench.prompt_sets import chat_prompts, held_out_prompts


def first_difference(a, b):
    return next((j for j, (u, v) in enumerate(zip(a, b)) if u != v), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    head = sys.argv[1]
    params = SamplingParams(temperature=0, max_tokens=128)
    print(f"head {head}; CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, bf16")
    for caching in (True, False):
        common = {"device": "cpu", "dtype": "bfloat16", "max_num_seqs": 64, "max_model_len": 4096,
                  "speculative_adaptive": False, "enable_prefix_caching": caching}
        engines = {"off": LLM(**common),
                   "eagle3": LLM(speculative_method="draft_model", draft_model=head, num_speculative_tokens=4,
                                 **common),
                   "built-in": LLM(speculative_method="draft_model", num_speculative_tokens=4, **common)}
        tok = engines["off"].engine.tokenizer
        for kind in ("chat", "code"):
            same = {"eagle3": 0, "built-in": 0}
            hits = {name: Counter() for name in engines}  # cached prompt tokens -> prompts
            prompts = chat_prompts(tok, held_out_prompts(kind, 16))
            for i, prompt in enumerate(prompts):
                outs = {name: llm.generate([prompt], params, use_tqdm=False)[0] for name, llm in engines.items()}
                for name, out in outs.items():
                    hits[name][out.num_cached_tokens] += 1
                for name in same:
                    at = first_difference(outs["off"].token_ids, outs[name].token_ids)
                    same[name] += at is None
                    if at is not None:
                        print(f"  prefix caching {'on' if caching else 'off'}, {kind} prompt {i}: {name} "
                              f"differs from token {at}; cached prompt tokens: off "
                              f"{outs['off'].num_cached_tokens}, {name} {outs[name].num_cached_tokens}")
            print(f"prefix caching {'on' if caching else 'off'}, {kind}: same as off: "
                  + ", ".join(f"{name} {n}/{len(prompts)}" for name, n in same.items())
                  + "; cached prompt tokens (tokens: prompts): "
                  + "; ".join(f"{name} {dict(sorted(c.items()))}" for name, c in hits.items()), flush=True)


if __name__ == "__main__":
    main()
