"""A table of ``plain_ab.py``'s records: per run, its throughput and that over speculation
off's in the same round; its steps with drafts (of all); its steps of a full batch (58+ of 64
requests) without drafts or a prompt chunk: how many, their mean time and their verify
phase's; and its host phases outside the pass (choose, schedule, update, postprocess)
over all steps, per step.

    python summary.py h100_*/records_*.json.gz
"""
import gzip
import json
import sys

for path in sys.argv[1:]:
    with (gzip.open(path) if path.endswith(".gz") else open(path)) as f:
        data = json.load(f)
    fields = data["fields"]
    runs = data["runs"]
    off = {(r["workload"], r["round"]): r["output_throughput"] for r in runs if r["setting"] == "off"}
    print(f"\n{path}\n")
    print("| workload | round | setting | tok/s | x off | drafted steps | full plain steps: n, ms, verify ms "
          "| host outside the pass, ms a step |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: |")
    for r in sorted(runs, key=lambda r: (r["workload"], r["round"])):
        steps = [dict(zip(fields, s)) for s in r["steps"]]
        drafted = sum(s["drafts"] > 0 for s in steps)
        full = [s for s in steps if s["requests"] >= 58 and not s["drafts"] and not s["prefill_tokens"]]
        cell = (f"{len(full)}, {1e3 * sum(s['step_s'] for s in full) / len(full):.2f}, "
                f"{1e3 * sum(s['verify_s'] for s in full) / len(full):.2f}") if full else "-"
        host = sum(s["choose_s"] + s["schedule_s"] + s["update_s"] + s["postprocess_s"] for s in steps) / len(steps)
        base = off.get((r["workload"], r["round"]))
        ratio = f"{r['output_throughput'] / base:.3f}" if base else "-"
        print(f"| {r['workload']} | {r['round']} | {r['setting']} | {r['output_throughput']:,.0f} | {ratio} | "
              f"{drafted} / {len(steps)} | {cell} | {1e3 * host:.2f} |")
