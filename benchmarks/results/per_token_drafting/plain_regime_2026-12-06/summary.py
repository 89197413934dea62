"""Per workload and setting: tokens/s over speculation off's in the same round, by round
and their mean, and the steps that ran drafts (with or without a prompt chunk) of all
steps. ``python summary.py records_*.json[.gz] ...``"""
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
