"""Each run's fresh plans from ``plans.py``'s log beside ``step_records.py``'s JSON: by
batch size, how many plans drafted, their mean promise factor, and the drafted plans'
expected goodput over the bar (requests over the measured step without drafts, or the
fit's where none was measured).

    python plan_summary.py PLANS_JSON RECORDS_JSON
"""
import json
import sys
from collections import defaultdict

with open(sys.argv[1]) as f:
    plans = json.load(f)["log"]
with open(sys.argv[2]) as f:
    runs = json.load(f)["runs"]
segments, current = [], None
for row in plans:
    if row[0] == "run":
        current = []
        segments.append((row[1], current))
    elif current is not None:
        current.append(row)
assert len(segments) == len(runs), (len(segments), len(runs))
print("| workload | round | setting | tok/s | plans: 1-7 / 8-31 / 32+ requests (drafting of all) "
      "| mean promise factor, 32+ | drafted plans' goodput over the bar, 32+ |")
print("| --- | ---: | --- | ---: | --- | ---: | ---: |")
for run, (_, rows) in zip(runs, segments):
    if not rows:
        continue
    buckets = defaultdict(lambda: [0, 0])
    promise, over = [], []
    for _, _, n, prefill, drafts, drafting, goodput, fixed, plain, factor, _ in rows:
        b = "1-7" if n < 8 else "8-31" if n < 32 else "32+"
        buckets[b][0] += drafts > 0
        buckets[b][1] += 1
        if b == "32+":
            promise.append(factor)
            if drafts:
                over.append(goodput / (n / (plain or fixed)))
    cells = " / ".join(f"{buckets[b][0]} of {buckets[b][1]}" for b in ("1-7", "8-31", "32+"))
    mean = lambda xs: f"{sum(xs) / len(xs):.3f}" if xs else "-"
    print(f"| {run['workload']} | {run['round']} | {run['setting']} | {run['output_throughput']:.0f} | {cells} "
          f"| {mean(promise)} | {mean(over)} |")
