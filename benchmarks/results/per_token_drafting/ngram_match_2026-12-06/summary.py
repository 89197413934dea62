"""The README's tables from this folder's JSON files: batch 1 (tokens/s against the best
fixed k and speculation off) and under load (each setting over off's run of its round)."""
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent

for path in sorted(HERE.glob("*/*batch1*.json")):
    data = json.loads(path.read_text())
    print(f"\n{path.relative_to(HERE)} ({data['machine']})")
    for workload in ("chat", "code"):
        rows = {r["setting"]: r for r in data["rows"] if r["workload"] == workload}
        best = max((s for s in rows if s.startswith("k=")), key=lambda s: rows[s]["tokens_per_s"])
        print(f"  {workload}: off {rows['off']['tokens_per_s']:.1f}, best fixed {best} {rows[best]['tokens_per_s']:.1f}; "
              + "; ".join(f"{s} {r['tokens_per_s']:.1f} ({r['tokens_per_s'] / rows[best]['tokens_per_s']:.3f} of best, "
                          f"{r['tokens_per_s'] / rows['off']['tokens_per_s']:.3f} of off, AL {r['acceptance_length']})"
                          for s, r in rows.items() if s.startswith("adaptive")))

for path in sorted(HERE.glob("*/*.json")):
    if "batch1" in path.name:
        continue
    data = json.loads(path.read_text())
    by = {}
    for run in data["runs"]:
        key = (run["label"].split(" @")[0].split(", round")[0], run["request_rate"])
        by.setdefault(key, {})[run["round"]] = run["output_throughput"]
    print(f"\n{path.relative_to(HERE)}")
    for (label, rate), rounds in sorted(by.items(), key=lambda kv: (str(kv[0][1]), kv[0][0])):
        off = by[("spec off", rate)]
        ratios = [rounds[i] / off[i] for i in sorted(rounds)]
        print(f"  {rate} req/s {label}: " + ", ".join(f"{rounds[i]:.1f}" for i in sorted(rounds))
              + f" tok/s; over off {', '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f})")
