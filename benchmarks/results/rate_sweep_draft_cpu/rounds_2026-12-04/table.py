"""The sweep's table: per workload and rate, adaptive over off by round, median, TPOT, mean k."""
import json
import statistics
import sys

for path in sys.argv[1:]:
    with open(path) as f:
        d = json.load(f)
    rows = {}
    for r in d["runs"]:
        rows.setdefault((str(r["request_rate"]), r["round"]), {})[r["speculation"]] = r
    for rate in dict.fromkeys(k[0] for k in rows):
        ratios, ks, tpot = [], [], [[], []]
        for rnd in sorted(k[1] for k in rows if k[0] == rate):
            x = rows[(rate, rnd)]
            off, ad = x["spec off"], x["draft_model k=4 adaptive"]
            ratios.append(ad["output_throughput"] / off["output_throughput"])
            dl = ad.get("spec_decode_draft_lengths") or {}
            n = sum(dl.values())
            ks.append(sum(int(k) * v for k, v in dl.items()) / n if n else 0.0)
            tpot[0].append(off["mean_tpot_ms"])
            tpot[1].append(ad["mean_tpot_ms"])
        print(f"| {d['runs'][0]['workload']} | {rate} | " + ", ".join(f"{v:.2f}x" for v in ratios)
              + f" | {statistics.median(ratios):.2f}x | {statistics.mean(tpot[0]):.1f} / {statistics.mean(tpot[1]):.1f}"
              f" | {min(ks):.2f}–{max(ks):.2f} |")
