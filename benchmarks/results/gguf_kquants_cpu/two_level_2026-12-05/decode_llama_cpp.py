"""decode.py's workload on llama.cpp (``llama-cpp-python``, the same file and threads):
prompts of random token ids, greedy, a fixed number of new tokens, prompt processing
included, after a warm-up.

    python decode_llama_cpp.py FILE.gguf [--prompts 4] [--max-tokens 64] [--threads 2]
"""
import argparse
import time

import llama_cpp
import torch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("gguf")
parser.add_argument("--prompts", type=int, default=4)
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
llm = llama_cpp.Llama(args.gguf, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
generator = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 500, (32,), generator=generator).tolist() for _ in range(args.prompts)]


def run(prompt: list[int], n: int) -> int:
    llm.reset()
    count = 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        count += 1
        if count == n:
            break
    return count


run(prompts[0], 8)
began, tokens = time.perf_counter(), 0
for prompt in prompts:
    tokens += run(prompt, args.max_tokens)
print(f"{args.gguf} llama.cpp {llama_cpp.__version__}: {tokens / (time.perf_counter() - began):.1f} tokens/s")
