"""Per-token drafting against every fixed k, batch 1, in one run: is the default at least
as fast as the best fixed draft length?

Default model, a draft model (the built-in one unless ``--method`` names another),
held-out chat and code prompts (``specserve.bench.prompt_sets``, chat template applied),
greedy, up to ``--max-tokens`` new tokens, one request at a time. Settings:

* ``off`` — speculation off;
* ``k=1`` … ``k=6`` — a fixed k (one engine, the request's own k); ``k=N, paths=P`` with
  P draft paths (``--paths P``), ``k=N, tree=T`` with a draft tree of up to T further
  nodes (``--tree-nodes T``);
* ``adaptive`` — ``draft_stopping=confidence``: the controller plans the most each
  request may draft and the drafter stops token by token by its calibrated confidence
  (``spec.stopping``; the default on a CPU);
* ``adaptive, no stopping`` — ``draft_stopping=plan``: k from each request's smoothed
  acceptance, every planned draft proposed (the default on a GPU);
* ``adaptive, tree`` and ``adaptive, no stopping, tree`` (with ``--tree-nodes T``) — the
  two with a dynamic draft tree of up to T further nodes (``spec.tree``);
* any adaptive setting followed by ``, max k=N`` — the same with a cap of N drafts a step
  instead of ``--max-k`` (so two caps run side by side).

The settings take turns prompt by prompt (each prompt starting with the next setting),
so load from elsewhere falls on all alike; every engine is warmed up first, and every run
starts with its engine's prefix cache emptied, so each pays its prompt's processing.
Reports tokens/s, the ratio to off and to the best fixed k, acceptance length, the mean k
verified per step and how many outputs equal speculation off's; the adaptive engine's
calibration map goes to the JSON.

    python benchmarks/per_token_drafting.py [--prompts 8] [--max-k K] [--tree-nodes 10] [--paths 2]
        [--settings "k=2;k=4, tree=10;adaptive"] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_acceptance import machine_name  # noqa: E402
from workloads import drafter_settings, run_cold  # noqa: E402

FIXED = range(1, 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=None,
                        help="the adaptive engines' most drafts per step (default: the engine's own, 4, "
                             "or 6 where a GPU plans a draft model's chain)")
    parser.add_argument("--tree-nodes", type=int, default=0,
                        help="add settings with a draft tree of up to N further nodes: adaptive ones, and "
                             "'k=N, tree=T' where --settings names them")
    parser.add_argument("--paths", type=int, default=0,
                        help="add fixed-k settings verifying this many draft paths ('k=N, paths=P')")
    parser.add_argument("--method", default="draft_model", help="draft_model, draft_model@PATH, layerskip, ngram")
    parser.add_argument("--settings", default=None,
                        help="';'-separated subset of: off; k=1..k=6; k=N, paths=P; k=N, tree=T; adaptive; "
                             "adaptive, no stopping; adaptive, tree; adaptive, no stopping, tree")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None)
    parser.add_argument("--verbose", action="store_true", help="print every run (setting, prompt, seconds, tokens)")
    args = parser.parse_args()

    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

    from specserve import LLM, SamplingParams

    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=8, max_model_len=4096)
    drafter = drafter_settings(args.method)
    tree = {"draft_tree_nodes": args.tree_nodes}
    kinds = {  # engine name -> its settings (made only if a setting uses it)
        "off": dict(speculative_method="none"),
        "fixed": dict(num_speculative_tokens=max(FIXED), speculative_adaptive=False, **drafter),
        "fixed, paths": dict(num_speculative_tokens=max(FIXED), speculative_adaptive=False,
                             num_draft_paths=args.paths, **drafter),
        "fixed, tree": dict(num_speculative_tokens=max(FIXED), speculative_adaptive=False, **tree, **drafter),
        "adaptive": dict(num_speculative_tokens=args.max_k, draft_stopping="confidence", **drafter),
        "adaptive, no stopping": dict(num_speculative_tokens=args.max_k, draft_stopping="plan", **drafter),
        "adaptive, tree": dict(num_speculative_tokens=args.max_k, draft_stopping="confidence", **tree, **drafter),
        "adaptive, no stopping, tree": dict(num_speculative_tokens=args.max_k, draft_stopping="plan", **tree,
                                            **drafter)}
    settings = {"off": ("off", 0), **{f"k={k}": ("fixed", k) for k in FIXED},
                "adaptive": ("adaptive", None), "adaptive, no stopping": ("adaptive, no stopping", None)}
    if args.paths:
        settings.update({f"k={k}, paths={args.paths}": ("fixed, paths", k) for k in FIXED})
    if args.tree_nodes:
        settings.update({f"k={k}, tree={args.tree_nodes}": ("fixed, tree", k) for k in FIXED})
        settings.update({name: (name, None) for name in ("adaptive, tree", "adaptive, no stopping, tree")})
    if args.settings:
        chosen = ["off"] + [n.strip() for n in args.settings.split(";") if n.strip() and n.strip() != "off"]
        for name in chosen:  # an adaptive setting with a cap of its own: "adaptive, max k=6"
            base, _, cap = name.rpartition(", max k=")
            if base in kinds and base.startswith("adaptive") and cap.isdigit():
                kinds[name] = {**kinds[base], "num_speculative_tokens": int(cap)}
                settings[name] = (name, None)
        unknown = [n for n in chosen if n not in settings]
        if unknown:
            raise SystemExit(f"unknown settings {unknown} (known: {list(settings)})")
        settings = {n: settings[n] for n in chosen}
    elif args.tree_nodes:  # by default, the adaptive trees beside every fixed chain
        settings = {n: v for n, v in settings.items() if v[0] != "fixed, tree"}
    engines = {kind: LLM(**kinds[kind], **common) for kind in dict.fromkeys(v[0] for v in settings.values())}
    first = engines["off"].engine
    machine, dtype = machine_name(first.device), str(first.dtype).removeprefix("torch.")
    workloads = {kind: chat_prompts(first.tokenizer, held_out_prompts(kind, args.prompts)) for kind in ("chat", "code")}

    def run(name: str, prompt: str, max_tokens: int) -> tuple:
        # Cold: the fixed k settings share one engine, whose prefix cache would otherwise
        # hold the prompt from the setting before and spare them its processing.
        engine, k = settings[name]
        done = run_cold(engines[engine], prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                num_speculative_tokens=k))
        return (done.seconds, len(done.token_ids), done.drafts, done.accepted, done.steps, done.token_ids)

    for name in settings:  # warm-up: every engine, both kinds
        for prompts in workloads.values():
            run(name, prompts[0], 16)

    names, rows = list(settings), []
    for kind, prompts in workloads.items():
        acc = {n: {"seconds": 0.0, "tokens": 0, "drafts": 0, "accepted": 0, "steps": {}, "ids": []} for n in names}
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                seconds, tokens, drafts, accepted, steps, ids = run(name, prompt, args.max_tokens)
                if args.verbose:
                    print(f"{kind} prompt {i} {name}: {seconds:.2f} s, {tokens} tokens, {drafts} drafts, "
                          f"{accepted} accepted", flush=True)
                a = acc[name]
                a["seconds"] += seconds
                a["tokens"] += tokens
                a["drafts"] += drafts
                a["accepted"] += accepted
                a["ids"].append(ids)
                for j, n in steps.items():
                    a["steps"][j] = a["steps"].get(j, 0) + n
        rate = {n: a["tokens"] / a["seconds"] for n, a in acc.items()}
        best = max((n for n in names if n.startswith("k=")), key=rate.get, default=None)
        for name in names:
            a = acc[name]
            steps = sum(a["steps"].values())
            rows.append({
                "workload": kind, "setting": name, "tokens_per_s": round(rate[name], 2),
                "vs_off": round(rate[name] / rate["off"], 3),
                "vs_best_fixed": round(rate[name] / rate[best], 3) if best else None,
                "best_fixed": best,
                "acceptance_length": round(1 + a["accepted"] / a["drafts"], 3) if a["drafts"] else None,
                "mean_k": round(sum(j * n for j, n in a["steps"].items()) / steps, 2) if steps else None,
                "same_as_off": f"{sum(x == y for x, y in zip(a['ids'], acc['off']['ids']))}/{len(prompts)}"})
            print(json.dumps(rows[-1]), flush=True)

    adaptive = next((engines[kind] for kind in ("adaptive", "adaptive, tree", "adaptive, no stopping")
                     if kind in engines), engines["off"]).engine.speculator
    calibration = adaptive.controller.calibration.describe() \
        if adaptive.controller and adaptive.controller.calibration else None
    print(f"\nSmolLM2-135M-Instruct on {machine}, {dtype}; {adaptive.describe()}; held-out prompts "
          f"({args.prompts} chat, {args.prompts} code), greedy, batch 1, up to {args.max_tokens} new tokens\n")
    print("| workload | setting | tokens/s | vs off | vs best fixed k | acceptance length | mean k | same as off |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else ""
        vs_best = f"{r['vs_best_fixed']:.2f}x" if r["vs_best_fixed"] else ""
        print(f"| {r['workload']} | {r['setting']} | {r['tokens_per_s']:.1f} | {r['vs_off']:.2f}x | {vs_best} | "
              f"{al} | {r['mean_k'] if r['mean_k'] is not None else ''} | {r['same_as_off']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine, "dtype": dtype, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
            "drafter": adaptive.describe(), "rows": rows, "calibration": calibration,
            # each engine's cap as it ran (without --max-k, the engine's own: 4 or 6)
            "max_k": {kind: llm.engine.speculator.max_k for kind, llm in engines.items()}}, indent=1))


if __name__ == "__main__":
    main()
