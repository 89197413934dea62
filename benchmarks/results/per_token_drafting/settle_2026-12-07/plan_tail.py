"""The plan phase (``Speculator.plan``, the host time between two verify passes) of steps
with 48 or more requests, from ``benchmarks/step_records.py`` records (json or json.gz),
per setting and round, speculation off left out (its plan takes 1-2 µs).

    python plan_tail.py records_*.json.gz
"""
import gzip
import json
import sys

import numpy as np


def load(path: str) -> dict:
    with (gzip.open(path) if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


for f in sys.argv[1:]:
    d = load(f)
    print(f"\n{f.split('/')[-1]} ({d['machine']['gpu']})\n")
    print("| setting | round | steps | plan µs: median | mean | p95 | max | plans over 150 µs | their µs a step | plan share of step time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in d["runs"]:
        s = [x for x in r["steps"] if x[0] >= 48]
        if not s or r["setting"] == "off":
            continue
        ch = np.array([x[6] for x in s]) * 1e6
        step = np.array([x[4] for x in s]) * 1e6
        big = ch[ch > 150]
        print(f"| {r['setting']} | {r['round']} | {len(s)} | {np.median(ch):.0f} | {ch.mean():.0f} | "
              f"{np.percentile(ch, 95):.0f} | {ch.max():.0f} | {len(big)} | {big.sum() / len(s):.0f} | "
              f"{100 * ch.sum() / step.sum():.1f} % |")
