"""A draft checkpoint's layers quantized on the CPU (``--draft-quantization``) against the
same draft unquantized, in one run: what a draft step costs, what is accepted, what the
request gains.

Default model from its Q4_1 GGUF (the CPU default), its built-in draft (3 layers, bf16 in
the checkpoint), held-out chat and code prompts with the chat template, greedy, batch 1,
up to ``--max-tokens`` new tokens. For each draft quantization (``--kinds``, default
``none,Q8_0,Q4_1``): fixed k = 1…3 and the adaptive default (k ≤ 4, drafting stopped by
confidence). Every setting is its own engine (the fixed k share one per kind); the settings
take turns prompt by prompt, every engine is warmed up first and every run starts with its
prefix cache emptied. Reports tokens/s, the ratio to speculation off, acceptance length,
the mean k verified per step, the share of the wall time spent proposing drafts and the
milliseconds per drafted token, and how many outputs equal speculation off's.

    python benchmarks/draft_quantization.py [--prompts 8] [--kinds none,Q8_0,Q4_1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_acceptance import machine_name  # noqa: E402
from workloads import run_cold  # noqa: E402

FIXED = (1, 2, 3)


class ProposeTimer:
    """Wall time in an engine's ``speculator.propose`` (the drafter's passes, catch-up included)."""

    def __init__(self, speculator) -> None:
        self.seconds = 0.0
        inner = speculator.propose

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        speculator.propose = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kinds", default="none,Q8_0,Q4_1", help="draft_quantization values to compare")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from specserve import LLM, SamplingParams
    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

    common = dict(device="cpu", max_num_seqs=8, max_model_len=4096)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    engines = {"off": LLM(speculative_method="none", **common)}
    settings = {"off": ("off", 0)}
    for kind in kinds:
        draft = dict(speculative_method="draft_model", draft_quantization=kind, **common)
        engines[f"{kind}, fixed"] = LLM(num_speculative_tokens=max(FIXED), speculative_adaptive=False, **draft)
        engines[f"{kind}, adaptive"] = LLM(**draft)
        settings.update({f"{kind}, k={k}": (f"{kind}, fixed", k) for k in FIXED})
        settings[f"{kind}, adaptive"] = (f"{kind}, adaptive", None)
    timers = {name: ProposeTimer(llm.engine.speculator) for name, llm in engines.items() if name != "off"}
    first = engines["off"].engine
    machine = machine_name(first.device)
    workloads = {kind: chat_prompts(first.tokenizer, held_out_prompts(kind, args.prompts)) for kind in ("chat", "code")}

    def run(name: str, prompt: str, max_tokens: int) -> tuple:
        engine, k = settings[name]
        proposing = timers[engine].seconds if engine in timers else 0.0
        done = run_cold(engines[engine], prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                num_speculative_tokens=k))
        return (done.seconds, len(done.token_ids), done.draft_tokens, done.drafts, done.accepted, done.steps,
                (timers[engine].seconds if engine in timers else 0.0) - proposing, done.token_ids)

    for name in settings:  # warm-up: every engine, both kinds
        for prompts in workloads.values():
            run(name, prompts[0], 16)

    names, rows = list(settings), []
    for workload, prompts in workloads.items():
        acc = {n: dict(seconds=0.0, tokens=0, draft_tokens=0, drafts=0, accepted=0, steps={}, proposing=0.0, ids=[])
               for n in names}
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                seconds, tokens, draft_tokens, drafts, accepted, steps, proposing, ids = run(name, prompt,
                                                                                           args.max_tokens)
                a = acc[name]
                a["seconds"] += seconds
                a["tokens"] += tokens
                a["draft_tokens"] += draft_tokens
                a["drafts"] += drafts
                a["accepted"] += accepted
                a["proposing"] += proposing
                a["ids"].append(ids)
                for j, n in steps.items():
                    a["steps"][j] = a["steps"].get(j, 0) + n
        off = acc["off"]["tokens"] / acc["off"]["seconds"]
        for name in names:
            a = acc[name]
            steps = sum(a["steps"].values())
            rows.append({
                "workload": workload, "setting": name, "tokens_per_s": round(a["tokens"] / a["seconds"], 2),
                "vs_off": round(a["tokens"] / a["seconds"] / off, 3),
                "acceptance_length": round(1 + a["accepted"] / a["drafts"], 3) if a["drafts"] else None,
                "mean_k": round(sum(j * n for j, n in a["steps"].items()) / steps, 2) if steps else None,
                "proposing_share": round(a["proposing"] / a["seconds"], 3),
                "ms_per_draft_token": round(1e3 * a["proposing"] / a["draft_tokens"], 2) if a["draft_tokens"] else None,
                "same_as_off": f"{sum(x == y for x, y in zip(a['ids'], acc['off']['ids']))}/{len(prompts)}"})
            print(json.dumps(rows[-1]), flush=True)

    drafters = {kind: engines[f"{kind}, fixed"].engine.speculator.drafter.describe() for kind in kinds}
    print(f"\nSmolLM2-135M-Instruct (Q4_1 GGUF) on {machine}; the built-in draft: "
          + "; ".join(f"{k}: {d}" for k, d in drafters.items())
          + f"; held-out prompts ({args.prompts} chat, {args.prompts} code), greedy, batch 1, "
            f"up to {args.max_tokens} new tokens\n")
    print("| workload | setting | tokens/s | vs off | acceptance length | mean k | time proposing | ms per draft token "
          "| same as off |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else ""
        ms = f"{r['ms_per_draft_token']:.2f}" if r["ms_per_draft_token"] else ""
        print(f"| {r['workload']} | {r['setting']} | {r['tokens_per_s']:.1f} | {r['vs_off']:.2f}x | {al} | "
              f"{r['mean_k'] if r['mean_k'] is not None else ''} | {100 * r['proposing_share']:.0f}% | {ms} | "
              f"{r['same_as_off']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine, "date": time.strftime("%Y-%m-%d"), "args": vars(args), "drafters": drafters,
            "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
