"""A batch-1 step's wall time by the draft length it verified: the adaptive plan against
fixed k, so a loss of the plan splits into the k it chose (the mix) and what each of its
steps costs beside a fixed k's step of the same k (the overhead).

Default model and its built-in draft, held-out chat (or ``--kind code``) prompts with the
chat template, greedy, up to ``--max-tokens`` new tokens, one request at a time, the
engines taking turns prompt by prompt. Every step's wall time (``LLMEngine.step`` up to
``Speculator.observe``), its k, the tokens it emitted, and the time in ``Speculator.plan``,
``Speculator.propose`` and ``LLMEngine._verify`` within it are recorded (``_verify``
holds the controller's learning, ``Speculator.learn``, and a step without drafts' feed of
the draft); the prompt's steps (its chunks, up to the one that emits the first token) are
left out, and each k's steps are split by whether the step before drafted. Prints, per
engine, tokens/s and, per k, steps, mean wall, plan, propose, verify and other time (µs)
and tokens a step.

    python benchmarks/step_time_by_k.py --device cuda [--prompts 12] [--fixed 2,3,4] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--kind", default="chat", choices=("chat", "code"))
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--fixed", default="2,3,4", help="fixed draft lengths, one engine")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    from adaptive_host_time import wrap

    from specserve import LLM, SamplingParams
    from specserve import engine as engine_module
    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts
    from specserve.spec import speculator as speculator_module

    inside = collections.defaultdict(lambda: [0, 0.0])  # method -> [calls, seconds] since the step began
    for owner, name in ((speculator_module.Speculator, "plan"), (speculator_module.Speculator, "propose"),
                        (engine_module.LLMEngine, "_verify")):
        wrap(owner, name, name, inside)
    records: list[dict] = []  # filled by the observe wrapper for whichever engine runs
    observe = speculator_module.Speculator.observe

    def observing(self, drafts, updates, elapsed):
        k = max(drafts.lookahead, default=0) if drafts.drafted else 0
        records.append({"k": k, "wall": elapsed, "tokens": sum(len(u.new_token_ids) for u in updates),
                        "plan": inside.pop("plan", [0, 0.0])[1], "propose": inside.pop("propose", [0, 0.0])[1],
                        "verify": inside.pop("_verify", [0, 0.0])[1]})
        return observe(self, drafts, updates, elapsed)
    speculator_module.Speculator.observe = observing

    fixed = [int(k) for k in args.fixed.split(",") if k]
    common = {"device": args.device, "max_num_seqs": 8, "max_model_len": 4096, "speculative_method": "draft_model"}
    engines = {"plan": LLM(draft_stopping="plan", **common),
               "fixed": LLM(speculative_adaptive=False, num_speculative_tokens=max(fixed), **common)}
    settings = [("plan", "plan", None)] + [(f"k={k}", "fixed", k) for k in fixed]
    sync = torch.cuda.synchronize if engines["plan"].engine.device.type == "cuda" else (lambda: None)
    prompts = chat_prompts(engines["plan"].engine.tokenizer, held_out_prompts(args.kind, args.prompts))
    for _, engine, k in settings:  # warm-up
        engines[engine].generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16, num_speculative_tokens=k),
                                 use_tqdm=False)
    steps = {name: [] for name, _, _ in settings}
    seconds = dict.fromkeys(steps, 0.0)
    tokens = dict.fromkeys(steps, 0)
    for i, prompt in enumerate(prompts):
        for name, engine, k in settings[i % len(settings):] + settings[:i % len(settings)]:
            llm = engines[engine]
            llm.engine.kv.reset_prefix_cache()
            records.clear()
            sync()
            began = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                        num_speculative_tokens=k), use_tqdm=False)[0]
            sync()
            seconds[name] += time.perf_counter() - began
            tokens[name] += len(out.token_ids)
            emitted = next((j for j, r in enumerate(records) if r["tokens"]), len(records))
            for j, r in enumerate(records):
                r["after_drafts"] = j > 0 and records[j - 1]["k"] > 0
                r["first"] = j <= emitted  # the prompt's chunks, up to its first token
            steps[name] += records[:]

    print(f"{args.kind}, {args.prompts} prompts, {engines['plan'].engine.speculator.describe()}")
    summary = {}
    for name, rows in steps.items():
        decode = [r for r in rows if not r["first"]]
        print(f"\n{name}: {tokens[name] / seconds[name]:.1f} tokens/s, {len(rows)} steps "
              f"({statistics.mean(r['wall'] for r in decode) * 1e6:.0f} us a decode step, "
              f"{sum(r['tokens'] for r in decode) / len(decode):.2f} tokens)")
        print("| k | after | steps | wall (us) | median | plan | propose | verify | other | tokens a step |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        groups = collections.defaultdict(list)
        for r in decode:
            groups[(r["k"], r["after_drafts"])].append(r)
        table = []
        for (k, after), group in sorted(groups.items()):
            row = {"k": k, "after_drafts": after, "steps": len(group),
                   **{f: statistics.mean(r[f] for r in group) * 1e6 for f in ("wall", "plan", "propose", "verify")},
                   "median": statistics.median(r["wall"] for r in group) * 1e6,
                   "tokens": statistics.mean(r["tokens"] for r in group)}
            row["other"] = row["wall"] - row["plan"] - row["propose"] - row["verify"]
            table.append(row)
            print(f"| {k} | {'drafts' if after else 'none'} | {row['steps']} | {row['wall']:.0f} | "
                  f"{row['median']:.0f} | {row['plan']:.0f} | {row['propose']:.0f} | {row['verify']:.0f} | "
                  f"{row['other']:.0f} | {row['tokens']:.2f} |")
        summary[name] = {"tokens_per_s": tokens[name] / seconds[name], "steps": len(rows), "by_k": table}
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
