"""The all-at-once runs of ``sweep_records.json`` by phase: the steps that carried prompt
chunks, those with 16 or more requests decoding, 8-15 and fewer than 8 (the drained
tail): steps, seconds and tokens of each, and goodput (tokens per ms).

    python phases.py sweep_records.json
"""
import json
import sys

with open(sys.argv[1] if len(sys.argv) > 1 else "sweep_records.json") as f:
    data = json.load(f)
fields = data["fields"]
print("| round | setting | tok/s | wall s | prompt steps | 16+ requests: steps, s, tokens, tok/ms "
      "| 8-15: steps, s, tokens, tok/ms | < 8: steps, s, tokens, tok/ms |")
print("| ---: | --- | ---: | ---: | --- | --- | --- | --- |")
for run in data["runs"]:
    if "steps" not in run:
        continue
    phases = {"prompt": [0, 0.0, 0], "16+": [0, 0.0, 0], "8-15": [0, 0.0, 0], "<8": [0, 0.0, 0]}
    for values in run["steps"]:
        s = dict(zip(fields, values))
        n = s["requests"]
        key = "prompt" if s["prefill_tokens"] else "16+" if n >= 16 else "8-15" if n >= 8 else "<8"
        phase = phases[key]
        phase[0] += 1
        phase[1] += s["step_s"]
        phase[2] += s["emitted"]

    def cell(p, rate=True):
        text = f"{p[0]}, {p[1]:.2f}, {p[2]:.0f}"
        return text + (f", {p[2] / p[1] / 1e3:.2f}" if rate and p[1] else "")

    print(f"| {run['round']} | {run['setting']} | {run['output_throughput']:.0f} | {run['duration']:.2f} | "
          f"{cell(phases['prompt'], False)} | {cell(phases['16+'])} | {cell(phases['8-15'])} | {cell(phases['<8'])} |")
