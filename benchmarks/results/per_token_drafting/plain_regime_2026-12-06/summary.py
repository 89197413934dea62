"""Per workload and setting: tokens/s over speculation off's in the same round, by round
and their mean, and the steps that ran drafts (with or without a prompt chunk) of all
steps; then per run, for steps of 48 or more requests, tokens emitted a millisecond by
kind of step (plain, prompt, prompt + drafts; with their share of the run's time) and of
the plain ones, those right after a step with drafts and those after one without (with
their counts).
``python summary.py records_*.json[.gz] ...``"""
import gzip
import json
import sys
from collections import defaultdict


def load(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)


for path in sys.argv[1:]:
    results = load(path)
    col = {name: i for i, name in enumerate(results["fields"])}
    off = {(r["workload"], r["round"]): r["output_throughput"] for r in results["runs"] if r["setting"] == "off"}
    rows = defaultdict(list)
    for r in results["runs"]:
        drafted = sum(1 for s in r["steps"] if s[col["drafts"]] > 0)
        rows[(r["workload"], r["setting"])].append((r["output_throughput"] / off[(r["workload"], r["round"])],
                                                    drafted, len(r["steps"])))
    print(f"\n{path}\n\n| workload | setting | x off by round | mean | steps with drafts / all, by round |")
    print("| --- | --- | --- | ---: | --- |")
    for (workload, setting), runs in rows.items():
        ratios = " / ".join(f"{x:.3f}" for x, _, _ in runs)
        steps = " / ".join(f"{d}/{n}" for _, d, n in runs)
        print(f"| {workload} | {setting} | {ratios} | {sum(x for x, _, _ in runs) / len(runs):.3f} | {steps} |")

    print("\n| setting | round | plain | prompt | prompt + drafts | plain after drafts | plain after none |")
    print("| --- | ---: | --- | --- | --- | --- | --- |")
    for r in results["runs"]:
        steps, total = r["steps"], sum(s[col["step_s"]] for s in r["steps"])
        kinds = defaultdict(lambda: [0, 0.0, 0])
        for before, s in zip([None] + steps, steps):
            if s[col["requests"]] < 48:
                continue
            prompt, drafted = s[col["prefill_tokens"]] > 0, s[col["drafts"]] > 0
            names = [("prompt + drafts" if drafted else "prompt") if prompt else ("drafts" if drafted else "plain")]
            if names[0] == "plain" and before is not None:
                names.append("after drafts" if before[col["drafts"]] > 0 else "after none")
            for name in names:
                kinds[name][0] += s[col["emitted"]]
                kinds[name][1] += s[col["step_s"]]
                kinds[name][2] += 1

        def cell(name, share=True, kinds=kinds, total=total):
            tokens, seconds, count = kinds.get(name, (0, 0.0, 0))
            if not seconds:
                return "-"
            return f"{tokens / seconds / 1e3:.1f}" + (f" ({seconds / total:.0%})" if share else f" ({count})")
        print(f"| {r['setting']} | {r['round']} | {cell('plain')} | {cell('prompt')} | {cell('prompt + drafts')} | "
              f"{cell('after drafts', False)} | {cell('after none', False)} |")
