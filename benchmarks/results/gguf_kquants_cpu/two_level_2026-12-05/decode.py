"""Batch-1 decoding of a GGUF file kept quantized, its K-quant scales two-level (``two-level``)
or float32 products (``products``, the form before): tokens/s over prompts of random token
ids, greedy, a fixed number of new tokens (end of sequence ignored), after a warm-up.

    python decode.py FILE.gguf two-level|products [--prompts 4] [--max-tokens 64] [--threads 2]
"""
import argparse
import collections
import time

import torch
from specserve.kernels import cpu_ops

from specserve import LLM, SamplingParams

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("gguf")
parser.add_argument("form", choices=("two-level", "products"))
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
if args.form == "products":
    cpu_ops.two_level_scales = lambda: False
llm = LLM(args.gguf, max_num_seqs=1, max_model_len=1024, cpu_threads=args.threads)
layers = [m for m in llm.engine.runner.model.modules() if hasattr(m, "scales")]
forms = collections.Counter(str(m.scales.dtype).removeprefix("torch.") for m in layers)
generator = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 500, (32,), generator=generator).tolist() for _ in range(args.prompts)]
params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
began, tokens = time.perf_counter(), 0
for prompt in prompts:
    tokens += len(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
print(f"{args.gguf} {args.form} (layers by scales: {dict(forms)}): {tokens / (time.perf_counter() - began):.1f} tokens/s")
