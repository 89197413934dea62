"""Where a CPU decode step's time goes at each thread count: the default model run from its
Q4_1 file (speculation off, batch 1, greedy), tokens/s, then
- the microseconds per layer of each piece of the decoder layers where a step's layers run
  in one parallel region (``specserve_cpu::region_times``: thread 0's clock, its own share
  of each piece; the waits for the other threads at barriers apart), and at each barrier
  how far apart the threads arrived and how long the release took;
- the microseconds per token spent outside the C++ ops (the host's Python, which no
  thread count shortens), and of each C++ op (``torch.profiler``; the projections apart by
  their shapes, the LM head among them; a checkout whose layers run op by op shows them all).
Comparing thread counts shows which pieces scale with cores and which do not (#32: plain
decoding at 8 threads ≥ 2.5x its 2-thread speed).

Each thread count runs in a process of its own; the timed pass comes first, then one with
the region's clock on, then a profiled one (the profiler adds its own cost per op).

    python benchmarks/cpu_threads.py [--threads 1,2,4,8] [--workloads chat,code] [--prompts 3]
        [--max-tokens 128] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_acceptance import machine_name

# the default model's projections by their packed weight's shape: [out features, bytes a row]
# (Q4_1: half a byte an input; the LM head, Q8_0: one)
SHAPES = {(960, 288): "qkv", (576, 288): "o", (3072, 288): "gate_up", (576, 768): "down", (49152, 576): "lm head"}
# the pieces of a layer in one parallel region, as ``region_times`` gives them (kernels/cpu_layer.cpp)
PHASES = ("input norm", "quantize", "qkv", "rotary", "attention", "o", "post norm", "gate_up", "silu·mul", "down",
          "barriers")
# a layer's barriers, by the piece before each (their times follow the layer count)
POINTS = ("qkv", "attention", "o", "gate_up", "down")
# the C++ ops a CPU step may call from Python (``host_us_per_token`` times them)
OPS = ("quant_model_logits", "quant_decoder_layers", "quant_decoder_layer", "quant_linear", "rms_norm",
       "add_rms_norm", "silu_and_mul", "rotary_tables", "rotary_store_kv", "paged_attention_short", "greedy_rows")


def host_us_per_token(llm, texts: list[str], params) -> float:
    """The microseconds per token spent outside the C++ ops (scheduling, the runner's
    Python, sampling, detokenizing): each op of ``torch.ops.specserve_cpu`` timed in a
    wrapper for one pass over ``texts``, its time taken from the pass's. This part does not
    shrink with threads."""
    namespace = torch.ops.specserve_cpu
    inside = [0.0]
    originals = {name: getattr(namespace, name) for name in OPS if hasattr(namespace, name)}

    def timed(op):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start
        return run

    for name, op in originals.items():
        setattr(namespace, name, timed(op))
    try:
        tokens, start = 0, time.perf_counter()
        for text in texts:
            tokens += len(llm.generate([text], params, use_tqdm=False)[0].token_ids)
        return round((time.perf_counter() - start - inside[0]) / tokens * 1e6, 1)
    finally:
        for name, op in originals.items():
            setattr(namespace, name, op)


def job(threads: int, workload: str, prompts: int, max_tokens: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from specserve import LLM, SamplingParams
    from specserve.bench.prompt_sets import chat_prompts, held_out_prompts

    llm = LLM(cpu_threads=threads, kv_cache_memory_gib=0.25, max_num_seqs=4)
    texts = chat_prompts(llm.engine.tokenizer, held_out_prompts(workload, prompts))
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(texts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    tokens, seconds = 0, 0.0
    for text in texts:
        start = time.perf_counter()
        tokens += len(llm.generate([text], params, use_tqdm=False)[0].token_ids)
        seconds += time.perf_counter() - start
    region = hasattr(torch.ops.specserve_cpu, "region_times")
    if region:
        torch.ops.specserve_cpu.region_times(True)
        for text in texts:
            llm.generate([text], params, use_tqdm=False)
        spent = torch.ops.specserve_cpu.region_times(False)
        layers = spent[len(PHASES)] or 1
        phases = {name: round(us / layers, 2) for name, us in zip(PHASES, spent)}
        points = spent[len(PHASES) + 1:]  # per barrier: the arrivals' spread, then the release
        spreads = {name: round(points[2 * i] / layers, 2) for i, name in enumerate(POINTS)} if points else None
        release = round(sum(points[1::2]) / layers, 2) if points else None
    host = host_us_per_token(llm, texts, params)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        n = len(llm.generate([texts[0]], params, use_tqdm=False)[0].token_ids)
    ops: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        if not event.key.startswith("specserve_cpu::"):
            continue
        name = event.key.removeprefix("specserve_cpu::")
        if name == "quant_linear":
            shapes = event.input_shapes
            packed = shapes[1] if len(shapes) > 1 and len(shapes[1]) == 2 else None
            if packed is None:
                continue
            label = SHAPES.get(tuple(packed), f"{packed[0]} x {packed[1]} bytes")
            if shapes[0] and shapes[0][0] != 1:
                label += f" ({shapes[0][0]} rows)"
            name = f"quant_linear {label}"
        ops[name] = ops.get(name, 0.0) + event.self_cpu_time_total / n
    llm.close()
    return {"threads": threads, "workload": workload, "tokens_per_s": tokens / seconds,
            "ms_per_token": seconds / tokens * 1e3, "torch_threads": torch.get_num_threads(),
            "host_us_per_token": host,
            "region_us_per_layer": phases if region else None,
            "barrier_spread_us_per_layer": spreads if region else None,
            "barrier_release_us_per_layer": release if region else None,
            "profiled_us_per_token": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--workloads", default="chat,code")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # one (threads, workload), in this process
    args = parser.parse_args()
    if args.job:
        threads, workload = args.job.split(":")
        print(json.dumps(job(int(threads), workload, args.prompts, args.max_tokens)))
        return
    rows = []
    for workload in args.workloads.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            done = subprocess.run([sys.executable, __file__, "--job", f"{threads}:{workload}", "--prompts",
                                   str(args.prompts), "--max-tokens", str(args.max_tokens)],
                                  check=False, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    title = (f"\n{machine_name(torch.device('cpu'))}; the default model's Q4_1 file, speculation off, batch 1, "
             f"greedy, {args.max_tokens} tokens, {args.prompts} held-out prompts\n")
    print(title)
    if any(row["region_us_per_layer"] for row in rows):
        print("Microseconds per layer, in one parallel region (thread 0's clock):\n")
        print("| workload | threads | tokens/s | ms/token | " + " | ".join(PHASES) + " | layer |")
        print("| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in PHASES) + " | ---: |")
        for row in rows:
            phases = row["region_us_per_layer"] or {}
            print(f"| {row['workload']} | {row['threads']} | {row['tokens_per_s']:.1f} | {row['ms_per_token']:.2f} | "
                  + " | ".join(f"{phases.get(name, 0):.1f}" for name in PHASES)
                  + f" | {sum(phases.values()):.1f} |")
        print()
    if any(row.get("barrier_spread_us_per_layer") for row in rows):
        print("At each barrier, microseconds per layer: how long after the first thread the last arrived "
              "(after the piece named), and the releases' sum (after the last arrival):\n")
        print("| workload | threads | " + " | ".join(f"after {name}" for name in POINTS) + " | releases |")
        print("| --- | ---: | " + " | ".join("---:" for _ in POINTS) + " | ---: |")
        for row in rows:
            spreads = row.get("barrier_spread_us_per_layer") or {}
            print(f"| {row['workload']} | {row['threads']} | " + " | ".join(f"{spreads.get(name, 0):.1f}" for name in POINTS)
                  + f" | {row.get('barrier_release_us_per_layer') or 0:.1f} |")
        print()
    names = sorted({name for row in rows for name in row["profiled_us_per_token"]},
                   key=lambda name: -max(row["profiled_us_per_token"].get(name, 0) for row in rows))
    print("Microseconds per token outside the C++ ops (host), then by C++ op (torch.profiler):\n")
    print("| workload | threads | tokens/s | ms/token | host | " + " | ".join(names) + " |")
    print("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for row in rows:
        ops = row["profiled_us_per_token"]
        print(f"| {row['workload']} | {row['threads']} | {row['tokens_per_s']:.1f} | {row['ms_per_token']:.2f} | "
              f"{row['host_us_per_token']:.0f} | " + " | ".join(f"{ops.get(name, 0):.0f}" for name in names) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_name(torch.device('cpu')), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
