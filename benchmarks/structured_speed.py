"""Structured output's speed at batch 1: the 22 JSON schemas of ``json_schemas.py`` through
their chat prompts, greedy, one request at a time, on the default model.

Settings (the unconstrained rows generate as many tokens as the constrained output of the
same prompt, EOS ignored, so each row times the same token counts):

- ``off``: unconstrained, speculation off (the baseline);
- ``draft``: unconstrained, the built-in draft;
- ``json``: constrained, no drafts at all (k = 0);
- ``json+forced``: constrained, the grammar's forced tokens as drafts;
- ``json+forced+draft`` / ``json+forced+ngram``: forced tokens merged with a drafter's.

    python benchmarks/structured_speed.py --json out.json
    python benchmarks/structured_speed.py --device cuda --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from specserve import LLM, SamplingParams
from specserve.bench.cli import describe_machine
from specserve.bench.json_schemas import SCHEMA_TASKS

ENGINES = {"none": {}, "draft_model": {"speculative_method": "draft_model"}, "ngram": {"speculative_method": "ngram"}}
SETTINGS = [("off", "none"), ("draft", "draft_model"), ("json", "none"), ("json+forced", "none"),
            ("json+forced+draft", "draft_model"), ("json+forced+ngram", "ngram")]


def params_for(setting: str, task, length: int | None) -> SamplingParams:
    if setting in ("off", "draft"):
        return SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=512, structured_outputs={"json": task.schema},
                          num_speculative_tokens=0 if setting == "json" else None)


def run(llm: LLM, setting: str, tasks, prompts: list[str], lengths: list[int | None]) -> dict:
    tokens, seconds, outs = 0, 0.0, []
    for task, prompt, length in zip(tasks, prompts, lengths):
        params = params_for(setting, task, length)
        started = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - started
        tokens += len(out.token_ids)
        outs.append(out)
    valid = 0
    if setting.startswith("json"):
        import jsonschema
        for task, out in zip(tasks, outs):
            try:
                jsonschema.validate(json.loads(out.text), task.schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    return {"setting": setting, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "valid": valid if setting.startswith("json") else None, "lengths": [len(o.token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every setting, taking turns")
    parser.add_argument("--limit", type=int, default=None, help="the first N schemas only (a quick look)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tasks = SCHEMA_TASKS[:args.limit]
    # three engines in one process: each takes a share of a GPU's memory, not 90 %
    share = {} if args.device == "cpu" else {"kv_cache_memory_gib": 4.0}
    engines = {name: LLM(None, device=args.device, **share, **kw) for name, kw in ENGINES.items()}
    tokenizer = engines["none"].tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t.prompt}], tokenize=False,
                                             add_generation_prompt=True) for t in tasks]
    for llm in engines.values():  # warm-up: each engine, constrained and not
        llm.generate(prompts[:2], [params_for("json+forced", t, None) for t in SCHEMA_TASKS[:2]], use_tqdm=False)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    lengths = run(engines["none"], "json", tasks, prompts, [None] * len(prompts))["lengths"]
    rows = []
    for _ in range(args.rounds):
        for setting, engine in SETTINGS:
            rows.append(run(engines[engine], setting, tasks, prompts, lengths))
    forced = {name: vars(llm.engine.forced_draft_stats) for name, llm in engines.items()}
    machine = describe_machine()
    print(f"{len(tasks)} schemas, batch 1, greedy; {machine}")
    base = statistics.median(r["tokens_per_s"] for r in rows if r["setting"] == "off")
    print(f"{'setting':<20}{'tokens/s':>10}{'vs off':>8}{'valid':>8}")
    for setting, _ in SETTINGS:
        mine = [r for r in rows if r["setting"] == setting]
        tps = statistics.median(r["tokens_per_s"] for r in mine)
        valid = "" if mine[0]["valid"] is None else f"{mine[0]['valid']}/{len(tasks)}"
        print(f"{setting:<20}{tps:>10.1f}{tps / base:>7.2f}x{valid:>8}")
    for name, stats in forced.items():
        if stats["num_draft_tokens"]:
            print(f"forced drafts ({name} engine): {stats['num_accepted_tokens']}/{stats['num_draft_tokens']} accepted")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rows": rows, "forced": forced}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
