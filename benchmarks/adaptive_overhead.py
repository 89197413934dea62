"""What an adaptive step costs against a fixed-k step of the same length, in one process.

Batch 1, the default model and its built-in draft, held-out chat and code prompts with the
chat template, greedy, up to ``--max-tokens`` new tokens. Engines (``--engines``): ``plan``
(adaptive k by the plan alone, ``draft_stopping=plan``; k <= 4), ``standing`` (the same,
each plan standing ``--replan`` steps), ``confidence`` (adaptive k with drafting stopped
by confidence, ``draft_stopping=confidence``, the CPU default), ``k=N`` (fixed) and
``off``; the prompts take turns over the engines. Reports tokens/s, the median whole-step
time by the number of drafts verified, and how many steps verified each k: where an
adaptive engine chooses the same k as a fixed one, the difference in step time is what
choosing it costs.

    python benchmarks/adaptive_overhead.py [--device cuda] [--prompts 8] [--replan 8]
        [--engines plan,standing,k=4,off] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--replan", type=int, default=8, help="steps a plan stands in the standing engine")
    parser.add_argument("--engines", default="plan,standing,k=4,off",
                        help="comma-separated, of: plan, standing, confidence, k=N, off")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

    from specserve import LLM, SamplingParams

    small = dict(gpu_memory_utilization=0.2) if args.device == "cuda" else {}
    common = dict(device=args.device, max_num_seqs=8, max_model_len=4096, **small)
    draft = dict(speculative_method="draft_model", num_speculative_tokens=4, **common)
    chosen = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in ("plan", "standing", "confidence", "off")
               and not (n.startswith("k=") and n[2:].isdigit())]
    if unknown or "off" not in chosen:
        parser.error(f"--engines: {', '.join(unknown) or 'off missing'} (of: plan, standing, confidence, k=N, off; "
                     "off is needed: its tokenizer builds the prompts, and it is the baseline)")
    engines = {}
    for name in chosen:
        if name == "plan":
            engines["adaptive (plan)"] = LLM(draft_stopping="plan", **draft)
        elif name == "standing":
            llm = engines[f"adaptive (plan), standing {args.replan} steps"] = LLM(draft_stopping="plan", **draft)
            llm.engine.speculator.controller.draft_replan = args.replan
        elif name == "confidence":
            engines["adaptive (confidence)"] = LLM(draft_stopping="confidence", **draft)
        elif name == "off":
            engines["off"] = LLM(speculative_method="none", **common)
        else:  # k=N
            engines[f"fixed {name}"] = LLM(speculative_adaptive=False,
                                           **{**draft, "num_speculative_tokens": int(name[2:])})
    steps: dict[str, list[tuple[int, float]]] = {name: [] for name in engines}
    for name, llm in engines.items():
        speculator = llm.engine.speculator
        if speculator.drafter is None:
            continue

        def observe(drafts, updates, elapsed, original=speculator.observe, name=name):
            scheduled = drafts.scheduled.scheduled
            if len(scheduled) == 1 and len(scheduled[0].token_ids) == 1:  # a decode step, not prefill
                steps[name].append((len(scheduled[0].draft_token_ids), elapsed))
            return original(drafts, updates, elapsed)

        speculator.observe = observe
    device = next(iter(engines.values())).engine.device
    rows = []
    for kind in ("chat", "code"):
        prompts = chat_prompts(engines["off"].engine.tokenizer, held_out_prompts(kind, args.prompts))
        for llm in engines.values():  # warm-up
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        for record in steps.values():
            record.clear()
        names, totals = list(engines), {name: [0, 0.0] for name in engines}
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = engines[name].generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens),
                                             use_tqdm=False)[0]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                totals[name][0] += len(out.token_ids)
                totals[name][1] += time.perf_counter() - start
        for name in names:
            by_k = {}
            for k, seconds in steps[name]:
                by_k.setdefault(k, []).append(seconds)
            rows.append({"workload": kind, "engine": name, "tokens_per_s": round(totals[name][0] / totals[name][1], 1),
                         "median_step_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in sorted(by_k.items())},
                         "steps_by_k": {k: len(v) for k, v in sorted(by_k.items())}})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
