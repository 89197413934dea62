"""Speculative decoding on the CPU, default model: every drafter and k beside speculation
off, HF transformers ``generate`` (float32, its default, and bfloat16, specserve's dtype
here) and HF prompt-lookup ``generate``, all in one run.

Greedy, EOS ignored, a fixed number of new tokens per prompt, prompt processing included
(each run starts with the engine's prefix cache emptied). Batch 1 runs the prompts of a
workload one after another; batch 8 runs 8 prompts of it at once. Outputs with
speculation are compared with speculation off (token-identical in float32; in bfloat16
batched numerics may differ, and the count of identical outputs is printed). One engine
per drafter is loaded once; k varies per request (``SamplingParams.num_speculative_tokens``).

    python benchmarks/speculation_cpu.py [--max-tokens 64] [--ks 1,2,3,4,5,6,7,8] [--adaptive]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_acceptance import machine_name  # noqa: E402
from workloads import WORKLOADS, chat_prompts, drafter_settings  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def run_engine(llm, prompts, batch: int, max_tokens: int, k: int | None):
    from specserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            num_speculative_tokens=k)
    # Every run pays its prompts' processing: a k of the sweep would otherwise find them in
    # the prefix cache from the k before it, and speculation off and the default would not.
    llm.engine.kv.reset_prefix_cache()
    stats0 = _snapshot(llm)
    outs, seconds = [], 0.0
    for start in range(0, len(prompts), batch):
        chunk, dt = timed(lambda: llm.generate(prompts[start:start + batch], params, use_tqdm=False))
        outs += chunk
        seconds += dt
    drafts, accepted = (a - b for a, b in zip(_snapshot(llm), stats0))
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens_per_s": tokens / seconds, "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "token_ids": [o.token_ids for o in outs]}


def _snapshot(llm):
    s = llm.engine.spec_stats
    return s.num_drafts, s.num_accepted_tokens


def run_hf(model, tok, prompts, batch: int, max_tokens: int, lookup: int | None = None):
    outs, seconds = [], 0.0
    for start in range(0, len(prompts), batch):
        tok.padding_side = "left"
        enc = tok(prompts[start:start + batch], return_tensors="pt", padding=True)
        kwargs = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                      pad_token_id=tok.pad_token_id or 0)
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = lookup
        with torch.inference_mode():
            out, dt = timed(lambda: model.generate(**enc, **kwargs))
        outs += out[:, enc.input_ids.shape[1]:].tolist()
        seconds += dt
    return {"tokens_per_s": sum(map(len, outs)) / seconds, "token_ids": outs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--drafters", default="ngram,layerskip",
                        help="comma-separated methods; draft_model@PATH for a draft other than the built-in one")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompts-per-workload", type=int, default=4,
                        help="prompts run one at a time for batch 1")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adaptive", action="store_true",
                        help="also each drafter as the engine runs it by default (k chosen every step)")
    parser.add_argument("--json", default=None, help="write all results here")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    from transformers import AutoModelForCausalLM

    from specserve import LLM
    from specserve.bench.prompt_sets import held_out_prompts
    from specserve.loader import resolve_model

    engines = {"off": LLM(dtype=args.dtype)}
    for name in args.drafters.split(","):
        engines[name] = LLM(dtype=args.dtype, num_speculative_tokens=max(ks), speculative_adaptive=False,
                            **drafter_settings(name))  # k per request: the sweep
        if args.adaptive:  # the engine's default: k chosen every step
            engines[f"{name}, adaptive"] = LLM(dtype=args.dtype, **drafter_settings(name))
    llm = engines["off"]
    tok = llm.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(resolve_model(None).path, dtype=torch.bfloat16).eval()
    for model in (hf, hf16):  # warm-up: the first generate pays one-off costs
        run_hf(model, tok, chat_prompts(tok, WORKLOADS["chat"])[:1], 1, 4)
    # Every engine warmed up on other prompts of each kind, alone and 8 at once, as a served
    # engine has run before it is measured: one-off costs paid, and an adaptive engine's
    # cost models and acceptance seen (not the measured prompts: their prefixes would be cached).
    for kind in ("code", "chat"):
        others = chat_prompts(tok, held_out_prompts(kind, 24)[16:])
        for engine in engines.values():
            run_engine(engine, others[:2], 1, 32, None)
            run_engine(engine, others, args.batch, 32, None)
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    cpu = machine_name(torch.device("cpu"))

    rows, results = [], []
    for workload, messages in WORKLOADS.items():
        prompts = chat_prompts(tok, messages)
        for batch, chosen in ((1, prompts[:args.prompts_per_workload]), (args.batch, prompts[:args.batch])):
            base = run_engine(llm, chosen, batch, args.max_tokens, 0)
            hf_plain = run_hf(hf, tok, chosen, batch, args.max_tokens)
            hf_bf16 = run_hf(hf16, tok, chosen, batch, args.max_tokens)
            entries = [("HF generate (fp32)", "", hf_plain, None), ("HF generate (bf16)", "", hf_bf16, None),
                       ("specserve, speculation off", "", base, None)]
            if batch == 1:
                for k in (3, 10):
                    entries.append(("HF prompt lookup (fp32)", k,
                                    run_hf(hf, tok, chosen, 1, args.max_tokens, lookup=k), None))
            for name in args.drafters.split(","):
                for k in ks:
                    r = run_engine(engines[name], chosen, batch, args.max_tokens, k)
                    same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
                    label = name if "@" not in name else f"{name.split('@')[0]}@{Path(name.split('@')[1]).name}"
                    entries.append((f"specserve {label}", k, r, same))
                if args.adaptive:
                    r = run_engine(engines[f"{name}, adaptive"], chosen, batch, args.max_tokens, None)
                    same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
                    entries.append((f"specserve {label}, adaptive (default)", "", r, same))
            for label, k, r, same in entries:
                row = {"workload": workload, "batch": batch, "method": label, "k": k,
                       "tokens_per_s": round(r["tokens_per_s"], 1),
                       "speedup_vs_hf": round(r["tokens_per_s"] / hf_plain["tokens_per_s"], 2),
                       "speedup_vs_hf_bf16": round(r["tokens_per_s"] / hf_bf16["tokens_per_s"], 2),
                       "acceptance_length": round(r.get("acceptance_length", 0) or 0, 2) or None,
                       "same_as_spec_off": f"{same}/{len(chosen)}" if same is not None else None}
                results.append(row)
                print(json.dumps(row), flush=True)
            rows.append((workload, batch, entries, hf_plain, hf_bf16))

    print(f"\nSmolLM2-135M-Instruct on {cpu}; specserve {dtype}, HF float32; greedy, "
          f"{args.max_tokens} new tokens per prompt, EOS ignored\n")
    print("| workload | batch | method | k | tokens/s | vs HF generate | vs HF bf16 | acceptance length |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for workload, batch, entries, hf_plain, hf_bf16 in rows:
        best = {}
        for label, k, r, _ in entries:
            if label.startswith("specserve ") and "off" not in label and "adaptive" not in label:
                if label not in best or r["tokens_per_s"] > best[label][1]["tokens_per_s"]:
                    best[label] = (k, r)
        shown = [(label, k, r) for label, k, r, _ in entries if not label.startswith("specserve ")
                 or "off" in label] + [(f"{label} (best k)", k, r) for label, (k, r) in best.items()] + \
            [(label, k, r) for label, k, r, _ in entries if "adaptive" in label]
        for label, k, r in shown:
            al = r.get("acceptance_length")
            print(f"| {workload} | {batch} | {label} | {k} | {r['tokens_per_s']:.1f} | "
                  f"{r['tokens_per_s'] / hf_plain['tokens_per_s']:.2f}x | "
                  f"{r['tokens_per_s'] / hf_bf16['tokens_per_s']:.2f}x | {f'{al:.2f}' if al else ''} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": cpu, "dtype": dtype, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
