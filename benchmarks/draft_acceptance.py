"""The trained draft against the other drafters on held-out prompts, default model, in one
run: speculation off, n-gram, layer-skip and the built-in draft model.

Held-out chat and code prompts (``specserve.drafts.prompt_sets``: never trained on),
chat template applied, greedy, k = 4, up to ``--max-tokens`` new tokens (EOS ends a
request). Batch 1 runs the prompts one after another; a larger batch runs them together.
Reports mean acceptance length (tokens per verify step, as ``spec_stats`` counts it),
tokens/s, speed-up over speculation off, and how many outputs equal speculation off's
(all in float32; bf16 batched numerics may differ). Works on CPU and CUDA.

    python benchmarks/draft_acceptance.py [--prompts 8] [--batch 1,8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{platform.machine()} CPU {model}, {torch.get_num_threads()} threads (torch {torch.__version__})"


def run(llm, prompts, batch: int, max_tokens: int, k: int) -> dict:
    from specserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, num_speculative_tokens=k)
    before = llm.engine.spec_stats.copy()
    outs, seconds = [], 0.0
    for start in range(0, len(prompts), batch):
        began = time.perf_counter()
        outs += llm.generate(prompts[start:start + batch], params, use_tqdm=False)
        if llm.engine.device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - began
    after = llm.engine.spec_stats
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
            "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "num_drafts": drafts, "token_ids": [o.token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes")
    parser.add_argument("--methods", default="none,ngram,layerskip,draft_model")
    parser.add_argument("--draft-model", default=None, help="another draft (default: the built-in one)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None, help="write all results here")
    args = parser.parse_args()

    from specserve.drafts.prompt_sets import chat_prompts, held_out_prompts

    from specserve import LLM

    methods = args.methods.split(",")
    engines = {}
    for method in methods:
        extra = {"draft_model": args.draft_model} if method == "draft_model" and args.draft_model else {}
        engines[method] = LLM(device=args.device, dtype=args.dtype, speculative_method=method,
                              num_speculative_tokens=args.k, max_num_seqs=64, max_model_len=4096, **extra)
    first = engines[methods[0]].engine
    tok, device = first.tokenizer, first.device
    machine, dtype = machine_name(device), str(first.dtype).removeprefix("torch.")
    workloads = {kind: chat_prompts(tok, held_out_prompts(kind, args.prompts)) for kind in ("chat", "code")}
    for llm in engines.values():  # warm-up
        run(llm, workloads["chat"][:1], 1, 8, args.k)

    rows = []
    for kind, prompts in workloads.items():
        for batch in (int(b) for b in args.batch.split(",")):
            base = None
            for method in methods:
                r = run(engines[method], prompts, batch, args.max_tokens, args.k if method != "none" else 0)
                token_ids = r.pop("token_ids")
                base = base or (r["tokens_per_s"], token_ids)
                same = sum(a == b for a, b in zip(token_ids, base[1]))
                row = {"workload": kind, "batch": batch, "method": method, **r,
                       "speedup": round(r["tokens_per_s"] / base[0], 2),
                       "same_as_spec_off": f"{same}/{len(prompts)}"}
                rows.append(row)
                print(json.dumps(row), flush=True)

    draft = engines.get("draft_model")
    described = draft.engine.drafter.describe() if draft else ""
    print(f"\nSmolLM2-135M-Instruct on {machine}, {dtype}; held-out prompts ({args.prompts} chat, "
          f"{args.prompts} code), greedy, k = {args.k}, up to {args.max_tokens} new tokens\n"
          f"{described}\n")
    print("| workload | batch | method | tokens/s | vs off | acceptance length | same as off |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else ""
        method = "speculation off" if r["method"] == "none" else r["method"]
        print(f"| {r['workload']} | {r['batch']} | {method} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {al} | {r['same_as_spec_off']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "dtype": dtype, "k": args.k,
                                               "max_tokens": args.max_tokens, "draft": described,
                                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
