"""Offline generation speed on the embedded default model: specserve beside HF transformers.

Runs, in one process on the same device and dtype:
  * batch 1: one prompt, greedy, N new tokens (EOS ignored) — decode tokens/s;
  * batch B: B different prompts at once — specserve's continuous batch vs HF ``generate``
    on the left-padded batch — output tokens/s.
Greedy outputs are checked for equality with HF first (float32), then timed: median of
--repeats runs after a warm-up. Prints a table naming the machine.

    python benchmarks/offline_throughput.py [--new-tokens 128] [--batch 8] [--device cpu]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

PROMPTS = [
    "Explain how a paged KV cache works in an LLM serving engine.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What are the main causes of the French Revolution?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Give me five tips for writing clear technical documentation.",
    "How does speculative decoding speed up language model inference?",
    "Write a haiku about continuous batching.",
    "What is the difference between a process and a thread?",
]


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from specserve import LLM, SamplingParams
    from specserve.loader import resolve_model

    llm = LLM(device=args.device, dtype=args.dtype)
    engine = llm.engine
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=engine.dtype).to(engine.device).eval()
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS]
    chats = (chats * (args.batch // len(chats) + 1))[:args.batch]
    n = args.new_tokens
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def ours(prompts):
        return llm.generate(prompts, params, use_tqdm=False)

    def hf_generate(prompts):
        tok.padding_side = "left"
        enc = tok(prompts, return_tensors="pt", padding=True).to(engine.device)
        with torch.inference_mode():
            out = hf.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=tok.pad_token_id or 0)
        return out[:, enc.input_ids.shape[1]:]

    # Correctness first: batch-1 greedy tokens must equal HF's.
    want = hf_generate(chats[:1])[0].tolist()
    got = ours(chats[:1])[0].token_ids
    same = sum(a == b for a, b in zip(want, got))
    print(f"greedy check: {same}/{n} tokens equal to HF generate"
          + ("" if same == n else "  (bf16 divergence)" if engine.dtype != torch.float32 else "  MISMATCH"))

    rows = []
    for label, prompts in (("batch 1", chats[:1]), (f"batch {args.batch}", chats)):
        tokens = n * len(prompts)
        t_ours = timed(lambda: ours(prompts), args.repeats)
        t_hf = timed(lambda: hf_generate(prompts), args.repeats)
        rows.append((label, tokens / t_ours, tokens / t_hf))

    print(f"\nSmolLM2-135M-Instruct, {engine.dtype}, {n} new tokens, greedy, speculation off — "
          f"{machine(engine.device)}")
    print("| workload | specserve tokens/s | HF generate tokens/s | speedup |")
    print("| --- | ---: | ---: | ---: |")
    for label, ours_tps, hf_tps in rows:
        print(f"| {label} | {ours_tps:.1f} | {hf_tps:.1f} | {ours_tps / hf_tps:.2f}x |")


if __name__ == "__main__":
    main()
