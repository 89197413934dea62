"""The deterministic mode against today's path, on the default model (bf16), in one run:
correctness first, then speed, one table last.

For each mode (``--deterministic`` off, on) and each speculation setting (off, n-gram,
the built-in draft; adaptive k, the default): batch 1 (each prompt alone) and N concurrent
requests (chat and code-edit prompts alternating), greedy, ``--max-tokens`` each.

- identical to speculation off: the fraction of requests whose tokens equal the same
  mode's speculation-off run at the same concurrency (the goal in the mode: 100%);
- identical across batch: requests whose tokens at N concurrent equal their batch-1 run;
- tokens/s of each, and the mode's cost: its tokens/s over the default path's.

    python benchmarks/deterministic.py [--device cpu|cuda] [--max-tokens 128] [--concurrent 64]
                                       [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import _card, _one_by_one, engine_run, log, median_ms  # noqa: E402

# Llama-3.1-8B's projections (out, in), for the matmul section.
GEMMS_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}


def graph_us(fn, reps: int, device: torch.device, calls: int = 20) -> float:
    """GPU time of one ``fn()`` in µs: ``calls`` of them captured in one CUDA graph, the
    replay timed (so no launch overhead, as in the engine's graphs)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return 1000 * median_ms(graph.replay, reps, device) / calls


def gemm_section(device: torch.device, reps: int) -> list[dict]:
    """The invariant Triton matmul against cuBLAS (``F.linear``) at Llama-3.1-8B's shapes,
    random bf16: whether each is row-invariant, and its GPU time (CUDA-graph replay) at 1,
    5 and 64 rows."""
    import torch.nn.functional as F

    from specserve.kernels import matmul

    out = []
    for name, (n, k) in GEMMS_8B.items():
        g = torch.Generator(device=device).manual_seed(0)
        w = (torch.randn(n, k, device=device, generator=g) * 0.02).bfloat16()
        x = torch.randn(64, k, device=device, generator=g).bfloat16()
        ours, theirs = matmul.linear(x, w), F.linear(x, w)
        row = {"gemm": name, "n": n, "k": k,
               "invariant_ours": all(torch.equal(matmul.linear(x[:m], w), ours[:m]) for m in (1, 2, 5, 17, 63)),
               "invariant_cublas": all(torch.equal(F.linear(x[:m], w), theirs[:m]) for m in (1, 2, 5, 17, 63)),
               "max_abs_diff": float((ours.float() - theirs.float()).abs().max())}
        for m in (1, 5, 64):
            xm = x[:m].clone()
            row[f"m{m}_ours_us"] = round(graph_us(lambda: matmul.linear(xm, w), reps, device), 1)
            row[f"m{m}_cublas_us"] = round(graph_us(lambda: F.linear(xm, w), reps, device), 1)
        out.append(row)
        log(json.dumps(row))
    return out

SPECULATION = {"off": dict(), "ngram": dict(speculative_method="ngram"),
               "draft": dict(speculative_method="draft_model")}


def identical(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=8)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-gemm", action="store_true", help="CUDA: skip the 8B-shape matmul section")
    ap.add_argument("--gemm-only", action="store_true", help="CUDA: only the 8B-shape matmul section")
    args = ap.parse_args()
    if args.gemm_only:
        gemms = gemm_section(torch.device(args.device), reps=50)
        if args.json:
            Path(args.json).write_text(json.dumps({"card": _card(), "gemm": gemms}, indent=1))
        gemm_table(_card(), gemms)
        return

    from specserve import LLM
    from workloads import WORKLOADS, chat_prompts

    common = dict(device=args.device, dtype="bfloat16", max_num_seqs=args.concurrent,
                  max_num_batched_tokens=2048 if args.device != "cpu" else 512, max_model_len=4096)
    if args.device != "cpu":
        common["gpu_memory_utilization"] = 0.08  # several engines live in this process
    card = _card() if args.device != "cpu" else "CPU"
    rows, record = [], {"card": card, "args": vars(args)}
    tok = None
    for deterministic in (False, True):
        runs = {}
        for name, spec in SPECULATION.items():
            log(f"deterministic={deterministic}, speculation {name}: loading")
            llm = LLM(deterministic=deterministic, **spec, **common)
            if tok is None:
                tok = llm.tokenizer
                chat = chat_prompts(tok, WORKLOADS["chat"])
                code = chat_prompts(tok, WORKLOADS["code-edit"])
                mixed = [p for pair in zip(chat, code) for p in pair]
                mixed = (mixed * (args.concurrent // len(mixed) + 1))[:args.concurrent]
                half = args.batch1_prompts // 2
                single = chat[:half] + code[:args.batch1_prompts - half]
            # Warm-up on the very prompts: no kernel compiles or graph captures inside a timing.
            _one_by_one(llm, single[:2], 8, None)
            engine_run(llm, mixed, 8)
            b1 = _one_by_one(llm, single, args.max_tokens, None)
            bn = engine_run(llm, mixed, args.max_tokens)
            runs[name] = (b1, bn)
            log(f"  batch 1: {b1['tokens_per_s']:.1f} tok/s; {args.concurrent} concurrent: "
                f"{bn['tokens_per_s']:.1f} tok/s")
            del llm
            if args.device != "cpu":
                torch.cuda.empty_cache()
        off_b1, off_bn = runs["off"]
        for name, (b1, bn) in runs.items():
            # Batch invariance: each batch-1 prompt's tokens against its first occurrence
            # among the N concurrent ones.
            first = {p: i for i, p in reversed(list(enumerate(mixed)))}
            across = identical(b1["token_ids"], [bn["token_ids"][first[p]] for p in single])
            row = {"deterministic": deterministic, "speculation": name,
                   "b1_tokens_per_s": round(b1["tokens_per_s"], 1),
                   "b1_acceptance_length": round(b1["acceptance_length"], 2) if b1["acceptance_length"] else None,
                   "b1_identical_to_off": identical(b1["token_ids"], off_b1["token_ids"]),
                   f"c{args.concurrent}_tokens_per_s": round(bn["tokens_per_s"], 1),
                   f"c{args.concurrent}_identical_to_off": identical(bn["token_ids"], off_bn["token_ids"]),
                   "identical_across_batch": across, "card": card}
            rows.append(row)
            log(json.dumps(row))
    record["rows"] = rows
    gemms = []
    if args.device != "cpu" and not args.skip_gemm:
        gemms = record["gemm"] = gemm_section(torch.device(args.device), reps=50)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    c = args.concurrent
    log(f"\n{card}, default model bf16, greedy, {args.max_tokens} tokens, adaptive k")
    log(f"| mode | speculation | batch 1 tok/s | identical to off | {c} concurrent tok/s | identical to off "
        "| batch 1 = concurrent |")
    log("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        log(f"| {'deterministic' if r['deterministic'] else 'default'} | {r['speculation']} | "
            f"{r['b1_tokens_per_s']} | {r['b1_identical_to_off']:.0%} | {r[f'c{c}_tokens_per_s']} | "
            f"{r[f'c{c}_identical_to_off']:.0%} | {r['identical_across_batch']:.0%} |")
    by = {(r["deterministic"], r["speculation"]): r for r in rows}
    for name in SPECULATION:
        log(f"mode cost, speculation {name}: batch 1 "
            f"{by[(True, name)]['b1_tokens_per_s'] / by[(False, name)]['b1_tokens_per_s']:.3f}x, {c} concurrent "
            f"{by[(True, name)][f'c{c}_tokens_per_s'] / by[(False, name)][f'c{c}_tokens_per_s']:.3f}x")
    if gemms:
        gemm_table(card, gemms)


def gemm_table(card: str, gemms: list[dict]) -> None:
    log(f"\n{card}, Llama-3.1-8B shapes, bf16, GPU µs per call (graph replay, median of 50): "
        "invariant Triton matmul / cuBLAS")
    log("| gemm | N x K | row-invariant: ours / cuBLAS | 1 row | 5 rows | 64 rows |")
    log("| --- | --- | --- | --- | --- | --- |")
    for r in gemms:
        log(f"| {r['gemm']} | {r['n']} x {r['k']} | {r['invariant_ours']} / {r['invariant_cublas']} | "
            + " | ".join(f"{r[f'm{m}_ours_us']} / {r[f'm{m}_cublas_us']}" for m in (1, 5, 64)) + " |")

if __name__ == "__main__":
    main()
