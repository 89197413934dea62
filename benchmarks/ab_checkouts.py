"""Two checkouts of specserve side by side on this machine: batch-1 speed and greedy
outputs of the default model, each checkout in its own interpreter, run in turns.

Each ``--python LABEL=PATH`` is an interpreter with one checkout installed (a virtual
environment of its own). The prompts are built once, here, and handed to every
checkout as token ids, so each runs exactly the same inputs; the checkouts then run
round after round, taking turns (A B, B A, A B, ...), so a machine that slows down
for a while slows both. Only the public API is used (``LLM``, ``SamplingParams``,
``RequestOutput.spec_stats``), so any two versions of it can be compared.

* ``--mode speed`` (default dtype): tokens per second of speculation off and of each
  drafter, one prompt at a time, median over the rounds.
* ``--mode outputs`` (``--dtype float32``): every drafter's greedy token ids (and a
  seeded sampling run at a fixed k), compared across the checkouts and, for greedy,
  with speculation off.

    python benchmarks/ab_checkouts.py --python before=/tmp/venv_before/bin/python \\
        --python after=python --mode speed --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# label -> engine settings and the sampling settings of every request
SPEED_SETTINGS = {
    "off": ({}, {}),
    "ngram k=4": ({"speculative_method": "ngram", "speculative_adaptive": False}, {}),
    "ngram adaptive": ({"speculative_method": "ngram"}, {}),
    "draft k=1": ({"speculative_method": "draft_model", "speculative_adaptive": False,
                   "num_speculative_tokens": 1}, {}),
    "draft k=2": ({"speculative_method": "draft_model", "speculative_adaptive": False,
                   "num_speculative_tokens": 2}, {}),
    "draft k=4": ({"speculative_method": "draft_model", "speculative_adaptive": False}, {}),
    "draft adaptive": ({"speculative_method": "draft_model"}, {}),
}
OUTPUT_SETTINGS = {
    **SPEED_SETTINGS,
    "layerskip k=4": ({"speculative_method": "layerskip", "speculative_adaptive": False}, {}),
    "draft 2 paths k=4": ({"speculative_method": "draft_model", "speculative_adaptive": False,
                           "num_draft_paths": 2}, {}),
    "draft 2 paths adaptive": ({"speculative_method": "draft_model", "num_draft_paths": 2}, {}),
    "ngram k=4 sampled": ({"speculative_method": "ngram", "speculative_adaptive": False},
                          {"temperature": 0.8, "seed": 7}),
    "draft k=4 sampled": ({"speculative_method": "draft_model", "speculative_adaptive": False},
                          {"temperature": 0.8, "seed": 7}),
}


def child(spec_path: str, out_path: str) -> None:
    """One checkout: every setting over every prompt, batch 1; token ids and timings."""
    from specserve import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    results = {}
    for label, (engine, sampling) in spec["settings"].items():
        llm = LLM(dtype=spec["dtype"], **engine)
        params = SamplingParams(**{"temperature": 0.0, "max_tokens": spec["max_tokens"],
                                   "ignore_eos": True, **sampling})
        llm.generate([spec["prompts"]["chat"][0]], params, use_tqdm=False)  # warm-up
        for workload, prompts in spec["prompts"].items():
            token_ids, seconds, drafts, accepted = [], 0.0, 0, 0
            for prompt in prompts:
                start = time.perf_counter()
                (out,) = llm.generate([prompt], params, use_tqdm=False)
                seconds += time.perf_counter() - start
                token_ids.append(out.token_ids)
                drafts += out.spec_stats.num_drafts
                accepted += out.spec_stats.num_accepted_tokens
            results[f"{label}|{workload}"] = {
                "tokens_per_s": sum(map(len, token_ids)) / seconds,
                "acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                "token_ids": token_ids}
        llm.engine.shutdown()
        del llm
    Path(out_path).write_text(json.dumps(results))


def build_prompts(num_prompts: int) -> dict[str, list[list[int]]]:
    """Held-out chat and code-editing prompts with the chat template applied, as token ids."""
    from specserve.bench.workloads import chat_prompts, code_edit_prompts
    from specserve.loader import load_tokenizer, resolve_model
    from specserve.prompts import chat_prompt_ids

    tokenizer = load_tokenizer(resolve_model(None))
    return {kind: [chat_prompt_ids(tokenizer, [{"role": "user", "content": m}]) for m in messages[:num_prompts]]
            for kind, messages in (("chat", chat_prompts()), ("code", code_edit_prompts()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", default=[], metavar="LABEL=PATH",
                        help="an interpreter with one checkout installed (twice or more)")
    parser.add_argument("--mode", choices=("speed", "outputs"), default="speed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload (chat, code)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default: auto for speed, float32 for outputs")
    parser.add_argument("--settings", default=None, metavar="LIST",
                        help="comma-separated setting labels to run (default: all of the mode's)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    pythons = dict(p.split("=", 1) for p in args.python)
    if len(pythons) < 2:
        parser.error("give --python LABEL=PATH at least twice")
    settings = SPEED_SETTINGS if args.mode == "speed" else OUTPUT_SETTINGS
    if args.settings:
        unknown = set(args.settings.split(",")) - set(settings)
        if unknown:
            parser.error(f"unknown settings {sorted(unknown)}; choose from {list(settings)}")
        settings = {label: settings[label] for label in args.settings.split(",")}
    rounds = args.rounds if args.mode == "speed" else 1
    spec = {"settings": settings, "prompts": build_prompts(args.prompts), "max_tokens": args.max_tokens,
            "dtype": args.dtype or ("auto" if args.mode == "speed" else "float32")}
    runs: dict[str, list[dict]] = {label: [] for label in pythons}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for r in range(rounds):
            order = list(pythons) if r % 2 == 0 else list(reversed(pythons))
            for label in order:
                out = Path(tmp) / f"{label}-{r}.json"
                subprocess.run([pythons[label], __file__, "--child", str(spec_path), str(out)], check=True)
                runs[label].append(json.loads(out.read_text()))
                print(f"round {r + 1}/{rounds}: {label} done", file=sys.stderr, flush=True)
    keys = list(runs[next(iter(runs))][0])
    labels = list(pythons)
    first = labels[0]
    table = []
    for key in keys:
        setting, workload = key.split("|")
        row = {"setting": setting, "workload": workload}
        for label in labels:
            speeds = [run[key]["tokens_per_s"] for run in runs[label]]
            row[f"{label}_tokens_per_s"] = round(statistics.median(speeds), 1)
            row[f"{label}_runs"] = [round(s, 1) for s in speeds]
            row[f"{label}_acceptance_length"] = round(runs[label][0][key]["acceptance_length"], 3)
        row["same_tokens_across_checkouts"] = all(
            runs[label][0][key]["token_ids"] == runs[first][0][key]["token_ids"] for label in labels)
        if "sampled" not in setting and f"off|{workload}" in runs[first][0]:
            off = runs[first][0][f"off|{workload}"]["token_ids"]
            row["same_as_off"] = f"{sum(a == b for a, b in zip(runs[first][0][key]['token_ids'], off))}/{len(off)}"
        table.append(row)
    head = " | ".join(f"{label} tok/s" for label in labels)
    print(f"\n| setting | workload | {head} | acceptance length ({', '.join(labels)}) | same tokens across checkouts | same as off |")
    print("| --- | --- |" + " ---: |" * len(labels) + " ---: | --- | --- |")
    for row in table:
        speeds = " | ".join(f"{row[f'{label}_tokens_per_s']:.1f}" for label in labels)
        accept = " / ".join(f"{row[f'{label}_acceptance_length']:.2f}" for label in labels)
        print(f"| {row['setting']} | {row['workload']} | {speeds} | {accept} | "
              f"{'yes' if row['same_tokens_across_checkouts'] else 'NO'} | {row.get('same_as_off', '')} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"mode": args.mode, "dtype": spec["dtype"], "rounds": rounds,
                                               "prompts_per_workload": args.prompts,
                                               "max_tokens": args.max_tokens, "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
